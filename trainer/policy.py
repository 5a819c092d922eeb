"""The policy: an HF causal LM whose lm_head runs in float32, scored under each rollout's transform.

Invariants:
- Logits are computed only at completion positions, as float32 `hidden.float() @ W_head.float()ᵀ`
  whatever the parameter dtype (a bf16 head is a known source of train-inference mismatch).
- Each sequence's logprobs come from `parity.sampling.processed_logprobs` under *its own* recorded
  transform (temperature, then top-k/top-p mask, renormalised) — the distribution vLLM sampled from
  with `logprobs_mode=processed_logprobs` — so they are directly comparable with rollout logprobs.
- Entropy is of that same processed distribution, computed without gradient.
- Sequences are right-padded; position ids are 0..L-1 per row, as in generation.

Shapes: B sequences, L padded length, H hidden, V vocab, T completion tokens of the micro-batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parity.sampling import SamplingTransform, processed_logprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SequenceInput:
    """One rollout to score: prompt + completion, and the transform that sampled the completion."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    transform: SamplingTransform


def load_model(model_dir: str | Path, dtype: str = "float32"):
    """AutoModelForCausalLM from a local directory (no hub), in train mode without dropout."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    model.config.use_cache = False
    model.train()
    return model


def head_weight(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def token_logprobs(
    model, sequences: Sequence[SequenceInput], with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of every completion token [T], entropy at each of those positions [T]).

    Tokens are in sequence order, then position order. Gradient flows into the logprobs when the
    caller has grad enabled; entropy never carries gradient.
    """
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in sequences]
    if any(len(s.prompt_ids) == 0 or len(s.completion_ids) == 0 for s in sequences):
        raise ValueError("every sequence needs a non-empty prompt and completion")
    max_len = max(lengths)
    input_ids_BL = torch.zeros(len(sequences), max_len, dtype=torch.long)
    mask_BL = torch.zeros(len(sequences), max_len, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for b, (seq, length) in enumerate(zip(sequences, lengths, strict=True)):
        ids = (seq.prompt_ids + seq.completion_ids)[:length]
        input_ids_BL[b, :length] = torch.tensor(ids, dtype=torch.long)
        mask_BL[b, :length] = 1
        start = len(seq.prompt_ids) - 1
        rows.extend([b] * len(seq.completion_ids))
        cols.extend(range(start, start + len(seq.completion_ids)))
        targets.extend(seq.completion_ids)
    decoder = getattr(model, model.base_model_prefix)
    hidden_BLH = decoder(
        input_ids=input_ids_BL.to(device), attention_mask=mask_BL.to(device)
    ).last_hidden_state
    hidden_TH = hidden_BLH[torch.tensor(rows, device=device), torch.tensor(cols, device=device)]
    weight_VH, bias_V = head_weight(model)
    logits_TV = F.linear(hidden_TH.float(), weight_VH.float(), None if bias_V is None else bias_V.float())
    targets_T = torch.tensor(targets, dtype=torch.long, device=device)
    # One processed_logprobs call per distinct transform (usually one per micro-batch).
    token_ranges: dict[SamplingTransform, list[int]] = defaultdict(list)
    offset = 0
    for seq in sequences:
        token_ranges[seq.transform].extend(range(offset, offset + len(seq.completion_ids)))
        offset += len(seq.completion_ids)
    entropy_T = torch.zeros(offset, dtype=torch.float32, device=device)
    indices, values = [], []
    for transform, index in token_ranges.items():
        index_t = torch.tensor(index, dtype=torch.long, device=device)
        # One transform for the whole micro-batch (the usual case): no gather, whose backward is a
        # [T, V] scatter-add.
        lp_tV = processed_logprobs(logits_TV if len(token_ranges) == 1 else logits_TV[index_t], transform)
        indices.append(index_t)
        values.append(lp_tV.gather(-1, targets_T[index_t].unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            with torch.no_grad():
                lp = lp_tV.detach()
                p = lp.exp()
                entropy_T[index_t] = -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)
    if len(values) == 1:
        return values[0], entropy_T  # one transform: tokens are already in order
    # Put the per-transform pieces back in token order (differentiable gather by inverse permutation).
    order_T = torch.cat(indices)
    return torch.cat(values)[torch.argsort(order_T)], entropy_T
