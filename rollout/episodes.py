"""Multi-turn episodes, token-in/token-out: one token sequence of model and environment turns.

    ids = prompt_ids(reset(record))                       # the first observation, chat-templated once
    loop:
        turn = generate(ids, max_tokens=min(task.max_tokens, budget))    # the engine's exact tokens
        episode += turn.token_ids  (mask 1, logprobs, weight and context versions)
        observation, reward, done = env.step(turn.text)
        if done or max_turns: end
        obs_ids = observation_ids(observation)             # tokenized once, with the template's
        episode += obs_ids          (mask 0)               #   turn delimiters
        ids = ids + turn.token_ids + obs_ids               # the next prompt is the exact prefix

Invariants:
- Model tokens are exactly the tokens the engine sampled, never decoded and re-encoded; the next
  turn's prompt is the exact token prefix. `check_exact` compares every recorded model turn with the
  engine's own output (counted: `token_mismatches`, 0 in a correct run); `retokenization_drift`
  counts the positions a decode-then-encode round trip would have changed (what other systems train
  on by mistake; reported, never used).
- Each model turn is its own engine request, so its per-token weight and context versions come from
  the engine (a turn prefills the whole prefix at its first token's version; a keep-mode update
  inside a turn makes the later tokens mixed-context, as for single completions).
- An episode ends with a reason: done (the environment said so), max_turns, context_length (the next
  turn would not fit task.max_episode_tokens, or a model turn hit max_tokens without ending), or
  environment_error (EnvironmentFailed: raised, timed out, malformed or oversized). An episode that
  ended in an environment error is never scored: its group is dropped by the caller.
- The episode's reward is its return: the sum of the environment's turn rewards.
- Tests only: `fault` (rollout.fault) injects a multi-turn class of parity/faults.py into the loop,
  for turns sampled at a version where it is active. episode_retokenized: the next turn's prompt is
  the decode-then-encode round trip of the episode so far (the recorded tokens stay the sampled
  ones). episode_version_tag: a later turn's tokens are tagged with the first turn's version.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from parity.faults import FaultSpec
from rollout.engine import CompletionResult
from rollout.environments.base import AsyncEpisodeEnv, EnvironmentFailed

log = logging.getLogger(__name__)
# Tests only: a multi-turn fault that changed a turn (bench/faults_live.py counts these lines).
FAULTY_TURN_LOG = "fault %s changed model turn %d (sampled at version %d, recorded as %d)"
# Tests only: the rollouts whose turns it changed (bench/faults_live.py finds the step that trained
# the first of them in trained_rollouts.jsonl).
FAULTY_ROLLOUTS_LOG = "fault %s changed model turns of rollouts %s"

EndReason = Literal["done", "max_turns", "context_length", "environment_error"]
# generate(prompt_token_ids, max_tokens, turn_index) -> one completion of the engine
Generate = Callable[[list[int], int, int], Awaitable[CompletionResult]]


@dataclass
class TurnRecord:
    role: Literal["model", "environment"]
    start: int
    end: int
    reward: float | None = None
    finish_reason: str = ""


@dataclass
class Episode:
    """One episode after the prompt (the fields of a RolloutSample; rollouts.proto)."""

    first_observation: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # model tokens only
    weight_versions: list[int] = field(default_factory=list)  # model tokens only
    context_versions: list[int] = field(default_factory=list)  # model tokens only
    turns: list[TurnRecord] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # the decoded model turns handed to the environment
    observations: list[str] = field(default_factory=list)
    end: EndReason = "done"
    error: str = ""
    error_reason: str = ""  # EnvironmentFailed.reason
    reward: float = 0.0
    token_mismatches: int = 0
    engine_turns: list[list[int]] = field(default_factory=list)
    faulty_turns: int = 0  # tests only: model turns a multi-turn fault changed (rollout.fault)

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    def text(self, tokenizer) -> str:
        """The whole sequence decoded (special tokens kept: the turn delimiters show)."""
        return tokenizer.decode(self.token_ids, skip_special_tokens=False)

    def check_exact(self) -> int:
        """Model tokens that differ from what the engine returned for their turn (0 when exact)."""
        model_turns = [t for t in self.turns if t.role == "model"]
        differ = abs(len(model_turns) - len(self.engine_turns))
        for turn, sampled in zip(model_turns, self.engine_turns, strict=False):
            recorded = self.token_ids[turn.start : turn.end]
            differ += sum(a != b for a, b in zip(recorded, sampled, strict=False))
            differ += abs(len(recorded) - len(sampled))
        self.token_mismatches = differ
        return differ


class TurnTemplate:
    """Renders an observation as the tokens of one user turn plus the assistant cue, with the chat
    template's own delimiters, tokenized once. The text between a finished model turn and the next
    user message is taken from the template itself (what it puts after an assistant message, less
    the end-of-turn token the model already sampled)."""

    PROBE_USER, PROBE_ASSISTANT = "\x00user\x00", "\x00assistant\x00"

    def __init__(self, tokenizer, chat_template: bool) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.eos_text = (
            tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        )
        self._after_assistant = self._suffix = ""
        if self.chat_template:
            one = [
                {"role": "user", "content": self.PROBE_USER},
                {"role": "assistant", "content": self.PROBE_ASSISTANT},
            ]
            base = tokenizer.apply_chat_template(one, tokenize=False)
            more = tokenizer.apply_chat_template(
                [*one, {"role": "user", "content": self.PROBE_USER}],
                tokenize=False,
                add_generation_prompt=True,
            )
            if not more.startswith(base) or self.PROBE_ASSISTANT not in base:
                raise ValueError(
                    "the tokenizer's chat template does not extend a conversation by appending to it"
                )
            self._after_assistant = base[base.index(self.PROBE_ASSISTANT) + len(self.PROBE_ASSISTANT) :]
            self._suffix = more[len(base) :]

    def observation_text(self, observation: str, model_turn_ids: list[int]) -> str:
        if not self.chat_template:
            return f"\n{observation}\n"
        gap = self._after_assistant
        ended_with_eos = bool(model_turn_ids) and model_turn_ids[-1] == self.tokenizer.eos_token_id
        if ended_with_eos and self.eos_text and gap.startswith(self.eos_text):
            gap = gap[len(self.eos_text) :]
        return gap + self._suffix.replace(self.PROBE_USER, observation)

    def observation_ids(self, observation: str, model_turn_ids: list[int]) -> list[int]:
        text = self.observation_text(observation, model_turn_ids)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]


def round_trip(tokenizer, token_ids: list[int]) -> list[int]:
    """`token_ids` decoded to text and encoded again (special tokens kept as text): what a loop that
    keeps the conversation as text conditions on."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def retokenization_drift(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> int:
    """Positions where decode-then-encode of the episode would differ from its exact tokens (plus
    the length difference): what a text-level multi-turn loop would have trained on instead."""
    again = round_trip(tokenizer, token_ids)
    return sum(a != b for a, b in zip(again, token_ids, strict=False)) + abs(len(again) - len(token_ids))


