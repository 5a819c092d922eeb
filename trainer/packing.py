"""Sequence packing: a micro-batch as one row of back-to-back sequences, no padding.

    input_ids  [1, N] = seq_0 ‖ seq_1 ‖ ...           N = Σ L_i (no pad token anywhere)
    position_ids [1, N] = 0..L_0-1 ‖ 0..L_1-1 ‖ ...    RoPE sees each sequence from position 0
    cu_seq_lens (S+1 ints) = 0, L_0, L_0+L_1, ..., N    the sequence boundaries (a host tuple: read
                                                         by every layer, never moved to the device)

Invariants:
- Attention never crosses a boundary: `varlen_attention` (registered with transformers as the
  attention implementation `parity_varlen`) runs causal SDPA on each [start, end) segment alone,
  so each sequence costs L_i², not N², and no whole-row mask is built. Without `cu_seq_lens` it is
  plain causal SDPA over the whole row (an unpadded batch), so `model(input_ids)` still works.
- With position ids restarting and attention confined, a packed sequence's logits are those of
  the same sequence run alone up to float32 summation order: the linear layers run as one [N, H]
  GEMM instead of B x [L, H] ones (measured on the tiny model: 5e-15 in float64, ~3e-5 in float32,
  the same size as padded-vs-alone; tests/test_trainer_packing.py).
- A micro-batch's cost is its real token count N: the token budget (`micro_batch_tokens`) bounds
  N, never a padded B x L. Sequences of one length are run as [S, L] rows (nothing to pad, one
  batched SDPA call instead of S).

Shared prompts (`trainer.share_prompts`, on by default): a GRPO group's samples share one prompt,
so a micro-batch holding several of them writes the prompt once and each sample's continuation after
it (`SharedSegments`):

    input_ids [1, N] = P ‖ c_1 ‖ c_2 ‖ ... ‖ Q ‖ d_1 ‖ ...        c_i = completion_i[:-1]
    position_ids      = 0..p-1 ‖ p..p+|c_1|-1 ‖ p..p+|c_2|-1 ‖ ...

  P attends causally to itself; each continuation attends to all of P and causally to itself, never
  to a sibling. The token that predicts completion_i[0] is P's last, shared by the group. So every
  completion token's logits are those of prompt + completion alone (float64: ~1e-15), the prompt's
  tokens go through the model once per micro-batch instead of once per sample, and the gradient into
  the prompt's hidden states is the sum over the samples (the same as over copies).

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
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    cu_seq_lens = kwargs.get("cu_seq_lens")
    if isinstance(cu_seq_lens, Layout):
        cu_seq_lens = cu_seq_lens.bounds
    if attention_mask is not None:
        raise ValueError("parity_varlen attention takes packed sequences (cu_seq_lens), not a padding mask")
    if cu_seq_lens is not None and query.shape[0] != 1:
        raise ValueError(f"packed attention needs one row, got batch {query.shape[0]}")
    if cu_seq_lens is None and query.shape[2] != key.shape[2]:
        # After a KV cache (the localiser's prefix replays): the queries are the last positions, so
        # the causal mask aligns to the bottom right; SDPA's is_causal aligns it to the top left.
        mask = _causal_after_prefix(query.shape[2], key.shape[2], query.device)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, dropout_p=dropout
        )
    elif cu_seq_lens is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, dropout_p=dropout
        )
    else:
        out = _segmented_attention(query, key, value, cu_seq_lens, scaling, dropout)
    return out.transpose(1, 2).contiguous(), None


class Layout:
    """`cu_seq_lens` (bounds or SharedSegments) in a box torch.compile does not look into: a tuple
    crossing a compiled layer would be guarded on its length, so every new number of segments
    would recompile (trainer/compiled.py boxes it; `varlen_attention` unboxes it)."""

    __slots__ = ("bounds",)

    def __init__(self, bounds) -> None:
        self.bounds = bounds


class SharedSegments(tuple):
    """The packed row's segments when prompts are shared: (prefix_start, prefix_end, start, end)
    each, in row order, covering [0, N). Positions [start, end) attend causally to themselves and
    to all of [prefix_start, prefix_end) (empty for a prompt, or a sequence alone)."""


def _segments(bounds) -> Sequence[tuple[int, int, int, int]]:
    """(prefix_start, prefix_end, start, end) per segment; plain bounds have empty prefixes."""
    if isinstance(bounds, SharedSegments):
        return bounds
    return [(start, start, start, end) for start, end in itertools.pairwise(bounds)]


def _segmented_attention(query, key, value, bounds, scaling, dropout):
    """Each segment's queries against its prefix's and, causally, its own keys; [1, H, N, D].

    The row is cut with `split`, not sliced: a slice's backward writes a zero tensor of the whole
    row and adds into it (S segments: S x N work per layer), a split's backward is one concatenation.
    A prefix that is itself a segment (a shared prompt) is that segment's piece."""
    import torch
    import torch.nn.functional as F

    segments = _segments(bounds)
    sizes = [end - start for _, _, start, end in segments]
    if sum(sizes) != query.shape[2]:
        raise ValueError(f"cu_seq_lens cover {sum(sizes)} positions, the packed row has {query.shape[2]}")
    pieces = {start: index for index, (_, _, start, _) in enumerate(segments)}
    queries, keys, values = (t.split(sizes, dim=2) for t in (query, key, value))
    outputs = []
    for index, (prefix_start, prefix_end, start, end) in enumerate(segments):
        if prefix_start == prefix_end:
            outputs.append(
                F.scaled_dot_product_attention(
                    queries[index],
                    keys[index],
                    values[index],
                    is_causal=True,
                    scale=scaling,
                    dropout_p=dropout,
                )
            )
            continue
        shared = pieces.get(prefix_start)
        if shared is not None and segments[shared][3] == prefix_end:
            prefix_keys, prefix_values = keys[shared], values[shared]
        else:  # a prefix that is not one segment: sliced from the row
            prefix_keys = key[:, :, prefix_start:prefix_end]
            prefix_values = value[:, :, prefix_start:prefix_end]
        allowed = _prefix_mask(bounds, end - start, prefix_end - prefix_start, query.device)
        outputs.append(
            F.scaled_dot_product_attention(
                queries[index],
                torch.cat([prefix_keys, keys[index]], dim=2),
                torch.cat([prefix_values, values[index]], dim=2),
                attn_mask=allowed,
                scale=scaling,
                dropout_p=dropout,
            )
        )
    return torch.cat(outputs, dim=2)


