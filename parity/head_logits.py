"""float32 logits from the head weights as an engine holds them: the one head GEMM engine and trainer share.

A bf16 engine keeps its lm_head weight in bfloat16, and with an fp32 head (vLLM's
`hf_overrides={"head_dtype": "float32"}`, the reference engine's `head_dtype=float32`) it computes
float32 logits from that bf16 weight. The trainer's bf16 mode scores with the same bf16 copy of its
float32 master weight, so both sides compute one function:

    logits_TV = Σ_h hidden_TH[:, h] · weight_VH[:, h]      (every product exact in float32, float32 sums)

Invariants:
- The output is float32. When `weight_VH` and `hidden_TH` are both bfloat16 (or both float16), each
  product of two 8-bit (11-bit) mantissas is exact in float32, so the logits differ from a float32
  GEMM of the upcast operands only in the order of the float32 sums.
- On CUDA such operands go to `torch.mm(..., out_dtype=torch.float32)`: tensor cores, float32
  accumulation, no float32 copy of the [V, H] weight. This is the call vLLM makes for an fp32 head.
- Anywhere else (CPU, mixed dtypes, a torch without `aten::mm.dtype`, autograd recording), both
  operands are upcast and multiplied in float32: on CPU the same values vLLM's CPU path computes.
- A float32 weight is used as it is (the trainer's fp32 mode). TF32 must be off for that GEMM to be
  float32 (trainer/precision.py `disable_tf32`).

Shapes: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tensor_core_path(hidden_TH: torch.Tensor, weight_VH: torch.Tensor) -> bool:
    """Whether `float32_logits` multiplies these operands in low precision with float32 accumulation."""
    import torch

    grad = torch.is_grad_enabled() and (hidden_TH.requires_grad or weight_VH.requires_grad)
    return (
        not grad  # mm's out_dtype overload has no derivative: the head's own Function runs it
        and hidden_TH.is_cuda
        and weight_VH.is_cuda
        and hidden_TH.dtype == weight_VH.dtype
        and weight_VH.dtype in (torch.bfloat16, torch.float16)
        and hasattr(torch.ops.aten.mm, "dtype")
    )


def float32_logits(
    hidden_TH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 logits [T, V] (any leading shape of `hidden_TH`). Differentiable: with grad enabled
    the operands are upcast (the tensor-core call has no derivative)."""
    import torch
    import torch.nn.functional as F

    bias = None if bias_V is None else bias_V.float()
    if tensor_core_path(hidden_TH, weight_VH):
        flat_TH = hidden_TH.reshape(-1, hidden_TH.shape[-1])
        logits_TV = torch.mm(flat_TH, weight_VH.t(), out_dtype=torch.float32)
        if bias is not None:
            logits_TV = logits_TV + bias
        return logits_TV.reshape(*hidden_TH.shape[:-1], weight_VH.shape[0])
    return F.linear(hidden_TH.float(), weight_VH.float(), bias)
