"""The sampling transform, replayed exactly: temperature -> top-k -> top-p -> renormalise.

This is the "trainer's numerics": the trainer recomputes rollout logprobs with it, and the reference
engine samples with it, so both see the distribution vLLM's sampler actually drew from
(`logprobs_mode="processed_logprobs"`). It mirrors vLLM V1's order and tie rules:
  - temperature < 1e-5 is greedy; greedy logprobs are the plain log-softmax of the logits;
  - top-k keeps every logit >= the k-th largest (ties are kept);
  - top-p sorts ascending, masks tokens whose cumulative probability is <= 1 - p, always keeps the
    most likely token;
  - log-softmax in float32 over the masked logits (masked tokens get -inf).

Shapes: logits_TV is [tokens, vocab]. All functions are pure and differentiable where it matters
(the mask is computed without gradient; the log-softmax carries it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingTransform:
    """The parts of SamplingParams that change the distribution. 0 disables top_k; top_p 0 means 1."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_proto(cls, params) -> SamplingTransform:  # parity.v1.SamplingParams
        return cls(
            temperature=float(params.temperature),
            top_k=int(params.top_k),
            top_p=float(params.top_p) if params.top_p > 0 else 1.0,
        )


def masked_logits(logits_TV: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
    """Float32 logits after temperature and the top-k/top-p mask (masked entries are -inf)."""
    import torch

    logits_TV = logits_TV.float()
    if transform.greedy:
        return logits_TV
    logits_TV = logits_TV / transform.temperature
    vocab = logits_TV.shape[-1]
    use_k = 0 < transform.top_k < vocab
    use_p = transform.top_p < 1.0
    if not (use_k or use_p):
        return logits_TV
    with torch.no_grad():
        sorted_TV, order_TV = logits_TV.sort(dim=-1, descending=False)
        drop_TV = torch.zeros_like(sorted_TV, dtype=torch.bool)
        if use_k:
            kth_T1 = sorted_TV[:, vocab - transform.top_k].unsqueeze(-1)
            drop_TV |= sorted_TV < kth_T1
        if use_p:
            probs_TV = sorted_TV.masked_fill(drop_TV, float("-inf")).softmax(dim=-1)
            cumulative_TV = probs_TV.cumsum(dim=-1)
            top_p_drop_TV = cumulative_TV <= 1.0 - transform.top_p
            top_p_drop_TV[:, -1] = False
            drop_TV |= top_p_drop_TV
        mask_TV = torch.empty_like(drop_TV).scatter_(-1, order_TV, drop_TV)
    return logits_TV.masked_fill(mask_TV, float("-inf"))


def processed_logprobs(logits_TV: torch.Tensor, transform: SamplingTransform) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from, [T, V], float32."""
    return masked_logits(logits_TV, transform).log_softmax(dim=-1)


def token_logprobs(
    logits_TV: torch.Tensor, token_ids_T: torch.Tensor, transform: SamplingTransform
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each chosen token [T], entropy of each position's distribution [T])."""
    import torch

    logprobs_TV = processed_logprobs(logits_TV, transform)
    chosen_T = logprobs_TV.gather(-1, token_ids_T.long().unsqueeze(-1)).squeeze(-1)
    probs_TV = logprobs_TV.exp()
    entropy_T = -(probs_TV * torch.where(probs_TV > 0, logprobs_TV, torch.zeros_like(logprobs_TV))).sum(-1)
    return chosen_T, entropy_T


def repetition_penalised(logits_1V: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """vLLM's repetition penalty on one row of logits: each token in `seen` (prompt and completion so
    far) has a positive logit divided by `penalty`, a negative one multiplied. Returns a new row."""
    import torch

    out = logits_1V.clone()
    if seen:
        index = torch.tensor(sorted(set(seen)), device=out.device)
        values = out[0, index]
        out[0, index] = torch.where(values > 0, values / penalty, values * penalty)
    return out


def presence_penalised(logits_1V: torch.Tensor, seen: Sequence[int], penalty: float) -> torch.Tensor:
    """vLLM's presence penalty on one row of logits: each token in `seen` (the completion so far)
    loses `penalty`. Returns a new row."""
    import torch

    out = logits_1V.clone()
    if seen:
        out[0, torch.tensor(sorted(set(seen)), device=out.device)] -= penalty
    return out