async def run_episode(
    env: AsyncEpisodeEnv,
    record: Mapping[str, Any],
    prompt_ids: Callable[[str], list[int]],
    generate: Generate,
    template: TurnTemplate,
    max_turns: int,
    max_episode_tokens: int,
    max_tokens: int,
    fault: FaultSpec | None = None,
    max_model_len: int | None = None,
) -> Episode:
    """Play one episode (module docstring). `prompt_ids(first_observation)` renders the first user
    turn as training renders prompts; `generate` runs one engine request; `fault` is a parity fault
    to inject (tests only; the multi-turn classes act here); `max_model_len`: the engine's context,
    which each turn's prompt plus its tokens stays within (the episode ends `context_length`
    instead of the engine refusing the request). Closes `env`."""

    def on(name: str, versions: list[int]) -> bool:
        return (
            fault is not None and fault.fault.name == name and bool(versions) and fault.active(versions[-1])
        )

    episode = Episode()
    try:
        episode.first_observation = await env.reset(record)
        ids = prompt_ids(episode.first_observation)
        episode.prompt_token_ids = list(ids)
        for turn_index in range(max_turns):
            budget = max_episode_tokens - len(episode.token_ids)
            if max_model_len is not None:  # the engine refuses a prompt and its tokens beyond it
                budget = min(budget, max_model_len - len(ids))
            if budget < 1:
                episode.end = "context_length"
                break
            result = await generate(list(ids), min(max_tokens, budget), turn_index)
            start = len(episode.token_ids)
            weight_versions = list(result.token_weight_versions)
            context_versions = list(result.token_context_versions or result.token_weight_versions)
            if turn_index > 0 and episode.weight_versions and on("episode_version_tag", weight_versions):
                first = episode.weight_versions[0]
                if any(v != first for v in weight_versions):  # an update landed since the first turn
                    episode.faulty_turns += 1
                    log.warning(
                        FAULTY_TURN_LOG, "episode_version_tag", turn_index, weight_versions[-1], first
                    )
                weight_versions = context_versions = [first] * len(weight_versions)
            episode.engine_turns.append(list(result.token_ids))
            episode.token_ids += result.token_ids
            episode.loss_mask += [True] * len(result.token_ids)
            episode.logprobs += result.logprobs
            episode.weight_versions += weight_versions
            episode.context_versions += context_versions
            episode.turns.append(
                TurnRecord("model", start, len(episode.token_ids), None, result.finish_reason)
            )
            episode.actions.append(result.text)
            step = await env.step(result.text)
            episode.reward += step.reward
            if step.done:
                episode.end = "done"
                _environment_turn(episode, [], step.reward)
                break
            if result.finish_reason == "length":  # the turn did not end: its action was cut short
                episode.end = "context_length"
                _environment_turn(episode, [], step.reward)
                break
            if turn_index == max_turns - 1:  # no turn follows: its observation would be dead tokens
                episode.end = "max_turns"
                _environment_turn(episode, [], step.reward)
                break
            obs_ids = template.observation_ids(step.observation, result.token_ids)
            next_prompt = len(ids) + len(result.token_ids) + len(obs_ids)
            if len(episode.token_ids) + len(obs_ids) >= max_episode_tokens or (
                max_model_len is not None and next_prompt >= max_model_len
            ):
                episode.end = "context_length"
                _environment_turn(episode, [], step.reward)
                break
            episode.observations.append(step.observation)
            _environment_turn(episode, obs_ids, step.reward)
            ids = [*ids, *result.token_ids, *obs_ids]
            if on("episode_retokenized", list(result.token_weight_versions)):
                ids = [*episode.prompt_token_ids, *round_trip(template.tokenizer, episode.token_ids)]
        else:
            episode.end = "max_turns"
    except EnvironmentFailed as failure:
        episode.end, episode.error, episode.error_reason = "environment_error", str(failure), failure.reason
    finally:
        await env.close()
    episode.check_exact()
    return episode


def _environment_turn(episode: Episode, obs_ids: list[int], reward: float) -> None:
    """The environment's answer to the last model turn: its tokens (none when the episode ends
    there) and the turn's reward. A reward with no tokens is kept on the model turn's record."""
    if not obs_ids:
        episode.turns[-1].reward = reward
        return
    start = len(episode.token_ids)
    episode.token_ids += obs_ids
    episode.loss_mask += [False] * len(obs_ids)
    episode.turns.append(TurnRecord("environment", start, len(episode.token_ids), reward))
