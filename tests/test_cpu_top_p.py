"""rollout.cpu_top_p against vLLM's own sorting top-k/top-p, on the same logits."""

from __future__ import annotations

import pytest
import torch

from rollout.cpu_top_p import BOUNDS, bounded_top_k_top_p

VOCAB = 49_152  # SmolLM2's vocabulary: the size the sort is slow for


def vllm_reference(logits, k, p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)


def model_like_logits(rows: int, seed: int) -> torch.Tensor:
    """Heavy-tailed rows from peaked (a few tokens hold the mass) to flat (thousands needed)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, VOCAB, generator=gen)
    spread = torch.logspace(-0.5, 1.3, rows).unsqueeze(1)  # ~0.3 .. 20: flat .. very peaked
    tail = -torch.log(-torch.log(torch.rand(rows, VOCAB, generator=gen).clamp(1e-12, 1 - 1e-7)))  # Gumbel
    return (base + tail) * spread / 4


def same(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor) -> bool:
    """The same tokens kept with untouched logits, except tokens whose whole probability is below
    1e-6 of the row: at p near 1 the boundary token's probability is ~1e-6, and which side of p it
    falls on depends on float32 rounding in vLLM's own sum (its effect on any logprob is < 1e-6)."""
    dropped_got, dropped_want = torch.isinf(got), torch.isinf(want)
    both = ~dropped_got & ~dropped_want
    if not torch.equal(got[both], logits[both]) or not torch.equal(want[both], logits[both]):
        return False
    differ = dropped_got != dropped_want
    mass = (torch.softmax(logits.double(), dim=-1) * differ).sum(dim=-1)
    return bool((mass < 1e-6).all())


def identical_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((torch.isinf(got) == torch.isinf(want)).all(dim=-1).sum())


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95, 0.999])
def test_top_p_keeps_exactly_the_tokens_vllm_keeps(top_p: float) -> None:
    logits = model_like_logits(32, seed=int(top_p * 1000))
    p = torch.full((32,), top_p)
    want = vllm_reference(logits, None, p)
    got = bounded_top_k_top_p(logits, None, p, vllm_reference)
    assert same(got, want, logits)
    assert identical_rows(got, want) >= 30  # a rounding-level flip is the exception, not the rule
    kept = (~torch.isinf(want)).sum(dim=-1)
    assert kept.min() < BOUNDS[0] and kept.max() > 1  # the rows cover peaked and wider sets


def test_mixed_rows_top_k_top_p_and_fallbacks() -> None:
    """Per-row k and p as vLLM batches them: k = vocab means no top-k, p = 1 means no top-p, and
    rows too flat for the largest bound go to the sort."""
    logits = model_like_logits(12, seed=7)
    logits[0] = torch.randn(VOCAB) * 0.01  # nearly uniform: top-p needs ~all tokens -> fallback
    k = torch.tensor([VOCAB, 5, 40, VOCAB, 300, 5000, VOCAB, 1, VOCAB, 20, VOCAB, 1000])
    p = torch.tensor([0.9, 0.9, 1.0, 0.5, 0.95, 0.8, 1.0, 0.9, 0.99, 0.7, 0.95, 0.6])
    want = vllm_reference(logits, k, p)
    got = bounded_top_k_top_p(logits, k, p, vllm_reference)
    assert same(got, want, logits)
    assert (~torch.isinf(want[0])).sum() > BOUNDS[-1]  # the fallback row really needed the sort


def test_peaked_rows_never_reach_the_sort() -> None:
    """Not a timing test: rows whose kept set fits in the bounds never call the sorting fallback."""
    calls = []

    def counting(logits, k, p):
        calls.append(logits.shape[0])
        return vllm_reference(logits, k, p)

    logits = model_like_logits(32, seed=3)[21:]  # the peaked rows: top-p keeps < 400 tokens
    p = torch.full((11,), 0.9)
    assert same(bounded_top_k_top_p(logits, None, p, counting), vllm_reference(logits, None, p), logits)
    assert calls == []


def test_without_top_p_it_defers_to_vllm() -> None:
    calls = []

    def counting(logits, k, p):
        calls.append(p)
        return logits

    logits = torch.randn(2, 100)
    bounded_top_k_top_p(logits, torch.tensor([3, 3]), None, counting)
    assert calls == [None]
