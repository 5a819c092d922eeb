"""torch.compile for the decoder layers (`trainer.compile`).

    for layer in decoder.layers:  layer.forward = torch.compile(layer.forward, backend, dynamic=True)

Invariants:
- Only each layer's own computation is compiled (norms, projections, RoPE, MLP). Module hooks
  (FSDP2's unshard/reshard, activation checkpointing) stay eager around it, as do the packed
  attention (trainer/packing.py: registered as a compiler-disabled function, so a new segment
  layout is never a recompile: the layout crosses the compiled layer in a box dynamo does not
  open) and the float32 head (trainer/head.py, a custom autograd Function).
- A call that reads or fills a KV cache (the mismatch localiser's prefix replays) runs eager.
- Shapes are dynamic from the first call: a micro-batch of a new token count reuses the graphs.
- Compiled layers compute eager's function with other roundings (fused kernels, another summation
  order): against a float64 decoder, compiled float32 logprobs and gradients are as close as eager's
  (tests/test_trainer_compile.py); aot_eager, which only captures the graphs, gives eager's values.
- In bf16 (trainer/precision.py) inductor rounds every op's output to bf16 as eager does
  (`emulate_precision_casts`), so compiled bf16 logprobs equal eager bf16 ones.
"""

from __future__ import annotations

from typing import Any

from trainer.packing import Layout


def compile_decoder_layers(model: Any, backend: str) -> int:
    """Compile every decoder layer's forward of the HF causal LM `model` in place with `backend`
    ("inductor" or "aot_eager"); returns how many layers were compiled."""
    import torch

    decoder = getattr(model, model.base_model_prefix)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"trainer.compile: {type(decoder).__name__} has no `layers` to compile")
    if backend == "inductor":
        import torch._inductor.config as inductor

        # Round to bf16 wherever eager rounds (each op's output), not only at a fused kernel's
        # end: in bf16 the compiled layers then give eager's logprobs exactly (measured 0.0; up
        # to 0.5 apart without it on the tiny model), so a bf16 engine sees the same function.
        inductor.emulate_precision_casts = True
    for layer in layers:
        layer.forward = _with_eager_cache(
            torch.compile(layer.forward, backend=backend, dynamic=True), layer.forward
        )
    return len(layers)


def _with_eager_cache(compiled, eager):
    """`compiled`, except for calls that read or fill a KV cache (the mismatch localiser's prefix
    replays): those run `eager`, so a cache object is never traced. A packed layout crosses the
    compiled region boxed (packing.Layout): a new number of segments is not a recompile."""

    def forward(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            return eager(*args, **kwargs)
        if kwargs.get("cu_seq_lens") is not None:
            kwargs["cu_seq_lens"] = Layout(kwargs["cu_seq_lens"])
        return compiled(*args, **kwargs)

    return forward
