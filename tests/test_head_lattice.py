"""parity.head_lattice: logits rounded to bfloat16/float16 are told from float32 logits by the gaps
between a position's top logprobs; and both engines return those top logprobs (the reference engine
here, vLLM in tests/test_check.py and tests/test_rollout_service.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from parity.head_lattice import MIN_GAPS, head_lattice, logit_gaps


def top_logprobs(
    dtype: torch.dtype, temperature: float = 1.0, positions: int = 200, k: int = 8, seed: int = 0
):
    """Per position, the top-k processed logprobs of logits drawn in float32 and rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(positions, 512, generator=gen) * 4 + 8).to(dtype).float()
    logprobs = (logits / temperature).log_softmax(dim=-1)
    return logprobs.topk(k, dim=-1).values.tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_float32_logits_lie_on_no_grid(temperature: float) -> None:
    head = head_lattice(top_logprobs(torch.float32, temperature), temperature)
    assert head.measured and head.gaps == 200 * 7
    assert not head.low_precision and head.exponent is None and math.isnan(head.on_grid)
    assert head.as_dict()["on_grid"] is None and head.as_dict()["chance"] is None  # JSON has no NaN
    assert "float32-like" in head.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_bf16_and_fp16_logits_are_found_on_their_grid(dtype: torch.dtype, temperature: float) -> None:
    head = head_lattice(top_logprobs(dtype, temperature), temperature)
    assert head.low_precision and head.on_grid > 0.95 and head.chance < 0.01, head
    # logits of magnitude 8-16 keep 8 bits in bf16 (spacing 2^-4) and 11 in fp16 (spacing 2^-7)
    assert head.exponent <= (4 if dtype == torch.bfloat16 else 7), head
    assert "LOW" in head.describe() and f"2^-{head.exponent}" in head.describe()


def test_a_wrong_temperature_hides_the_grid() -> None:
    # the gaps are logit gaps only once scaled back by the temperature that was applied
    assert not head_lattice(top_logprobs(torch.bfloat16, 0.7), 1.0).low_precision


def test_too_few_gaps_decide_nothing_and_ties_and_excluded_tokens_are_not_gaps() -> None:
    few = top_logprobs(torch.bfloat16, positions=2)
    head = head_lattice(few, 1.0)
    assert head.gaps == 14 < MIN_GAPS and not head.measured and not head.low_precision
    assert "not measured" in head.describe()
    assert head_lattice([], 1.0).gaps == 0 and not head_lattice([], 1.0).measured
    assert json.loads(json.dumps(head_lattice([], 1.0).as_dict(), allow_nan=False))["gaps"] == 0
    # a tie lies on every grid, and -inf is a token the sampling transform excluded: neither is a gap
    assert logit_gaps([[-1.0, -1.0, -1.5, -math.inf], [-0.1]], 1.0).tolist() == [0.5]
    assert logit_gaps([[-1.5, -1.0]], 2.0).tolist() == [1.0]  # sorted, times the temperature


def test_the_reference_engine_returns_top_logprobs_that_match_the_sampled_ones(tiny_model: Path) -> None:
    import asyncio

    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.reference_engine import ReferenceEngine

    def generate(head_dtype: str) -> tuple[list, list]:
        """Completions without and with top logprobs, from one engine."""
        engine = ReferenceEngine(
            RolloutConfig(engine="reference", dtype="bfloat16", head_dtype=head_dtype), tiny_model, seed=0
        )

        async def collect() -> tuple[list, list]:
            await engine.start()
            out = []
            for top in (0, 8):
                spec = GenerationSpec("r", [1, 2, 3, 4], 2, 24, 0.7, top_p=0.9, seed=3, top_logprobs=top)
                out.append([c async for c in engine.generate(spec)])
            return out[0], out[1]

        return asyncio.run(collect())

    without, fp32 = generate("float32")
    assert all(c.top_logprobs == [] for c in without)
    for c in fp32:
        assert len(c.top_logprobs) == len(c.token_ids)
        for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert 1 <= len(top) <= 8
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True) and all(math.isfinite(v) for v in values)
            if tok in dict(top):
                assert dict(top)[tok] == pytest.approx(lp, abs=1e-6)
    tops = lambda comps: [[v for _, v in top] for c in comps for top in c.top_logprobs]  # noqa: E731
    assert not head_lattice(tops(fp32), 0.7).low_precision
    assert head_lattice(tops(generate("model")[1]), 0.7).low_precision
