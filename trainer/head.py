"""The float32 head, scored in chunks: logprobs of the sampled tokens, never [T, V] at once.

    W = the head weight in weight_dtype (float32, or the bf16 copy a bf16 engine holds)
    for each chunk of <= chunk_tokens tokens sharing one sampling transform:
        logits_cV = float32_logits(hidden_cH, W, b)               # parity/head_logits.py: float32 out
        lp_cV     = processed_logprobs(logits_cV, transform)       # parity.sampling, as the engine sampled
        lp_c      = lp_cV[c, target_c];  entropy_c (no gradient)
        D_cV      = (onehot(target_c) - exp(lp_cV)) * scale        # d lp_c / d logits_cV, kept in grad_dtype
    backward:  dlogits_cV = g_c * D_cV;  dhidden_cH = dlogits_cV @ W;  dW += dlogits_cVᵀ @ hidden_cH

Invariants:
- The logprobs and entropies are the values of `processed_logprobs` over the chunk's rows: the same
  float32 ops as scoring the whole [T, V] at once, row by row. Only one chunk's float32 [c, V] is
  alive at a time, and without gradient (rescoring, metrics, the reference model) nothing is kept.
- The gradient is the analytic one autograd derives through temperature (scale = 1/temperature,
  1 when greedy), the top-k/top-p mask (a constant: masked entries get 0), log_softmax and the
  gather. It is computed in the forward, from probabilities already there, so the backward
  recomputes no logits: the head costs one GEMM forward (float32 output) and two GEMMs backward.
- `weight_dtype` is the dtype the weight (and bias) are rounded to before the head GEMM; the logits
  are float32 either way. bfloat16 (the trainer's bf16 mode) scores with the weight a bf16 engine
  holds, so the trainer's logits are the engine's function; on CUDA that GEMM runs on tensor cores
  with float32 accumulation. The gradient reaches the float32 weight through the rounding unchanged,
  as through the decoder's bf16 casts.
- `grad_dtype` is the dtype of D and of the two backward GEMMs. float32 reproduces autograd's
  gradient up to rounding; bfloat16 halves D's memory and runs the backward GEMMs on tensor cores.
  The logprobs the parity checks compare never depend on it.

Shapes: T scored tokens, H hidden, V vocab, c tokens of one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.head_logits import float32_logits, tensor_core_path
from parity.sampling import SamplingTransform, processed_logprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HeadOptions:
    chunk_tokens: int = 1024  # tokens per chunk; 0 = all tokens of a transform at once
    grad_dtype: str = "float32"  # "float32" | "bfloat16"


@dataclass(frozen=True)
class TokenGroup:
    """Tokens scored under one transform: `index_t` (positions in [T]), or None for all T in order."""

    transform: SamplingTransform
    index_t: torch.Tensor | None


def score_tokens(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_T: torch.Tensor,
    groups: tuple[TokenGroup, ...],
    with_entropy: bool,
    options: HeadOptions,
    weight_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target token [T], entropy of each position's processed distribution [T]),
    float32; gradient flows into `hidden_TH`, `weight_VH` and `bias_V` when grad is enabled.
    `weight_dtype` (None: float32) is what the weight and bias are rounded to for the head GEMM."""
    return _ScoredHead.apply(
        hidden_TH, weight_VH, bias_V, targets_T, groups, with_entropy, options, weight_dtype
    )


def _chunks(group: TokenGroup, total: int, size: int):
    """Slices (contiguous, all tokens in order) or index tensors of at most `size` tokens."""
    count = total if group.index_t is None else int(group.index_t.numel())
    step = count if size <= 0 else size
    for start in range(0, count, max(step, 1)):
        end = min(start + step, count)
        yield slice(start, end) if group.index_t is None else group.index_t[start:end]


