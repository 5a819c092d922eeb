"""`reasoning_gym:NAME[,NAME...]`: procedural tasks from the `reasoning-gym` package, scored by its own
`score_answer`.

Invariants:
  - Training prompts are a finite data set of `task.dataset_size` entries (split evenly over the
    names), generated from the run seed, so every rollout worker builds the same set and the prompt
    stream can partition it (rollout/tasks/stream.py). The eval set is generated from a fixed seed
    (the same at every run seed); training entries that share a question text with an eval entry are
    left out, and ids differ by construction (`rg-NAME-train-I` / `rg-NAME-eval-I`).
  - The reward is reasoning-gym's score of the completion's answer: the text inside the last
    <answer>...</answer> when there is one (reasoning-gym's own convention), else the whole
    completion, stripped. Its scores lie in [0, 1].
  - An unknown NAME fails at start-up, listing every available name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollout.tasks.base import Prompt, TaskError
from rollout.tasks.records import EVAL_ORDER_SEED, FiniteSplitTask

if TYPE_CHECKING:
    from parity.config.task import TaskConfig


def _jsonable(value: Any) -> Any:
    """reasoning-gym metadata holds tuples; rewards and the wire get JSON types."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class ReasoningGymTask(FiniteSplitTask):
    """One or more reasoning-gym generators as one finite task."""

    def __init__(self, names: Sequence[str], seed: int, dataset_size: int, eval_size: int) -> None:
        import reasoning_gym

        self.name = "reasoning_gym:" + ",".join(names)
        self.seed = seed
        self._datasets: dict[str, Any] = {}
        per_name = max(1, dataset_size // len(names))
        per_name_eval = max(1, eval_size // len(names))
        evals, train = [], []
        for name in names:
            train_ds = reasoning_gym.create_dataset(name, size=per_name, seed=seed)
            eval_ds = reasoning_gym.create_dataset(name, size=per_name_eval, seed=EVAL_ORDER_SEED)
            self._datasets[name] = train_ds
            evals += [self._prompt(name, "eval", i, entry) for i, entry in enumerate(eval_ds)]
            train += [self._prompt(name, "train", i, entry) for i, entry in enumerate(train_ds)]
        held_out = {p.text for p in evals}
        self._train = [p for p in train if p.text not in held_out]
        self._eval = evals
        if not self._train:
            raise TaskError(f"task.dataset_size: {self.name} has no training entries left")

    @staticmethod
    def _prompt(name: str, split: str, index: int, entry: dict) -> Prompt:
        metadata = {"source_dataset": name, "entry": _jsonable(entry)}
        return Prompt(f"rg-{name}-{split}-{index}", entry["question"], str(entry["answer"]), (), metadata)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        from reasoning_gym.utils import extract_answer

        dataset = self._datasets[prompt.metadata["source_dataset"]]
        answer = extract_answer(completion_text)
        answer = completion_text.strip() if answer is None else answer.strip()
        return float(dataset.score_answer(answer=answer, entry=prompt.metadata["entry"]))


def available_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def reasoning_gym_task(spec: str, seed: int, config: TaskConfig) -> ReasoningGymTask:
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise TaskError(
            "task.name: reasoning_gym: needs the `reasoning-gym` package (pip install 'parity[tasks]')"
        ) from None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise TaskError("task.name: reasoning_gym: needs at least one NAME (reasoning_gym:NAME[,NAME])")
    known = available_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise TaskError(
            f"task.name: unknown reasoning-gym name(s) {', '.join(map(repr, unknown))}; "
            f"available: {', '.join(known)}"
        )
    return ReasoningGymTask(names, seed, config.dataset_size, max(config.eval_size, 1))
