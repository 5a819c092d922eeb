"""Top-k/top-p masking for vLLM's CPU sampler without sorting the vocabulary, same kept tokens.

vLLM's CPU path (`apply_top_k_top_p_pytorch`) sorts every row of the logits, 49,152 entries for
SmolLM2, on every decode step. On this 2-core CPU that is about a third of a decode step
(`bench/vllm_cpu_knobs.py`: 1.5-1.6x faster without top-p). The rule it applies:

    top-k: keep every logit >= the k-th largest;
    top-p: over the softmax of what top-k kept, sorted ascending, drop a token when the cumulative
           probability up to and including it is <= 1 - p; the largest token is always kept.

Equivalently, top-p keeps a token when the probability ranked strictly above it is < p. So the
kept set is the first m tokens by logit, for some m. Whenever m is below K, a bounded `topk(K)`
finds them, and the mask becomes `logit < threshold`. Kept logits are returned untouched.
Rows this cannot settle exactly go to vLLM's own function: rows whose kept set does not fit in
the largest K tried (flat distributions), rows with p >= 1 (vLLM also drops zero-probability
tokens there), and rows whose top-k bound exceeds K. One difference remains: tokens that tie
*exactly* with the boundary logit are all kept here, whereas the sort keeps an arbitrary subset
of them.

`install()` patches the function in vLLM's sampler module when the platform is CPU. The rollout
worker extension calls it in vLLM's worker process when `RolloutConfig.cpu_top_p` is "bounded" (the
default), and the engine reports what is in effect (`GetStatus` settings, startup log). On GPU vLLM
has its own kernels and nothing is patched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BOUNDS = (256, 4096)  # try the top 256, then the top 4096, then fall back to the full sort
ENV = "PARITY_VLLM_CPU_TOP_P"  # "bounded" or "sort"; set by VllmEngine for its worker process

Fallback = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def _settle(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor, bound: int):
    """Masks the rows a top-`bound` search settles exactly; returns (masked, settled rows)."""
    rows, vocab = logits.shape
    bound = min(bound, vocab)
    values, _ = logits.topk(bound, dim=-1)  # descending
    settled = p < 1.0
    floor = torch.full((rows, 1), float("-inf"), dtype=logits.dtype)
    if k is not None:
        k = k.to(torch.long)
        has_k = k < vocab
        settled &= ~has_k | (k <= bound)
        kth = values.gather(1, (k.clamp(1, bound) - 1).unsqueeze(1))
        floor = torch.where(has_k.unsqueeze(1), kth, floor)
    masked = logits.masked_fill(logits < floor, float("-inf"))  # top-k
    lse = masked.logsumexp(dim=-1, keepdim=True)
    in_top_k = values >= floor
    # float64: a float32 running sum over thousands of tokens drifts by ~1e-5, enough to move the
    # boundary; vLLM's ascending sum adds the small tail first and stays closer to exact
    probs = torch.where(in_top_k, (values - lse).double().exp(), torch.zeros((), dtype=torch.float64))
    above = probs.cumsum(dim=-1) - probs  # probability ranked strictly above each token
    keep = (above < p.double().unsqueeze(1)) & in_top_k
    kept = keep.sum(dim=-1)
    settled &= kept < bound  # exact only if a dropped token was seen inside the top `bound`
    threshold = values.gather(1, (kept.clamp(min=1) - 1).unsqueeze(1))
    return masked.masked_fill(masked < threshold, float("-inf")), settled


def bounded_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, fallback: Fallback
) -> torch.Tensor:
    """vLLM's top-k/top-p mask (see module docstring); `fallback` is vLLM's sorting version."""
    if p is None or logits.dim() != 2 or logits.shape[0] == 0:
        return fallback(logits, k, p)  # top-k alone: vLLM already avoids the sort
    out = torch.empty_like(logits)
    todo = torch.arange(logits.shape[0])
    for bound in BOUNDS:
        sub_k = None if k is None else k[todo]
        masked, settled = _settle(logits[todo], sub_k, p[todo], bound)
        out[todo[settled]] = masked[settled]
        todo = todo[~settled]
        if todo.numel() == 0:
            return out
    out[todo] = fallback(logits[todo].clone(), None if k is None else k[todo], p[todo])
    return out


def install() -> str:
    """Patch vLLM's CPU top-k/top-p with the bounded version; returns the implementation in effect."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    if not current_platform.is_cpu():
        return "vllm"
    if in_effect() == "bounded":
        return "bounded"
    original = sampler.apply_top_k_top_p

    def patched(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
        return bounded_top_k_top_p(logits, k, p, original)

    patched.parity_bounded = True  # type: ignore[attr-defined]
    sampler.apply_top_k_top_p = patched
    return "bounded"


def in_effect() -> str:
    """Which top-k/top-p implementation vLLM's sampler in this process calls."""
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    return "bounded" if getattr(sampler.apply_top_k_top_p, "parity_bounded", False) else "vllm"
