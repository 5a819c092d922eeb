"""The replayed sampling transform equals vLLM's own top-k/top-p code and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from parity.sampling import SamplingTransform, processed_logprobs, token_logprobs


def test_hand_computed_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.10]]))
    # top-k=2 keeps {0.5, 0.25} -> renormalised to 2/3, 1/3
    lp = processed_logprobs(logits, SamplingTransform(temperature=1.0, top_k=2))
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([2 / 3, 1 / 3]), atol=1e-6)
    assert torch.isinf(lp[0, 2:]).all()
    # top-p=0.7: ascending cumsum 0.10, 0.25, 0.50, 1.0; drop where <= 0.3 -> drop 0.10 and 0.15
    lp = processed_logprobs(logits, SamplingTransform(temperature=1.0, top_p=0.7))
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([2 / 3, 1 / 3]), atol=1e-6)
    # temperature 2 flattens: p ∝ sqrt(p)
    lp = processed_logprobs(logits, SamplingTransform(temperature=2.0))
    expected = torch.tensor([0.5, 0.25, 0.15, 0.10]).sqrt()
    assert torch.allclose(lp[0].exp(), expected / expected.sum(), atol=1e-6)


def test_greedy_is_plain_log_softmax_and_entropy_is_of_same_distribution() -> None:
    logits = torch.randn(3, 11)
    lp = processed_logprobs(logits, SamplingTransform(temperature=0.0, top_k=2, top_p=0.5))
    assert torch.allclose(lp, logits.log_softmax(-1))
    tokens = torch.tensor([0, 1, 2])
    chosen, entropy = token_logprobs(logits, tokens, SamplingTransform(temperature=1.0, top_k=1))
    assert torch.allclose(entropy, torch.zeros(3), atol=1e-6)  # a single surviving token
    assert chosen.shape == (3,)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 0.9), (0.7, 20, 1.0), (1.3, 5, 0.8), (0.5, 50, 0.95)]
)
def test_matches_vllm_sampler_code(temperature: float, top_k: int, top_p: float) -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    logits = torch.randn(16, 300) * 3
    scaled = logits / temperature
    k = torch.full((16,), top_k if top_k else 300, dtype=torch.long) if top_k else None
    p = torch.full((16,), top_p) if top_p < 1 else None
    vllm_lp = apply_top_k_top_p_pytorch(scaled.clone(), k, p).log_softmax(-1, dtype=torch.float32)
    ours = processed_logprobs(logits, SamplingTransform(temperature, top_k, top_p))
    finite = torch.isfinite(vllm_lp)
    assert torch.equal(finite, torch.isfinite(ours))
    assert torch.allclose(ours[finite], vllm_lp[finite], atol=1e-5)
    assert math.isclose(float(finite.float().mean()), float(torch.isfinite(ours).float().mean()))
