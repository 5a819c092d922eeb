"""Device selection, precision and micro-batching on CPU (the CUDA side is in test_trainer_gpu.py).

- `trainer.device=cuda` without a GPU is an error naming the field, never a silent CPU run;
- in bf16 the decoder runs in bfloat16 but the head's logits and the logprobs are float32, close
  to the fp32 ones and not equal to them; the bf16 trainer scores exactly what the model loaded in
  bfloat16 scores (a bf16 engine's function), and its gradients reach the float32 weights, which
  are back in place after every forward (after one that raised too);
- a token budget bounds every micro-batch's padded tokens, keeps every sequence once, and one
  step's metrics report peak memory and no MFU on a CPU (its peak FLOPs are unknown).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.sampling import SamplingTransform
from tests.conftest import config_for


def test_cuda_without_a_gpu_names_the_field() -> None:
    from parity.config.base import ConfigError
    from trainer.device import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(ConfigError, match=r"trainer\.device"):
        resolve_device("cuda")
    assert resolve_device("auto").type == "cpu"


def _inputs(count: int = 6):
    from trainer.policy import SequenceInput

    generator = torch.Generator().manual_seed(0)
    return [
        SequenceInput(
            tuple(torch.randint(3, 250, (4 + i,), generator=generator).tolist()),
            tuple(torch.randint(3, 250, (3 + 2 * i,), generator=generator).tolist()),
            SamplingTransform(),
        )
        for i in range(count)
    ]


def test_bf16_decoder_with_an_fp32_head(tiny_model: Path) -> None:
    from trainer.policy import load_model, pad_batch, scorer_for, token_logprobs

    model = load_model(tiny_model)
    inputs = _inputs()
    seen: list[torch.dtype] = []
    layer = model.model.layers[0].mlp.down_proj
    handle = layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    with torch.no_grad():
        bf16 = scorer_for(model, "bf16")
        logits_TV = bf16(*pad_batch(inputs)[:4])
        lp_bf16, _ = token_logprobs(bf16, inputs)
        lp_fp32, _ = token_logprobs(scorer_for(load_model(tiny_model), "fp32"), inputs)
    handle.remove()
    assert seen and set(seen) == {torch.bfloat16}
    assert logits_TV.dtype == torch.float32 and lp_bf16.dtype == torch.float32
    diff = float((lp_bf16 - lp_fp32).abs().max())
    assert 0 < diff < 1.0, diff  # bf16 activations on a random model
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32


# A bf16 engine holds bf16 weights and computes in bf16 throughout (the reference engine: the HF
# model loaded in bfloat16), its lm_head included: an fp32 head multiplies the bf16 head weight into
# float32 logits. The bf16 trainer must be that function over its float32 weights, so that the
# own-version mismatch measures the engine, not a second rounding scheme of the trainer's. Under
# autocast (a float32 residual stream) they are 0.32 apart; with the float32 master head weight in
# place of its bf16 copy, 1.2e-2.
@pytest.mark.parametrize("packing", [False, True])
def test_bf16_trainer_scores_what_a_bf16_model_scores(tiny_model: Path, packing: bool) -> None:
    from trainer.policy import load_model, scorer_for, token_logprobs

    inputs = _inputs()
    trainer_model = load_model(tiny_model, packing=packing, share_prompts=packing)
    engine_model = load_model(tiny_model, "bfloat16", packing=packing, share_prompts=packing)
    with torch.no_grad():
        ours, _ = token_logprobs(scorer_for(trainer_model, "bf16"), inputs)
        # the engine side's head: float32 logits from its own bf16 head weight
        assert engine_model.lm_head.weight.dtype == torch.bfloat16
        engine, _ = token_logprobs(scorer_for(engine_model, "fp32"), inputs)
    worst = float((ours - engine).abs().max())
    print(f"bf16 trainer vs bf16 model (packing {packing}): max |Δ logprob| {worst:.1e}")
    assert ours.numel() == sum(len(s.completion_ids) for s in inputs)
    assert worst <= 1e-6


def test_a_model_is_scored_one_way(tiny_model: Path) -> None:
    """A bf16 scorer changes its model's decoder for good: scoring the HF model afterwards goes
    through that scorer (not a new fp32 one, which would put the float32 head weight under a bf16
    decoder), and asking for another way is an error naming the setting."""
    from trainer.head import HeadOptions
    from trainer.policy import load_model, scorer_for, token_logprobs

    model = load_model(tiny_model)
    bf16 = scorer_for(model, "bf16")
    assert scorer_for(model) is bf16 and scorer_for(bf16) is bf16 and scorer_for(model, "bf16") is bf16
    with pytest.raises(ValueError, match="precision"):
        scorer_for(model, "fp32")
    with pytest.raises(ValueError, match="head"):
        scorer_for(bf16, head=HeadOptions(chunk_tokens=7))
    inputs = _inputs()
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, inputs)[0], token_logprobs(bf16, inputs)[0])
    assert scorer_for(load_model(tiny_model)) is not bf16


def test_bf16_gradients_reach_the_float32_weights_which_stay_in_place(tiny_model: Path) -> None:
    from trainer.policy import load_model, scorer_for, token_logprobs

    model = load_model(tiny_model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = {name: p for name, p in model.named_parameters()}
    scorer = scorer_for(model, "bf16")
    logprobs, _ = token_logprobs(scorer, _inputs())
    logprobs.sum().backward()  # the checkpointed layers recompute through the same casts
    after = dict(model.named_parameters())
    assert all(after[name] is param for name, param in before.items())
    assert all(p.dtype == torch.float32 and p.grad is not None for p in after.values())
    assert all(p.grad.dtype == torch.float32 for p in after.values())
    assert float(after["model.layers.0.mlp.down_proj.weight"].grad.abs().max()) > 0
    # A forward that raises inside a layer still puts the float32 weights back.
    layer = model.model.layers[0]
    handle = layer.mlp.register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        token_logprobs(scorer, _inputs(2))
    handle.remove()
    assert all(dict(model.named_parameters())[name] is param for name, param in before.items())


def test_a_bf16_cast_that_runs_out_of_memory_puts_back_the_weights_it_swapped(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The third weight's cast on entry to a layer fails (as an out-of-memory on a GPU does): the
    two weights already swapped for bf16 copies are the float32 parameters again afterwards, and a
    later step computes as before."""
    from trainer.policy import load_model, scorer_for, token_logprobs

    model = load_model(tiny_model)
    scorer = scorer_for(model, "bf16")
    before = dict(model.named_parameters())
    with torch.no_grad():
        expected = token_logprobs(scorer, _inputs(2))[0]
    real_to, casts = torch.Tensor.to, []

    def to(self, *args, **kwargs):
        if args and args[0] is torch.bfloat16 and isinstance(self, torch.nn.Parameter):
            casts.append(self)
            if len(casts) == 3:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        token_logprobs(scorer, _inputs(2))
    monkeypatch.undo()
    after = dict(model.named_parameters())
    assert len(casts) == 3 and all(after[name] is param for name, param in before.items())
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in after.values())
    with torch.no_grad():
        assert torch.equal(token_logprobs(scorer, _inputs(2))[0], expected)


