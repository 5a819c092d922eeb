"""The reference engine on a chosen device (`rollout.device`).

- CPU (every run): the device setting is refused for vLLM, naming the field; `cuda` on a host
  without CUDA fails at start with the field named; the engine-level comparison below runs CPU
  against CPU (the same seed gives the same tokens and logprobs).
- GPU (`gpu` marker, run on a GPU host by scripts/gpu_check.sh): the same seed gives the same
  tokens on CUDA as on CPU, with fp32 logprobs within 2e-4 (float32 head, TF32 off).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from parity.config.rollout import RolloutConfig
from rollout.engine import GenerationSpec
from rollout.reference_engine import ReferenceEngine


def _generate(model_dir: Path, device: str) -> list:
    async def run() -> list:
        engine = ReferenceEngine(RolloutConfig(engine="reference", device=device), model_dir, seed=0)
        await engine.start()
        try:
            spec = GenerationSpec(
                "r0", list(range(10, 26)), n=3, max_tokens=16, temperature=0.9, top_p=0.95, seed=5
            )
            return sorted([result async for result in engine.generate(spec)], key=lambda r: r.index)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def _compare(model_dir: Path, device: str) -> float:
    """The largest |logprob difference| between `device` and CPU; tokens must be equal."""
    cpu, other = _generate(model_dir, "cpu"), _generate(model_dir, device)
    assert len(cpu) == len(other) == 3
    worst = 0.0
    for a, b in zip(cpu, other, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    return worst


def test_the_device_is_the_reference_engines_only() -> None:
    with pytest.raises(ValueError, match="device"):
        RolloutConfig(engine="vllm", device="cuda")
    assert RolloutConfig(engine="reference", device="cuda").device == "cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
def test_cuda_without_a_gpu_fails_at_start_naming_the_field(tiny_model: Path) -> None:
    with pytest.raises(RuntimeError, match=r"rollout\.device"):
        _generate(tiny_model, "cuda")


def test_the_same_seed_gives_the_same_completions_on_cpu(tiny_model: Path) -> None:
    assert _compare(tiny_model, "cpu") == 0.0


@pytest.mark.gpu
def test_cuda_gives_the_cpu_tokens_and_logprobs_within_2e_4(tiny_model: Path) -> None:
    worst = _compare(tiny_model, "cuda")
    print(f"reference engine cuda vs cpu: max |Δ logprob| {worst:.2e}")
    assert worst <= 2e-4
