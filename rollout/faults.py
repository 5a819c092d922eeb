"""Train-inference parity faults injected into a reference engine, for tests and the fault check only.

`ReferenceEngine` is an engine with the trainer's numerics (sampling replayed by parity.sampling on
a Hugging Face model, weights loaded by update) into which one fault of the catalogue
(parity/faults.py) is injected at the site it lives in a real engine: the logprobs it reports, the
sampling transform it applies, the weights an update leaves it with, the version tags it writes,
its caches, or the head's precision.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from parity.faults import (
    ENV_VAR,
    FAULTS,
    MULTI_TURN_FAULTS,
    Fault,
    FaultSpec,
    conditioned_prompt,
    double_rope_theta,
    engine_transform,
    fault_from_env,
    parse_fault,
    penalised,
    reported,
)
from parity.sampling import SamplingTransform, processed_logprobs
from parity.v1 import common_pb2, rollouts_pb2
from rollout.episodes import round_trip

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENV_VAR",
    "FAULTS",
    "MULTI_TURN_FAULTS",
    "Fault",
    "FaultSpec",
    "ReferenceEngine",
    "fault_from_env",
    "parse_fault",
]


class ReferenceEngine:
    """An engine with the trainer's numerics on a private copy of a Hugging Face causal LM.

    `worker_id` names the worker it plays (one_worker_not_updated acts on "worker-1" only)."""

    def __init__(
        self, model, fault: FaultSpec | None = None, worker_id: str = "worker-0", tokenizer=None
    ) -> None:
        if fault is not None and fault.fault.name == "episode_retokenized" and tokenizer is None:
            raise ValueError("episode_retokenized needs the model's tokenizer (its round trip is the fault)")
        self.model = copy.deepcopy(model).eval()
        self.fault = fault
        self.worker_id = worker_id
        self.tokenizer = tokenizer
        self.faulty_turns = 0  # later model turns a multi-turn fault changed (context or tags)
        self.version = 0
        self._previous: dict[str, torch.Tensor] | None = None  # what the last update asked for
        self._before: dict[str, torch.Tensor] | None = None  # what the engine held before it
        self._before_version = 0
        self._first_head = self.model.get_output_embeddings().weight.detach().clone()
        self._stale_model = None

    def _on(self, name: str, version: int | None = None) -> bool:
        v = self.version if version is None else version
        return self.fault is not None and self.fault.fault.name == name and self.fault.active(v)

    def _active(self) -> str:
        """The fault's name when it is active at the engine's version, else ""."""
        return self.fault.fault.name if self.fault is not None and self.fault.active(self.version) else ""

    def update(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load `state_dict` as `version` (the weight-update path; weight faults act here)."""
        import torch

        current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        new = {k: v.detach().clone() for k, v in state_dict.items()}
        stale = self._on("stale_weights", version) or (
            self._on("one_worker_not_updated", version) and self.worker_id == "worker-1"
        )
        if stale and self._previous is not None:
            new = self._previous  # the engine serves what it had one update ago
        if self._on("tensor_not_updated", version):
            name = next(k for k in new if "down_proj" in k)
            new[name] = current[name]
        if self._on("swapped_tensors", version):
            q = next(k for k in new if "layers.0." in k and "q_proj.weight" in k)
            o = next(k for k in new if "layers.0." in k and "o_proj.weight" in k)
            if new[q].shape != new[o].shape:
                raise ValueError(f"swapped_tensors: {q} and {o} differ in shape")
            new[q], new[o] = new[o], new[q]
        if self._on("bf16_weights", version):
            new = {k: v.bfloat16().to(v.dtype) if v.is_floating_point() else v for k, v in new.items()}
        with torch.no_grad():
            self.model.load_state_dict(new, strict=False)
            if self._on("untied_head", version):
                self.model.get_output_embeddings().weight = torch.nn.Parameter(self._first_head.clone())
        self._previous = {k: v.detach().clone() for k, v in state_dict.items()}
        self._before, self._before_version = current, self.version
        self._stale_model = None
        self.version = version

    def _stale(self):
        """A copy of the model with the weights the engine held before its last update (v-1)."""
        if self._stale_model is None:
            self._stale_model = copy.deepcopy(self.model).eval()
            if self._before is not None:
                self._stale_model.load_state_dict(self._before, strict=False)
        return self._stale_model

    def _logits(self, rows: list[list[int]], prompt_len: int) -> torch.Tensor:
        """[rows, len, V] float32 next-token logits at every position of equal-length rows (those
        before prompt_len - 1 may be left zero: nothing reads them)."""
        import torch

        if self._on("rope_theta") and not getattr(self, "_rope_changed", False):
            double_rope_theta(self.model)
            self._rope_changed = True
        ids = torch.tensor(rows)
        with torch.no_grad():
            if self._on("bf16_lm_head"):
                hidden = self.model.model(input_ids=ids).last_hidden_state
                head = self.model.get_output_embeddings().weight
                return (hidden.bfloat16() @ head.bfloat16().T).float()
            if self._on("stale_prefix_kv") and self._before is not None and prompt_len > 1:
                cache = self._stale()(input_ids=ids[:, : prompt_len - 1], use_cache=True).past_key_values
                tail = self.model(input_ids=ids[:, prompt_len - 1 :], past_key_values=cache).logits.float()
                head = torch.zeros(len(rows), prompt_len - 1, tail.shape[-1])
                return torch.cat([head, tail], dim=1)
            logits = self.model(input_ids=ids).logits.float()
            if self._on("async_first_token") and self._before is not None:
                logits[:, prompt_len - 1] = self._stale()(input_ids=ids).logits.float()[:, prompt_len - 1]
            return logits

    def _penalise(self, logits_1V: torch.Tensor, row: Sequence[int], prompt_len: int) -> torch.Tensor:
        """The engine's penalties on the logits that follow `row` (none unless a penalty fault is on)."""
        return penalised(self._active(), logits_1V, row[:prompt_len], row[prompt_len:])

    def sample(
        self, prompt: Sequence[int], length: int, n: int, requested: SamplingTransform, generator
    ) -> list[tuple[list[int], list[float], list[int]]]:
        """(tokens, reported logprobs, weight-version tags) of `n` completions, sampled together."""
        import torch

        transform = engine_transform(self._active(), requested)
        # prompt_token_drift / truncated_context: the prompt the engine conditions on
        prompt = conditioned_prompt(self._active(), prompt)
        p = len(prompt)
        rows = [list(prompt) for _ in range(n)]
        for _ in range(length):
            logits_nV = self._logits(rows, p)[:, -1]
            logits_nV = torch.cat([self._penalise(logits_nV[i : i + 1], rows[i], p) for i in range(n)])
            probs_nV = processed_logprobs(logits_nV, transform).exp()
            for row, token in zip(rows, torch.multinomial(probs_nV, 1, generator=generator)[:, 0].tolist(),
                                  strict=True):  # fmt: skip
                row.append(int(token))
        all_logits = self._logits(rows, p)[:, p - 1 : -1]
        out = []
        for i, row in enumerate(rows):
            tokens = row[p:]
            logits = torch.cat(
                [self._penalise(all_logits[i, j : j + 1], row[: p + j], p) for j in range(length)]
            )
            targets = torch.tensor(tokens).unsqueeze(-1)
            if self._on("raw_logprobs"):
                logprobs = logits.log_softmax(-1).gather(-1, targets).squeeze(-1).tolist()
            else:
                logprobs = processed_logprobs(logits, transform).gather(-1, targets).squeeze(-1).tolist()
            logprobs, versions = reported(self._active(), logprobs, [self.version] * length)
            out.append((tokens, logprobs, versions))
        return out

    def episodes(
        self,
        prompt: Sequence[int],
        length: int,
        n: int,
        requested: SamplingTransform,
        observation: Sequence[int],
        generator,
    ) -> list[tuple[list[int], list[bool], list[float], list[int]]]:
        """`n` two-turn episodes: a model turn, the environment's `observation`, a second model turn
        (each turn its own request, as rollout/episodes.py plays them). Per episode: (tokens, loss
        mask, logprobs and version tags of the model's tokens).

        After an update to a newer version, the first turn is sampled at the weights the engine held
        before it and the second at the current ones, as when an update lands between turns; each
        turn is tagged with the version that sampled it (with episode_version_tag, both with the
        first turn's). The second turn's context is the exact tokens so far (with
        episode_retokenized, their decode-then-encode round trip)."""
        version = self.version
        straddles = self._before is not None and self._before_version < version
        if straddles:  # the first turn at the version before the last update
            current, self.model, self.version = self.model, self._stale(), self._before_version
        try:
            first = self.sample(prompt, length, n, requested, generator)
        finally:
            if straddles:
                self.model, self.version = current, version
        out = []
        for tokens, logprobs, versions in first:
            history = [*tokens, *observation]
            context = history
            if self._on("episode_retokenized"):
                context = round_trip(self.tokenizer, history)
                self.faulty_turns += context != history
            ((second, logprobs2, versions2),) = self.sample(
                [*prompt, *context], length, 1, requested, generator
            )
            if self._on("episode_version_tag") and versions2 != versions[:1] * len(versions2):
                versions2 = versions[:1] * len(versions2)
                self.faulty_turns += 1
            mask = [True] * len(tokens) + [False] * len(observation) + [True] * len(second)
            out.append(([*history, *second], mask, logprobs + logprobs2, versions + versions2))
        return out

    def group(
        self,
        group_id: str,
        prompt: Sequence[int],
        rewards: Sequence[float],
        requested: SamplingTransform,
        length: int,
        generator,
        observation: Sequence[int] = (),
    ) -> rollouts_pb2.RolloutGroup:
        """One RolloutGroup as the rollout service would publish it (requested transform recorded);
        with an `observation`, of two-turn episodes (`episodes`)."""
        out = rollouts_pb2.RolloutGroup(
            group_id=group_id,
            prompt_token_ids=list(prompt),
            sampling=common_pb2.SamplingParams(
                temperature=requested.temperature,
                top_k=requested.top_k,
                top_p=requested.top_p,
                max_tokens=length,
                n=len(rewards),
            ),
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED,
            worker_id=self.worker_id,
        )
        all_versions: list[int] = []
        if observation:
            episodes = self.episodes(prompt, length, len(rewards), requested, observation, generator)
        else:
            episodes = [
                (tokens, [], logprobs, versions)
                for tokens, logprobs, versions in self.sample(
                    prompt, length, len(rewards), requested, generator
                )
            ]
        for index, (reward, (tokens, mask, logprobs, versions)) in enumerate(
            zip(rewards, episodes, strict=True)
        ):
            all_versions += versions
            sample = out.samples.add(
                rollout_id=f"{group_id}/{index}",
                token_ids=tokens,
                logprobs=logprobs,
                token_weight_versions=versions,
                reward=float(reward),
                loss_mask=mask,
            )
            if mask:
                for role, start, end in _turns(mask):
                    sample.turns.add(role=role, start=start, end=end)
        out.min_weight_version, out.max_weight_version = min(all_versions), max(all_versions)
        return out


def _turns(mask: Sequence[bool]) -> list[tuple[int, int, int]]:
    """(role, start, end) of each run of model (True) or environment (False) tokens in `mask`."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            role = rollouts_pb2.TURN_ROLE_MODEL if mask[start] else rollouts_pb2.TURN_ROLE_ENVIRONMENT
            out.append((role, start, i))
            start = i
    return out