def _prefix_mask(bounds, length: int, prefix: int, device):
    """`_causal_after_prefix(length, prefix + length)`, built once per row for all the layers (kept
    on the SharedSegments; a plain tuple has nowhere to keep it)."""
    masks = getattr(bounds, "__dict__", {})
    key = (length, prefix, str(device))
    if key not in masks:
        masks[key] = _causal_after_prefix(length, prefix + length, device)
    return masks[key]


def _causal_after_prefix(q_len: int, k_len: int, device):
    """[q_len, k_len] boolean mask: the queries are the last q_len of k_len positions, each sees
    every key before it and itself (causal aligned bottom right)."""
    import torch

    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def register() -> str:
    """Make `parity_varlen` known to transformers (idempotent); returns its name."""
    global _REGISTERED
    if not _REGISTERED:
        import torch
        from transformers import AttentionInterface

        # Eager under torch.compile (trainer/compiled.py): its loop over the segments would
        # otherwise be traced, and every new segment layout would be a recompile.
        AttentionInterface.register(ATTENTION, torch.compiler.disable(varlen_attention))
        _REGISTERED = True
    return ATTENTION


def is_packed(model) -> bool:
    """Whether `model` (an HF model) runs the packed attention."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION


def shares_prompts(model) -> bool:
    """Whether `model`'s packed micro-batches write a shared prompt once (policy.load_model)."""
    return is_packed(model) and bool(getattr(model, "parity_share_prompts", False))


def _shared(sequences: Sequence[Any]) -> bool:
    """Whether two of `sequences` have the same prompt (so sharing saves tokens)."""
    prompts = [s.prompt_ids for s in sequences]
    return len(set(prompts)) < len(prompts)


def scored_length(prompt_len: int, completion_len: int) -> int:
    """Tokens a sequence puts through the model: prompt + completion minus the last token."""
    return prompt_len + completion_len - 1


def pack_batch(sequences: Sequence[Any], share_prompts: bool = False):
    """One packed micro-batch of SequenceInputs: host tensors input_ids [1, N], position_ids [1, N],
    the bounds tuple cu_seq_lens (S+1 ints), and rows [T], cols [T], targets [T]; rows/cols index the
    hidden state that predicts each completion token (rows are all 0).

    Sequences of one length need no packing to avoid padding: they come as S rows of [S, L] and
    cu_seq_lens None (plain causal attention per row, one batched SDPA instead of S calls).
    `share_prompts` and two sequences with one prompt: the row writes each prompt once and the
    bounds are SharedSegments (module docstring)."""

    if any(len(s.prompt_ids) == 0 or len(s.completion_ids) == 0 for s in sequences):
        raise ValueError("every sequence needs a non-empty prompt and completion")
    if share_prompts and _shared(sequences):
        return _pack_shared(sequences)
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
    return _one_row(ids, positions, tuple(bounds), cols, targets)


