"""The trainer on a CUDA GPU (`gpu` marker: skipped without CUDA; run them on a GPU host with
`pytest -m gpu tests/test_trainer_gpu.py -s`). NOT run on the CPU-only dev box.

- a full training step on CUDA (model, optimizer state, loss terms all on the device);
- CUDA-vs-CPU logprob parity within 2e-4 (fp32, TF32 off);
- bf16 mode's head GEMM on tensor cores has the float32 GEMM's error against the exact sum;
- FSDP2 with one rank (NCCL) gives the unsharded step;
- a DCP checkpoint round trip on the device;
- a bf16 step on a random 1.5B-shape (Qwen2.5-1.5B) model at batch 8 x 1,024 without OOM, printing
  peak memory and tokens/s.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import config_for

pytestmark = pytest.mark.gpu


def _trainer(run_dir: Path, **overrides):
    from trainer.loop import Trainer

    settings = {"model": "tiny", "device": "cuda", "run_dir": str(run_dir), "lr": 1e-3, **overrides}
    trainer = Trainer(config_for("trainer", **settings))
    trainer.setup_model()
    return trainer


def _sequences(trainer, seed: int = 0):
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.policy import load_model
    from trainer.prepare import prepare

    reference = load_model(trainer.model_dir)
    generator = torch.Generator().manual_seed(seed)
    groups = [make_group(reference, f"g{seed}", (1.0, 0.0, 0.0, 1.0), generator=generator)]
    return prepare(Batch(groups=groups), trainer.config).sequences


def test_a_training_step_on_cuda(tmp_path: Path, tiny_model: Path) -> None:
    trainer = _trainer(tmp_path)
    assert all(p.device.type == "cuda" for p in trainer.model.parameters())
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    _, result = trainer.update(_sequences(trainer))
    grad_norm, stepped = result.grad_norm, result.stepped
    assert stepped and grad_norm > 0
    moments = [st[k] for st in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.device.type == "cuda" and m.dtype == torch.float32 for m in moments)
    assert any((before[k] - v).abs().max() > 0 for k, v in trainer.model.named_parameters())


def test_cuda_logprobs_match_cpu_within_2e_4(tmp_path: Path, tiny_model: Path) -> None:
    from trainer.policy import load_model, token_logprobs

    sequences = [s.inputs for s in _sequences(_trainer(tmp_path))]
    with torch.no_grad():
        cpu_T, _ = token_logprobs(load_model(tiny_model, device="cpu"), sequences)
        cuda_T, _ = token_logprobs(load_model(tiny_model, device="cuda"), sequences)
    diff = float((cpu_T - cuda_T.cpu()).abs().max())
    print(f"max |Δlogprob| CUDA vs CPU {diff:.2e}")
    assert diff <= 2e-4


def test_the_bf16_head_on_tensor_cores_sums_its_exact_products_in_float32() -> None:
    """bf16 mode's head GEMM (parity/head_logits.py): bf16 operands, torch.mm out_dtype=float32 on
    CUDA, the call vLLM's fp32 head makes. Its error against the exact sum (float64) is of the float32
    GEMM's size, not of a bf16 result's (1.1e-6 vs 1.5e-2 at these shapes, on CPU)."""
    import torch.nn.functional as F

    from parity.head_logits import float32_logits, tensor_core_path
    from trainer.precision import disable_tf32

    disable_tf32()
    generator = torch.Generator().manual_seed(0)
    hidden_TH = torch.randn(512, 1536, generator=generator).bfloat16().cuda()
    weight_VH = (torch.randn(8192, 1536, generator=generator) * 0.02).bfloat16().cuda()
    assert tensor_core_path(hidden_TH, weight_VH), f"torch {torch.__version__} has no aten::mm.dtype on CUDA"
    exact_TV = hidden_TH.double() @ weight_VH.double().T
    ours_TV = float32_logits(hidden_TH, weight_VH)
    float32_TV = F.linear(hidden_TH.float(), weight_VH.float())
    assert ours_TV.dtype == torch.float32
    ours_err = float((ours_TV.double() - exact_TV).abs().max())
    float32_err = float((float32_TV.double() - exact_TV).abs().max())
    lp_diff = float((ours_TV.log_softmax(-1) - float32_TV.log_softmax(-1)).abs().max())
    print(
        f"head GEMM max error: tensor cores {ours_err:.2e}, float32 {float32_err:.2e}; logprobs {lp_diff:.2e}"
    )
    assert ours_err <= 16 * float32_err + 1e-7
    assert lp_diff <= 1e-5


def test_fsdp2_one_rank_gives_the_unsharded_step(tmp_path: Path, tiny_model: Path) -> None:
    import torch.distributed as dist

    from parity.ports import free_port
    from trainer import fsdp

    plain = _trainer(tmp_path / "plain")
    plain_totals, plain_result = plain.update(_sequences(plain))
    plain_norm = plain_result.grad_norm
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    )
    sharded = _trainer(tmp_path / "sharded")
    fsdp.init_process_group(sharded.device, 60.0)
    fsdp.shard_scorer(sharded.scorer, "fp32")
    sharded.optimizer = torch.optim.AdamW(sharded.model.parameters(), lr=1e-3, eps=1e-8)
    sharded.scheduler = torch.optim.lr_scheduler.LambdaLR(sharded.optimizer, lambda _: 1.0)
    try:
        totals, result = sharded.update(_sequences(sharded))
        norm = result.grad_norm
        assert abs(totals.loss - plain_totals.loss) <= 1e-5
        assert abs(norm - plain_norm) <= 1e-4 * plain_norm
    finally:
        dist.destroy_process_group()


def test_dcp_round_trip_on_cuda(tmp_path: Path, tiny_model: Path) -> None:
    from trainer.checkpoint import CheckpointStore, TrainerState

    trainer = _trainer(tmp_path)
    trainer.update(_sequences(trainer))
    store = CheckpointStore(tmp_path, model_source=str(tiny_model))
    store.save(trainer.model, trainer.optimizer, TrainerState(step=1, weight_version=3), trainer.scheduler)
    other = _trainer(tmp_path / "other")
    state = store.load(other.model, other.optimizer, scheduler=other.scheduler)
    assert state.step == 1 and state.weight_version == 3
    for (name, a), (_, b) in zip(
        trainer.model.named_parameters(), other.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    next_a = trainer.update(_sequences(trainer, seed=1))[0].loss
    next_b = other.update(_sequences(other, seed=1))[0].loss
    assert abs(next_a - next_b) <= 1e-6


def test_bf16_step_on_a_1_5b_shape_at_8_x_1024(tmp_path: Path) -> None:
    import time

    from transformers import AutoConfig, AutoModelForCausalLM

    from parity.sampling import SamplingTransform
    from trainer.device import peak_memory_bytes
    from trainer.policy import SequenceInput, scorer_for, token_logprobs

    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.to("cuda").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    scorer = scorer_for(model, "bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        SequenceInput(
            tuple(torch.randint(0, 151936, (256,), generator=generator).tolist()),
            tuple(torch.randint(0, 151936, (769,), generator=generator).tolist()),
            SamplingTransform(),
        )
        for _ in range(8)
    ]
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step is timed
        start = time.perf_counter()
        for chunk in (sequences[:4], sequences[4:]):
            logprobs_T, _ = token_logprobs(scorer, chunk, with_entropy=False)
            (-logprobs_T.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak_gib = peak_memory_bytes(torch.device("cuda")) / 2**30
    print(f"1.5B bf16 8x1024: {8 * 1024 / seconds:.0f} tokens/s, peak memory {peak_gib:.1f} GiB")
    assert torch.isfinite(logprobs_T).all()
