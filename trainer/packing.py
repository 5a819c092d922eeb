"""Sequence packing: a micro-batch as one row of back-to-back sequences, no padding.

    input_ids  [1, N] = seq_0 ‖ seq_1 ‖ ...           N = Σ L_i (no pad token anywhere)
    position_ids [1, N] = 0..L_0-1 ‖ 0..L_1-1 ‖ ...    RoPE sees each sequence from position 0
    cu_seq_lens (S+1 ints) = 0, L_0, L_0+L_1, ..., N    the sequence boundaries (a host tuple: read
                                                         by every layer, never moved to the device)

Invariants:
- Attention never crosses a boundary: `varlen_attention` (registered with transformers as the
  attention implementation `parity_varlen`) runs causal SDPA on each [start, end) slice alone,
  so each sequence costs L_i², not N², and no mask is materialised. Without `cu_seq_lens` it is
  plain causal SDPA over the whole row (an unpadded batch), so `model(input_ids)` still works.
- With position ids restarting and attention confined, a packed sequence's logits are those of
  the same sequence run alone up to float32 summation order: the linear layers run as one [N, H]
  GEMM instead of B x [L, H] ones (measured on the tiny model: 5e-15 in float64, ~3e-5 in float32,
  the same size as padded-vs-alone; tests/test_trainer_packing.py).
- A micro-batch's cost is its real token count N: the token budget (`micro_batch_tokens`) bounds
  N, never a padded B x L. Sequences of one length are run as [S, L] rows (nothing to pad, one
  batched SDPA call instead of S).

The model must be loaded with `attn_implementation=ATTENTION` (policy.load_model(packing=True));
GPU note: this loop of SDPA calls is exact on CUDA too; a fused varlen kernel (flash-attn's
`cu_seqlens`) would be faster and is not wired here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ATTENTION = "parity_varlen"
_REGISTERED = False


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [B, Hq, N, D], key/value [B, Hkv, N, D] ->
    ([B, N, Hq, D], None). Causal within each `cu_seq_lens` segment (B must be 1 then)."""
    import torch
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    cu_seq_lens = kwargs.get("cu_seq_lens")
    if attention_mask is not None:
        raise ValueError("parity_varlen attention takes packed sequences (cu_seq_lens), not a padding mask")
    if cu_seq_lens is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, dropout_p=dropout
        )
    else:
        if query.shape[0] != 1:
            raise ValueError(f"packed attention needs one row, got batch {query.shape[0]}")
        bounds = list(cu_seq_lens)
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, s:e],
                    key[:, :, s:e],
                    value[:, :, s:e],
                    is_causal=True,
                    scale=scaling,
                    dropout_p=dropout,
                )
                for s, e in itertools.pairwise(bounds)
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `parity_varlen` known to transformers (idempotent); returns its name."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION, varlen_attention)
        _REGISTERED = True
    return ATTENTION


def is_packed(model) -> bool:
    """Whether `model` (an HF model) runs the packed attention."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION


def scored_length(prompt_len: int, completion_len: int) -> int:
    """Tokens a sequence puts through the model: prompt + completion minus the last token."""
    return prompt_len + completion_len - 1


def pack_batch(sequences: Sequence[Any]):
    """One packed micro-batch of SequenceInputs: host tensors input_ids [1, N], position_ids [1, N],
    the bounds tuple cu_seq_lens (S+1 ints), and rows [T], cols [T], targets [T]; rows/cols index the
    hidden state that predicts each completion token (rows are all 0).

    Sequences of one length need no packing to avoid padding: they come as S rows of [S, L] and
    cu_seq_lens None (plain causal attention per row, one batched SDPA instead of S calls)."""
    import torch

    if any(len(s.prompt_ids) == 0 or len(s.completion_ids) == 0 for s in sequences):
        raise ValueError("every sequence needs a non-empty prompt and completion")
    lengths = {scored_length(len(s.prompt_ids), len(s.completion_ids)) for s in sequences}
    if len(lengths) == 1 and len(sequences) > 1:
        return _rows_of_one_length(sequences, lengths.pop())
    ids: list[int] = []
    positions: list[int] = []
    bounds = [0]
    cols: list[int] = []
    targets: list[int] = []
    for seq in sequences:
        length = scored_length(len(seq.prompt_ids), len(seq.completion_ids))
        start = len(ids)
        ids.extend((seq.prompt_ids + seq.completion_ids)[:length])
        positions.extend(range(length))
        bounds.append(len(ids))
        first = start + len(seq.prompt_ids) - 1  # the prompt's last token predicts completion[0]
        cols.extend(range(first, first + len(seq.completion_ids)))
        targets.extend(seq.completion_ids)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return (
        as_long(ids).unsqueeze(0),
        as_long(positions).unsqueeze(0),
        tuple(bounds),
        torch.zeros(len(cols), dtype=torch.long),
        as_long(cols),
        as_long(targets),
    )


def _rows_of_one_length(sequences: Sequence[Any], length: int):
    import torch

    input_ids = torch.tensor([list((s.prompt_ids + s.completion_ids)[:length]) for s in sequences])
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for b, seq in enumerate(sequences):
        first = len(seq.prompt_ids) - 1
        rows.extend([b] * len(seq.completion_ids))
        cols.extend(range(first, first + len(seq.completion_ids)))
        targets.extend(seq.completion_ids)
    positions = torch.arange(length).expand(len(sequences), length).contiguous()
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return input_ids, positions, None, as_long(rows), as_long(cols), as_long(targets)


def packed_tokens(sequences: Sequence[Any]) -> int:
    """N of the packed row (what its forward costs; no padding)."""
    return sum(scored_length(len(s.prompt_ids), len(s.completion_ids)) for s in sequences)


def pack_micro_batches(items: Sequence[Any], key, max_sequences: int, max_tokens: int) -> list[list[Any]]:
    """Split into micro-batches of at most `max_sequences` sequences and at most `max_tokens` packed
    tokens when `max_tokens` > 0 (a longer single sequence goes alone). Longest first, each into
    the first micro-batch with room (first-fit decreasing: few, full micro-batches)."""
    length = lambda item: scored_length(len(key(item).prompt_ids), len(key(item).completion_ids))  # noqa: E731
    if max_tokens <= 0:
        return [list(items[i : i + max_sequences]) for i in range(0, len(items), max_sequences)]
    batches: list[list[Any]] = []
    loads: list[int] = []
    for item in sorted(items, key=length, reverse=True):
        size = length(item)
        for index, batch in enumerate(batches):
            if len(batch) < max_sequences and loads[index] + size <= max_tokens:
                batch.append(item)
                loads[index] += size
                break
        else:
            batches.append([item])
            loads.append(size)
    return batches


def to_tensors(batch, device: torch.device):
    """`pack_batch`'s tensors on `device` (the bounds stay a host tuple)."""
    from trainer.device import to_device

    input_ids, positions, bounds, rows, cols, targets = batch
    return (
        to_device(input_ids, device),
        to_device(positions, device),
        bounds,
        to_device(rows, device),
        to_device(cols, device),
        to_device(targets, device),
    )
