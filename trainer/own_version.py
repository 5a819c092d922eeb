"""Scoring tokens under the weights that sampled them (each token's own version).

Two uses, one mechanism (load a version from the WeightHistory into the frozen `old_model`, score):
- `rescore_at_versions`: the PPO old policy with `old_logprobs=recompute`, every token of a
  micro-batch whose version is still held;
- `score_own_version`: the backend-mismatch check on stale tokens. Lag-0 tokens need no rescoring
  (the step's forward already runs at their version); mixed-context tokens are excluded (their KV
  came from older weights, which the trainer does not replay). The first `own_version_groups`
  groups that hold clean stale tokens are rescored, every step.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.device import to_device
from trainer.policy import token_logprobs
from trainer.prepare import ScoredSequence, model_positions
from trainer.weight_history import WeightHistory

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OwnVersionSample:
    """Trainer and rollout logprobs of the rescored clean stale tokens (host, float32), and the
    entropy of the trainer's processed distribution at each (the informative-token test)."""

    trainer_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    seconds: float
    entropy: torch.Tensor | None = None


def rescore_at_versions(
    old_model,
    history: WeightHistory,
    chunk: list[ScoredSequence],
    behaviour_T: torch.Tensor,
    device,
    entropy_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Trainer logprobs at each token's own version, mask of tokens whose version is held): one
    no-grad forward per held version, over the sequences that hold it.
    Tokens whose version is not held keep their behaviour logprobs and are outside the mask.
    With `entropy_out` ([T]), the processed distribution's entropy at each rescored token is written
    into it (from the same logits: no extra forward)."""
    import torch

    versions = [v for s in chunk for v in s.versions]
    versions_T = to_device(torch.tensor(versions), device)
    old_T = behaviour_T.clone()
    known_T = torch.zeros_like(versions_T, dtype=torch.bool)
    params = dict(old_model.lm.named_parameters())
    # Where each sequence's tokens sit in the chunk's token order: a version's forward runs over the
    # sequences that hold it, not the whole chunk.
    offsets = list(itertools.accumulate((len(s.versions) for s in chunk), initial=0))
    with torch.no_grad():
        for version in sorted(set(versions)):
            weights = history.get(version)
            if weights is None:
                continue
            for name, tensor in weights.items():
                # From pinned host memory on CUDA (weight_history.host_copies): queued on the
                # stream the forward below runs on, so it reads the loaded weights.
                params[name].copy_(tensor, non_blocking=True)
            members = [i for i, s in enumerate(chunk) if version in s.versions]
            sub = [chunk[i] for i in members]
            at_T = to_device(
                torch.tensor([t for i in members for t in range(offsets[i], offsets[i + 1])]), device
            )
            lp_T, entropy_T = token_logprobs(
                old_model,
                [s.inputs for s in sub],
                with_entropy=entropy_out is not None,
                keep=model_positions(sub),
            )
            use_T = versions_T[at_T] == version
            rows_T = at_T[use_T]
            old_T[rows_T] = lp_T[use_T]
            if entropy_out is not None:
                entropy_out[rows_T] = entropy_T[use_T].to(entropy_out.dtype)
            known_T[rows_T] = True
    return old_T, known_T


def score_own_version(
    old_model,
    history: WeightHistory,
    sequences: list[ScoredSequence],
    current_version: int,
    groups: int,
    device,
) -> OwnVersionSample | None:
    """Rescore the clean stale tokens of the first `groups` groups that hold any; None when
    own-version scoring is off (`groups` 0 or no frozen copy on this rank)."""
    import torch

    if groups == 0 or old_model is None:
        return None
    start = time.perf_counter()
    held = set(history.versions())
    by_group: dict[int, list[ScoredSequence]] = {}
    for seq in sequences:
        if any(
            v != current_version and c == v and v in held
            for v, c in zip(seq.versions, seq.contexts, strict=True)
        ):
            by_group.setdefault(seq.group_index, []).append(seq)
    chosen = [s for g in sorted(by_group)[:groups] for s in by_group[g]]
    if not chosen:
        return OwnVersionSample(torch.zeros(0), torch.zeros(0), time.perf_counter() - start, torch.zeros(0))
    rollout_T = to_device(
        torch.tensor([lp for s in chosen for lp in s.rollout_logprobs], dtype=torch.float32), device
    )
    entropy_T = torch.full_like(rollout_T, float("nan"))
    with torch.no_grad():
        scored_T, known_T = rescore_at_versions(old_model, history, chosen, rollout_T, device, entropy_T)
    stale_clean_T = to_device(
        torch.tensor(
            [
                v != current_version and c == v
                for s in chosen
                for v, c in zip(s.versions, s.contexts, strict=True)
            ]
        ),
        device,
    )
    use_T = known_T & stale_clean_T
    return OwnVersionSample(
        scored_T[use_T].float().cpu(),
        rollout_T[use_T].float().cpu(),
        time.perf_counter() - start,
        entropy_T[use_T].float().cpu(),
    )
