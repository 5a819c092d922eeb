"""Numerics of the trainer: fp32, or bf16 compute over fp32 master weights; TF32 off.

Invariants:
- `fp32`: parameters, activations, gradients and AdamW state are float32 (the parity-check mode).
- `bf16`: parameters stay float32 (the master weights the optimizer updates, with float32 AdamW
  state); the decoder computes in bfloat16 with bfloat16 copies of its weights, activations
  included, as a bf16 inference engine does — on one device by `bf16_decoder` (each layer's and
  the final norm's weights cast on entry, the embeddings' output cast), under FSDP2's
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the layers and the final norm when
  sharded, so gradients are reduced in float32. Both give the same logprobs, bit for bit. Gradients reach the float32 weights through the casts. Not autocast: it keeps a float32
  residual stream, a different function from the engine's (k3 ~1e-2 against a bf16 engine on the
  tiny model, against ~1e-4 this way; bench/bf16_forward.py).
- In both modes the lm_head's logits and the log-softmax are float32: the trainer's logprobs are
  the reference side of the mismatch metrics, and bf16 logits alone move logprobs by ~1e-2 (8
  mantissa bits on logits of magnitude ~10). The head weight is the one the engine multiplies by:
  float32 in fp32 mode; in bf16 mode its bf16 copy, as a bf16 engine with an fp32 head holds it
  (vLLM's lm_head stays in the model dtype and accumulates into float32), with every product exact
  in float32 (`head_weight_dtype`, parity/head_logits.py).
- TF32 is off for every float32 matmul (`torch.backends.cuda.matmul.allow_tf32 = False`, cuDNN too,
  float32 matmul precision "highest"): TF32 keeps 10 mantissa bits, so an fp32 head computed with it
  is closer to a bf16 head than to the fp32 reference vLLM's float32 head produces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def disable_tf32() -> None:
    """float32 matmuls in full float32 (process-wide; the trainer computes logprobs everywhere)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def bf16_decoder(lm) -> None:
    """Make the HF causal LM `lm`'s decoder compute in bfloat16 over its float32 weights, as a bf16
    engine computes (idempotent): the embeddings' output is cast to bf16, and each decoder layer and
    the final norm run with bf16 casts of their weights, swapped in before their forward and the
    float32 parameters put back after it (also when it raises). Activation checkpointing's
    recompute runs the same hooks. The head is not touched here: trainer/head.py rounds its weight
    and computes float32 logits."""
    import torch

    if getattr(lm, "parity_bf16_decoder", False):
        return
    decoder = getattr(lm, lm.base_model_prefix)
    lm.get_input_embeddings().register_forward_hook(lambda _m, _args, out: out.to(torch.bfloat16))
    final_norm = getattr(decoder, "norm", None)
    for module in (*decoder.layers, *([final_norm] if final_norm is not None else [])):
        module.register_forward_pre_hook(_cast_weights_in)
        module.register_forward_hook(_put_weights_back, always_call=True)
    lm.parity_bf16_decoder = True


def _cast_weights_in(module, _args) -> None:
    import torch

    swapped: list = []
    # On the stack before the first swap: a cast that raises (out of memory) leaves the weights it
    # already swapped where _put_weights_back, which runs also then, finds them.
    module.__dict__.setdefault("_parity_swapped", []).append(swapped)
    for owner in module.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and param.dtype == torch.float32:
                bf16 = param.to(torch.bfloat16)  # differentiable: grads reach param
                swapped.append((owner, name, param))
                owner._parameters[name] = bf16


def _put_weights_back(module, _args, _output) -> None:
    stack = module.__dict__.get("_parity_swapped")
    if stack:
        for owner, name, param in stack.pop():
            owner._parameters[name] = param


def head_weight_dtype(precision: str) -> torch.dtype:
    """The dtype the head weight is rounded to before the float32-output head GEMM."""
    import torch

    return torch.bfloat16 if precision == "bf16" else torch.float32


def compute_precision(precision: str, dtype: str) -> str:
    """What the decoder's matmuls run in (bf16|fp32), for the device's peak FLOP/s: `precision`
    bf16, or bfloat16 parameters (`trainer.dtype`) under fp32 precision."""
    return "bf16" if precision == "bf16" or dtype == "bfloat16" else "fp32"


def fp32_region(device: torch.device):
    """Autocast off: the head and log-softmax are float32 even when a caller runs the scorer under
    autocast."""
    import torch

    return torch.autocast(device_type=device.type, enabled=False)


def mixed_precision_policy(precision: str, for_head: bool = False):
    """FSDP2 policy: layers and the final norm get bf16 params and fp32 gradient reduction in bf16
    mode; the root (embeddings, lm_head: `for_head`) keeps fp32 params: the head rounds its weight
    itself (`head_weight_dtype`) and its gradient reaches the float32 weight unrounded."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16" or for_head:
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