def test_token_budget_bounds_padded_tokens() -> None:
    from trainer.policy import padded_tokens, token_budget_batches

    inputs = _inputs(9)
    batches = token_budget_batches(inputs, lambda s: s, max_sequences=4, max_tokens=60)
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in inputs)
    for batch in batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or padded_tokens(batch) <= 60
    assert len(token_budget_batches(inputs, lambda s: s, max_sequences=4)) == 3  # no budget: by count


def test_step_metrics_report_peak_memory_and_no_mfu_on_cpu(tmp_path: Path, tiny_model: Path) -> None:
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.loop import Trainer
    from trainer.prepare import prepare
    from trainer.step_metrics import speed_metrics

    trainer = Trainer(
        config_for("trainer", model="tiny", device="cpu", run_dir=str(tmp_path), micro_batch_tokens=64)
    )
    trainer.setup_model()
    group = make_group(trainer.model, "g", (1.0, 0.0, 0.0, 1.0), generator=torch.Generator().manual_seed(0))
    sequences = prepare(Batch(groups=[group]), trainer.config).sequences
    stats, result = trainer.update(sequences)
    assert result.stepped and stats.train_forward_tokens > 0
    speed = speed_metrics(stats, trainer._speed, 0.5)
    assert speed["peak_memory_gib"] > 0
    assert "mfu" not in speed


def test_mfu_divides_by_the_peak_of_what_the_decoder_computes_in(tmp_path: Path) -> None:
    """bfloat16 parameters under fp32 precision compute in bf16: their MFU divides by the bf16 peak
    (the fp32 peak made it ~15x too high, above 1)."""
    from trainer.loop import Trainer
    from trainer.precision import compute_precision

    assert compute_precision("fp32", "float32") == "fp32"
    assert compute_precision("bf16", "float32") == "bf16"
    assert compute_precision("fp32", "bfloat16") == "bf16"
    trainer = Trainer(
        config_for("trainer", model="tiny", device="cpu", run_dir=str(tmp_path), dtype="bfloat16")
    )
    trainer.device, trainer.flops_per_token, trainer.world_size, trainer.ref_model = "cpu", 1.0, 1, None
    assert trainer._speed.precision == "bf16"
