"""Records of a user data set -> `Prompt`s, and the held-out split of a finite task.

A record is a mapping with `prompt` (text) or `messages` (a list of {role, content}), `answer`, an
optional `id` and anything else (kept as metadata, handed to rewards). The field names of prompt,
answer and id are `task.prompt_field`, `task.answer_field`, `task.id_field`.

Invariants:
  - Validation is total and eager: every record is checked when the task is built (start-up), and
    the first bad one raises `TaskError` naming where it is (`file:line` or `dataset row N`) and
    the field.
  - Ids are unique within a source; a record without an id gets `<source>-<index>`.
  - The held-out split is disjoint from training by id AND by text: with `task.eval_task`, training
    records that share an id or a prompt text with an eval record are removed from training; with
    `task.eval_fraction`, a record is held out by a hash of its prompt text (not of the seed), so
    equal texts land on the same side and the eval set is the same at every seed.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rollout.tasks.base import Prompt, TaskError

if TYPE_CHECKING:
    from parity.config.task import TaskConfig

log = logging.getLogger("parity.rollout.tasks")
EVAL_ORDER_SEED = 1_000_003  # the eval set's order is the same at every run seed
ROLES = frozenset({"system", "user", "assistant"})


def _text(value: Any, where: str, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TaskError(f"{where}: field {field!r} must be a string or a number, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise TaskError(f"{where}: field {field!r} is empty")
    return text


def _messages(value: Any, where: str, field: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise TaskError(f"{where}: field {field!r} must be a non-empty list of {{role, content}}")
    turns = []
    for i, turn in enumerate(value):
        if not isinstance(turn, Mapping) or set(turn) - {"role", "content"} or "content" not in turn:
            raise TaskError(f"{where}: field {field}[{i}] must be an object with 'role' and 'content'")
        role = turn.get("role", "user")
        if role not in ROLES:
            raise TaskError(f"{where}: field {field}[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        turns.append((role, _text(turn["content"], where, f"{field}[{i}].content")))
    if turns[-1][0] == "assistant":
        raise TaskError(f"{where}: field {field!r} must not end with an assistant turn (the model answers)")
    return tuple(turns)


def render_messages(messages: Sequence[tuple[str, str]]) -> str:
    """A chat as one text: the identity used for disjointness and what logs and eval.json show."""
    return "\n".join(f"{role}: {content}" for role, content in messages)


def to_prompt(record: Any, where: str, default_id: str, config: TaskConfig) -> Prompt:
    """One record -> a Prompt; `where` ("file.jsonl:12") is named by every error."""
    if not isinstance(record, Mapping):
        raise TaskError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    prompt_field, answer_field, id_field = config.prompt_field, config.answer_field, config.id_field
    has_prompt = record.get(prompt_field) is not None
    has_messages = record.get("messages") is not None
    if has_prompt == has_messages:
        raise TaskError(f"{where}: a record needs exactly one of {prompt_field!r} or 'messages'")
    if record.get(answer_field) is None:
        raise TaskError(f"{where}: missing field {answer_field!r}")
    answer = _text(record[answer_field], where, answer_field)
    prompt_id = _text(record[id_field], where, id_field) if record.get(id_field) is not None else default_id
    # Every other field is metadata; a "metadata" object is merged in (the documented form).
    metadata = {
        k: v for k, v in record.items() if k not in {prompt_field, answer_field, id_field, "messages"}
    }
    if isinstance(metadata.get("metadata"), Mapping):
        metadata = {**{k: v for k, v in metadata.items() if k != "metadata"}, **metadata["metadata"]}
    if has_messages:
        messages = _messages(record["messages"], where, "messages")
        return Prompt(prompt_id, render_messages(messages), answer, messages, metadata)
    return Prompt(prompt_id, _text(record[prompt_field], where, prompt_field), answer, (), metadata)


def check_unique_ids(prompts: Iterable[tuple[str, Prompt]]) -> None:
    """`prompts` are (where, prompt); a repeated id names both places."""
    seen: dict[str, str] = {}
    for where, prompt in prompts:
        if prompt.prompt_id in seen:
            raise TaskError(
                f"{where}: id {prompt.prompt_id!r} repeats the record at {seen[prompt.prompt_id]}"
            )
        seen[prompt.prompt_id] = where


def _held_out(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_held_out(
    prompts: Sequence[Prompt], eval_prompts: Sequence[Prompt] | None, fraction: float, source: str
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval), disjoint by id and by text (module docstring)."""
    if eval_prompts is None:
        evals = [p for p in prompts if _held_out(p.text, fraction)]
        train = [p for p in prompts if not _held_out(p.text, fraction)]
    else:
        evals = list(eval_prompts)
        ids, texts = {p.prompt_id for p in evals}, {p.text for p in evals}
        train = [p for p in prompts if p.prompt_id not in ids and p.text not in texts]
        if len(train) < len(prompts):
            log.warning(
                "%s: %d training record(s) share an id or a prompt text with task.eval_task; "
                "they are left out of training",
                source,
                len(prompts) - len(train),
            )
    if not train:
        raise TaskError(f"task.name: {source} leaves no training records after the held-out split")
    return train, evals


class FiniteSplitTask:
    """What every finite task shares: a training set streamed by PromptStream (epochs, fleet
    partition) from `seed`, and the first n of a held-out list. Subclasses set `seed`, `_train`
    and `_eval`."""

    seed: int
    _train: list[Prompt]
    _eval: list[Prompt]

    def train_set(self) -> Sequence[Prompt]:
        return self._train

    def train_prompts(self) -> Iterator[Prompt]:
        from rollout.tasks.stream import PromptStream

        stream = PromptStream(self, seed=self.seed)
        while True:
            yield stream.next()

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n <= 0:
            raise ValueError(f"n: must be > 0 (got {n})")
        return self._eval[:n]


class DatasetTask(FiniteSplitTask):
    """A finite task over validated prompts; the reward is the task's `default_reward` (rollout.rewards)."""

    def __init__(self, name: str, train: Sequence[Prompt], evals: Sequence[Prompt], seed: int = 0) -> None:
        self.name = name
        self.seed = seed
        self._train = list(train)
        self._eval = list(evals)
        random.Random(EVAL_ORDER_SEED).shuffle(self._eval)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        from rollout.rewards.builtin import exact

        return exact(prompt.text, completion_text, prompt.answer, prompt.metadata)
