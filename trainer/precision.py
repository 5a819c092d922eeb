"""Numerics of the trainer: fp32, or bf16 compute over fp32 master weights; TF32 off.

Invariants:
- `fp32`: parameters, activations, gradients and AdamW state are float32 (the parity-check mode).
- `bf16`: parameters stay float32 (the master weights the optimizer updates, with float32 AdamW
  state); the decoder's matmuls run in bfloat16 — under torch.autocast on one device, under FSDP2's
  MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) when sharded, so gradients are reduced
  in float32.
- In both modes the lm_head and the log-softmax run in float32 on float32 weights: the trainer's
  logprobs are the reference side of the mismatch metrics, and a bf16 head alone moves logprobs by
  ~1e-2 (8 mantissa bits on logits of magnitude ~10).
- TF32 is off for every float32 matmul (`torch.backends.cuda.matmul.allow_tf32 = False`, cuDNN too,
  float32 matmul precision "highest"): TF32 keeps 10 mantissa bits, so an fp32 head computed with it
  is closer to a bf16 head than to the fp32 reference vLLM's float32 head produces.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def disable_tf32() -> None:
    """float32 matmuls in full float32 (process-wide; the trainer computes logprobs everywhere)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def decoder_autocast(precision: str, device: torch.device, sharded: bool):
    """The context the decoder runs under: bf16 autocast unsharded in bf16 mode; else nothing
    (fp32, or FSDP2 casting the parameters itself)."""
    if precision != "bf16" or sharded:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def fp32_region(device: torch.device):
    """Autocast off (the head and log-softmax are float32 even inside a bf16 region)."""
    import torch

    return torch.autocast(device_type=device.type, enabled=False)


def mixed_precision_policy(precision: str, for_head: bool = False):
    """FSDP2 policy: layers get bf16 params and fp32 gradient reduction in bf16 mode; the root
    (embeddings, final norm, lm_head) keeps fp32 params so the head stays float32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision != "bf16" or for_head:
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