def _autograd_function():
    import torch

    class ScoredHead(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx, hidden_TH, weight_VH, bias_V, targets_T, groups, with_entropy, options, weight_dtype
        ):
            total = hidden_TH.shape[0]
            device = hidden_TH.device
            logprobs_T = torch.empty(total, dtype=torch.float32, device=device)
            entropy_T = torch.zeros(total, dtype=torch.float32, device=device)
            keep_grad = any(ctx.needs_input_grad[:3])
            grad_dtype = getattr(torch, options.grad_dtype)
            weight_dtype = weight_dtype or torch.float32
            weight = weight_VH.to(weight_dtype)
            bias = None if bias_V is None else bias_V.to(weight_dtype)
            if not tensor_core_path(hidden_TH, weight):
                weight = weight.float()  # upcast once here, not once per chunk: the same values
            saved: list[tuple[object, torch.Tensor]] = []
            for group in groups:
                transform = group.transform
                scale = 1.0 if transform.greedy else 1.0 / transform.temperature
                for rows in _chunks(group, total, options.chunk_tokens):
                    logits_cV = float32_logits(hidden_TH[rows], weight, bias)
                    lp_cV = processed_logprobs(logits_cV, transform)
                    del logits_cV
                    target_c1 = targets_T[rows].unsqueeze(-1)
                    lp_c = lp_cV.gather(-1, target_c1).squeeze(-1)
                    logprobs_T[rows] = lp_c
                    if with_entropy:
                        probs_cV = lp_cV.exp()
                        finite_cV = torch.where(probs_cV > 0, lp_cV, torch.zeros_like(lp_cV))
                        entropy_T[rows] = -(probs_cV * finite_cV).sum(-1)
                        del lp_cV, finite_cV
                    else:
                        probs_cV = lp_cV.exp_()  # the logprobs are not needed past this point
                    if keep_grad:
                        # D = (onehot - p) * scale; a masked target (logprob -inf) gets no onehot.
                        onehot_c1 = torch.isfinite(lp_c).to(probs_cV.dtype).unsqueeze(-1)
                        d_cV = probs_cV.neg_().scatter_add_(-1, target_c1, onehot_c1)
                        if scale != 1.0:
                            d_cV.mul_(scale)
                        saved.append((rows, d_cV.to(grad_dtype)))
                    del probs_cV
            ctx.mark_non_differentiable(entropy_T)
            if keep_grad:
                ctx.save_for_backward(hidden_TH, weight_VH, *(d_cV for _, d_cV in saved))
                ctx.rows = [rows for rows, _ in saved]
                ctx.has_bias = bias_V is not None
                ctx.grad_dtype = grad_dtype
                ctx.weight_dtype = weight_dtype
            return logprobs_T, entropy_T

        @staticmethod
        def backward(ctx, grad_logprobs_T, _grad_entropy):
            hidden_TH, weight_VH, *d_chunks = ctx.saved_tensors
            needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
            dtype = ctx.grad_dtype
            weight = weight_VH.to(ctx.weight_dtype).to(dtype)  # the weight the forward multiplied by
            grad_hidden = torch.zeros_like(hidden_TH) if needs_hidden else None
            grad_weight = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device)
            grad_bias = (
                torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=weight_VH.device)
                if ctx.has_bias
                else None
            )
            for rows, d_cV in zip(ctx.rows, d_chunks, strict=True):
                dlogits_cV = d_cV * grad_logprobs_T[rows].to(dtype).unsqueeze(-1)
                if needs_hidden:
                    grad_hidden[rows] = (dlogits_cV @ weight).to(hidden_TH.dtype)
                if needs_weight:
                    grad_weight += (dlogits_cV.t() @ hidden_TH[rows].to(dtype)).float()
                if grad_bias is not None and needs_bias:
                    grad_bias += dlogits_cV.float().sum(0)
            return (
                grad_hidden,
                grad_weight.to(weight_VH.dtype) if needs_weight else None,
                grad_bias if needs_bias else None,
                None,
                None,
                None,
                None,
                None,
            )

    return ScoredHead


class _ScoredHead:
    """The autograd Function, built on first use (torch is imported lazily by the trainer)."""

    _fn = None

    @classmethod
    def apply(cls, *args):
        if cls._fn is None:
            cls._fn = _autograd_function()
        return cls._fn.apply(*args)