def _one_row(ids: list[int], positions: list[int], bounds, cols: list[int], targets: list[int]):
    """pack_batch's host tensors for one packed row (every hidden-state row index is 0)."""
    import torch

    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return (
        as_long(ids).unsqueeze(0),
        as_long(positions).unsqueeze(0),
        bounds,
        torch.zeros(len(cols), dtype=torch.long),
        as_long(cols),
        as_long(targets),
    )


def _pack_shared(sequences: Sequence[Any]):

    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, seq in enumerate(sequences):
        by_prompt.setdefault(tuple(seq.prompt_ids), []).append(index)
    ids: list[int] = []
    positions: list[int] = []
    segments: list[tuple[int, int, int, int]] = []
    first_col: dict[int, int] = {}  # sequence index -> the row position that predicts completion[0]
    next_col: dict[int, int] = {}  # sequence index -> where its continuation c_i starts in the row
    for prompt, members in by_prompt.items():
        prompt_start = len(ids)
        if len(members) == 1:  # alone: one plain segment, as without sharing
            seq = sequences[members[0]]
            length = scored_length(len(prompt), len(seq.completion_ids))
            ids.extend((tuple(prompt) + tuple(seq.completion_ids))[:length])
            positions.extend(range(length))
            segments.append((prompt_start, prompt_start, prompt_start, len(ids)))
            first_col[members[0]] = prompt_start + len(prompt) - 1
            next_col[members[0]] = prompt_start + len(prompt)
            continue
        ids.extend(prompt)
        positions.extend(range(len(prompt)))
        prompt_end = len(ids)
        segments.append((prompt_start, prompt_start, prompt_start, prompt_end))
        for index in members:
            continuation = tuple(sequences[index].completion_ids)[:-1]
            first_col[index] = prompt_end - 1
            next_col[index] = len(ids)
            if continuation:  # a one-token completion needs only the prompt's last position
                ids.extend(continuation)
                positions.extend(range(len(prompt), len(prompt) + len(continuation)))
                segments.append((prompt_start, prompt_end, next_col[index], len(ids)))
    cols: list[int] = []
    targets: list[int] = []
    for index, seq in enumerate(sequences):
        cols.append(first_col[index])
        cols.extend(range(next_col[index], next_col[index] + len(seq.completion_ids) - 1))
        targets.extend(seq.completion_ids)
    return _one_row(ids, positions, SharedSegments(segments), cols, targets)


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


def packed_tokens(sequences: Sequence[Any], share_prompts: bool = False) -> int:
    """N of the packed row (what its forward costs; no padding); with `share_prompts`, each distinct
    prompt counts once."""
    total = sum(scored_length(len(s.prompt_ids), len(s.completion_ids)) for s in sequences)
    if share_prompts and _shared(sequences):
        total -= sum(len(s.prompt_ids) for s in sequences)
        total += sum(len(prompt) for prompt in {tuple(s.prompt_ids) for s in sequences})
    return total


def pack_micro_batches(
    items: Sequence[Any], key, max_sequences: int, max_tokens: int, share_prompts: bool = False
) -> list[list[Any]]:
    """Split into micro-batches of at most `max_sequences` sequences and at most `max_tokens` packed
    tokens when `max_tokens` > 0 (a longer single sequence goes alone). Longest first, each into
    the first micro-batch with room (first-fit decreasing: few, full micro-batches).

    `share_prompts`: a sequence first goes to a micro-batch that already holds its prompt, where it
    costs only its continuation; so a group's samples stay together, and the budget counts what the
    shared row really holds."""
    length = lambda item: scored_length(len(key(item).prompt_ids), len(key(item).completion_ids))  # noqa: E731
    if max_tokens <= 0 and not share_prompts:
        return [list(items[i : i + max_sequences]) for i in range(0, len(items), max_sequences)]
    budget = max_tokens if max_tokens > 0 else float("inf")
    batches: list[list[Any]] = []
    loads: list[int] = []
    prompts: list[set[tuple[int, ...]]] = []
    order = sorted(items, key=length, reverse=True)
    if share_prompts:  # group by group (the group with the longest sequence first): siblings arrive together
        groups: dict[tuple[int, ...], list[Any]] = {}
        for item in order:
            groups.setdefault(tuple(key(item).prompt_ids), []).append(item)
        order = [item for group in groups.values() for item in group]
    for item in order:
        prompt = tuple(key(item).prompt_ids)
        full = length(item)
        shared = full - len(prompt)
        candidates = range(len(batches))
        if share_prompts:  # micro-batches that hold this prompt first, then the rest in order
            candidates = sorted(candidates, key=lambda index: prompt not in prompts[index])
        for index in candidates:
            size = shared if share_prompts and prompt in prompts[index] else full
            if len(batches[index]) < max_sequences and loads[index] + size <= budget:
                batches[index].append(item)
                loads[index] += size
                prompts[index].add(prompt)
                break
        else:
            batches.append([item])
            loads.append(full)
            prompts.append({prompt})
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
