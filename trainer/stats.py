"""What a step's micro-batches measured, returned by value and joined once per step.

Legend: T tokens of the micro-batch (or step) in micro-batch order, S sequences.

Invariants:
- The per-token tensors of one `StepStats` are aligned: index i of `trainer_logprobs`,
  `rollout_logprobs`, `entropy`, `lags` and `clean` is the same token (trainable micro-batches
  first, then the frozen ones, each in sequence order). The loss-only fields (`clip`,
  `kl_new_old`, `is_weights`, `is_corrected`, `kl_ref`) cover the trainable tokens only; `clip` is
  per sequence for GSPO.
- `at_version_*` is None when the step did not measure it (old_logprobs != recompute); an empty
  tensor means it was measured over no token.
- The multi-rank wire format (trainer/scatter.py) is derived from these fields, not listed twice.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class StepStats:
    """Per-token statistics (host or device tensors) and the step's scalar sums."""

    trainer_logprobs: torch.Tensor  # [T] float32, the trainer's logprob of each sampled token
    rollout_logprobs: torch.Tensor  # [T] float32, the engine's (processed) logprob of the same token
    entropy: torch.Tensor  # [T]
    lags: torch.Tensor  # [T] int64, trainer version - token version
    clean: torch.Tensor  # [T] bool, the token's context is its own version
    clip: torch.Tensor  # [T trainable] (GSPO: [S trainable]), whether the ratio was clipped
    kl_new_old: torch.Tensor  # [T trainable]
    is_weights: torch.Tensor  # [T trainable]
    is_corrected: torch.Tensor  # [T trainable]
    kl_ref: torch.Tensor  # [T trainable], empty without a reference model
    at_version_trainer_logprobs: torch.Tensor | None = None  # trainer at each token's own version
    at_version_rollout_logprobs: torch.Tensor | None = None
    # Summed over trainable micro-batches; NaN when nothing was trained. A micro-batch's part holds
    # its detached 0-d loss tensor (None when frozen), so that nothing syncs before `join`.
    loss: float | torch.Tensor | None = math.nan
    nonfinite_tokens: int | torch.Tensor = 0  # trainable tokens the trainer's mask excluded (zero loss)
    train_forward_tokens: int = 0  # tokens through forward+backward (prompt and completion)
    eval_forward_tokens: int = 0  # tokens through forward-only passes

    @property
    def num_tokens(self) -> int:
        return int(self.trainer_logprobs.numel())

    @classmethod
    def empty(cls) -> StepStats:
        import torch

        none = torch.zeros(0)
        return cls(none, none, none, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool),
                   none, none, none, none, none)  # fmt: skip

    @classmethod
    def join(cls, parts: list[StepStats]) -> StepStats:
        """One host StepStats of micro-batch parts (in order): tensors concatenated (one copy to the
        host per field), scalars summed; loss summed over the parts that trained (NaN if none)."""
        import torch

        if not parts:
            return cls.empty()
        joined = {}
        for name in tensor_fields():
            chunks = [getattr(p, name) for p in parts if getattr(p, name) is not None]
            filled = [c for c in chunks if c.numel()]  # an empty part must not change the dtype
            if filled:
                joined[name] = torch.cat(filled).cpu()
            elif chunks:
                joined[name] = chunks[0].cpu()
            else:
                joined[name] = None if name in OPTIONAL_FIELDS else getattr(cls.empty(), name)
        losses = [torch.as_tensor(p.loss) for p in parts if p.loss is not None and not _is_nan(p.loss)]
        return cls(
            **joined,
            loss=float(torch.stack(losses).sum()) if losses else math.nan,
            nonfinite_tokens=sum(int(p.nonfinite_tokens) for p in parts),
            train_forward_tokens=sum(p.train_forward_tokens for p in parts),
            eval_forward_tokens=sum(p.eval_forward_tokens for p in parts),
        )


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


OPTIONAL_FIELDS = ("at_version_trainer_logprobs", "at_version_rollout_logprobs")
SCALAR_FIELDS = ("loss", "nonfinite_tokens", "train_forward_tokens", "eval_forward_tokens")


def tensor_fields() -> tuple[str, ...]:
    """The per-token fields of StepStats, in declaration (and wire) order."""
    return tuple(f.name for f in dataclasses.fields(StepStats) if f.name not in SCALAR_FIELDS)
