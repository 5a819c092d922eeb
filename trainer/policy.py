"""The policy: an HF causal LM whose lm_head runs in float32, scored under each rollout's transform.

Invariants:
- Logits are computed only at the scored completion positions, in float32 whatever the parameter
  dtype (a bf16 head is a known source of train-inference mismatch), from the head weight as the
  engine holds it: float32 in fp32 mode, its bf16 copy in bf16 mode (parity/head_logits.py), chunk
  by chunk (trainer/head.py): no [T, V] logits are kept for backward.
- Each sequence's logprobs come from `parity.sampling.processed_logprobs` under *its own* recorded
  transform (temperature, then top-k/top-p mask, renormalised) — the distribution vLLM sampled from
  with `logprobs_mode=processed_logprobs` — so they are directly comparable with rollout logprobs.
- Entropy is of that same processed distribution, computed without gradient.
- Padded mode: sequences are right-padded; position ids are 0..L-1 per row, as in generation.
  Packed mode (model loaded with `packing=True`, trainer/packing.py): one row of back-to-back
  sequences, position ids restarting at 0 for each, attention confined to each sequence; no pad.
- The batch is built on the host and crosses to the model's device once per micro-batch (pinned on
  CUDA); every tensor returned lives on that device.
- The forward runs through `CompletionScorer`, one module holding the HF model: it is what FSDP2
  shards (its forward hooks unshard the embeddings and head), and the place where the
  decoder may run in bf16 while the head and log-softmax stay float32 (trainer/precision.py).

Shapes: B sequences, L padded length, H hidden, V vocab, T completion tokens of the micro-batch.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.head_logits import float32_logits
from parity.models import quiet_loading
from parity.sampling import SamplingTransform
from trainer import precision as numerics
from trainer.device import to_device
from trainer.head import HeadOptions, TokenGroup, score_tokens

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SequenceInput:
    """One rollout to score: prompt + completion, and the transform that sampled the completion."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    transform: SamplingTransform


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: Any = "cpu",
    packing: bool = False,
    share_prompts: bool = True,
):
    """AutoModelForCausalLM from a local directory (no hub), on `device`, in train mode without dropout.
    `packing`: attention over packed sequences (trainer/packing.py) instead of padded SDPA; with
    `share_prompts`, a micro-batch writes each prompt once (trainer/packing.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer import packing as packed

    attention = packed.register() if packing else "sdpa"
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, dtype), attn_implementation=attention
        )
    model.config.use_cache = False
    model.parity_share_prompts = packing and share_prompts
    model.to(device)
    model.train()
    return model


def head_weight(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = model.get_output_embeddings()
    return head.weight, getattr(head, "bias", None)


def head_logits(lm, hidden_TH: torch.Tensor, precision: str) -> torch.Tensor:
    """float32 logits [T, V] of the decoder's last hidden states [T, H], as the trainer scores them:
    autocast off, the head weight (and bias) rounded to the precision's head dtype, float32
    products. Not the HF model's own head: under a bf16 decoder it would multiply a bf16 hidden
    state by the float32 weight."""
    with numerics.fp32_region(hidden_TH.device):
        weight_VH, bias_V = head_weight(lm)
        weight_dtype = numerics.head_weight_dtype(precision)
        bias = None if bias_V is None else bias_V.to(weight_dtype)
        return float32_logits(hidden_TH, weight_VH.to(weight_dtype), bias)


def _scorer_base():
    import torch

    class CompletionScorer(torch.nn.Module):
        """The HF model + how it is scored: decoder (maybe bf16), then a float32 head at the
        completion positions only. `lm` is the HF model (its parameter names are the checkpoint's)."""

        def __init__(
            self, lm, precision: str = "fp32", sharded: bool = False, head: HeadOptions | None = None
        ) -> None:
            super().__init__()
            self.lm = lm
            self.precision = precision
            self.sharded = sharded
            self.head = head or HeadOptions()
            if precision == "bf16" and not sharded:  # sharded: FSDP2's MixedPrecisionPolicy casts
                numerics.bf16_decoder(lm)
            lm.__dict__[_SCORER_ATTR] = weakref.ref(self)  # scorer_for(lm) finds this scorer again

        def forward(
            self,
            input_ids_BL,
            mask_BL,
            rows_T,
            cols_T,
            position_ids_BL=None,
            cu_seq_lens=None,
            scoring: HeadScoring | None = None,
        ):
            """Padded: `mask_BL`. Packed: no mask, `position_ids_BL` and `cu_seq_lens` (host).
            Without `scoring`: float32 logits [T, V]. With it: (logprob [T], entropy [T]) of its
            targets, scored in chunks by trainer/head.py (no [T, V] kept for backward)."""
            device = input_ids_BL.device
            decoder = getattr(self.lm, self.lm.base_model_prefix)
            packed = (
                {} if cu_seq_lens is None else {"position_ids": position_ids_BL, "cu_seq_lens": cu_seq_lens}
            )
            hidden_BLH = decoder(input_ids=input_ids_BL, attention_mask=mask_BL, **packed).last_hidden_state
            hidden_TH = hidden_BLH[rows_T, cols_T]
            if scoring is None:
                return head_logits(self.lm, hidden_TH, self.precision)
            with numerics.fp32_region(device):
                weight_VH, bias_V = head_weight(self.lm)
                return score_tokens(
                    hidden_TH,
                    weight_VH,
                    bias_V,
                    scoring.targets_T,
                    scoring.groups,
                    scoring.with_entropy,
                    self.head,
                    numerics.head_weight_dtype(self.precision),
                )

    return CompletionScorer


_SCORER_CLASS = None
_SCORER_ATTR = "_parity_scorer"


def scorer_for(
    model, precision: str | None = None, sharded: bool | None = None, head: HeadOptions | None = None
):
    """The CompletionScorer of `model`: itself when it is one; for an HF model, the scorer that
    already wraps it, if any, else a new one (defaults: fp32, unsharded, default head options).

    A model is scored one way: a bf16 scorer changes its model's decoder for good, and the trainer's
    scorer may be sharded, so a second scorer of the same model would compute something else (a
    bf16 decoder under a float32 head weight, or unsharded parameters). An argument given that
    contradicts the existing scorer is a ValueError naming it."""
    global _SCORER_CLASS
    if _SCORER_CLASS is None:
        _SCORER_CLASS = _scorer_base()
    if isinstance(model, _SCORER_CLASS):
        existing = model
    else:
        ref = model.__dict__.get(_SCORER_ATTR)
        existing = ref() if ref is not None else None
        if existing is not None and existing.lm is not model:  # a copy of a wrapped model
            existing = None
    if existing is None:
        return _SCORER_CLASS(model, precision or "fp32", bool(sharded), head)
    for name, wanted, held in (
        ("precision", precision, existing.precision),
        ("sharded", sharded, existing.sharded),
        ("head", head, existing.head),
    ):
        if wanted is not None and wanted != held:
            raise ValueError(
                f"{name}: this model is already scored with {name}={held!r}, not {wanted!r}; "
                "pass its scorer, or load the model again"
            )
    return existing


def pad_batch(sequences: Sequence[SequenceInput]):
    """Host tensors of one micro-batch: (input_ids [B, L], mask [B, L], rows [T], cols [T], targets [T])."""
    import torch

    if any(len(s.prompt_ids) == 0 or len(s.completion_ids) == 0 for s in sequences):
        raise ValueError("every sequence needs a non-empty prompt and completion")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in sequences]
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
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return input_ids_BL, mask_BL, as_long(rows), as_long(cols), as_long(targets)


def padded_tokens(sequences: Sequence[SequenceInput]) -> int:
    """B x L of the micro-batch `pad_batch` builds (what its forward costs)."""
    return len(sequences) * max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in sequences)


def token_budget_batches(
    sequences: Sequence[Any],
    key,
    max_sequences: int,
    max_tokens: int = 0,
    packed: bool = False,
    share_prompts: bool = False,
) -> list[list[Any]]:
    """Split into micro-batches of at most `max_sequences` sequences and, when `max_tokens` > 0, at
    most `max_tokens` tokens through the model (a longer single sequence goes alone); `key(item)`
    gives an item's SequenceInput. Padded (`packed=False`): the budget counts B x L padded tokens,
    and sequences are grouped by length (stable sort) so that each micro-batch pads little.
    Packed: the budget counts real tokens (trainer/packing.pack_micro_batches), a shared prompt once
    with `share_prompts`."""
    if packed:
        from trainer.packing import pack_micro_batches

        return pack_micro_batches(sequences, key, max_sequences, max_tokens, share_prompts)
    if max_tokens <= 0:
        return [list(sequences[i : i + max_sequences]) for i in range(0, len(sequences), max_sequences)]
    length = lambda item: len(key(item).prompt_ids) + len(key(item).completion_ids) - 1  # noqa: E731
    batches: list[list[Any]] = []
    current: list[Any] = []
    longest = 0
    for item in sorted(sequences, key=length):
        grown = max(longest, length(item))
        if current and (len(current) >= max_sequences or grown * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, grown = [], length(item)
        current.append(item)
        longest = grown
    if current:
        batches.append(current)
    return batches


def token_logprobs(
    model, sequences: Sequence[SequenceInput], with_entropy: bool = True, keep: Sequence[bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of every completion token [T], entropy at each of those positions [T]), on the
    model's device.

    `model` is an HF causal LM or its CompletionScorer. Tokens are in sequence order, then position
    order. Gradient flows into the logprobs when the caller has grad enabled; entropy never carries
    gradient. `keep` (one flag per completion token): only those tokens are scored and returned (an
    episode's model tokens; its environment tokens are context, never scored).
    """
    from trainer import packing

    scorer = scorer_for(model)
    device = next(scorer.parameters()).device
    if packing.is_packed(scorer.lm):
        ids_1N, positions_1N, bounds, rows_T, cols_T, targets_T = packing.to_tensors(
            packing.pack_batch(sequences, packing.shares_prompts(scorer.lm)), device
        )
        model_inputs = (ids_1N, None)
        packed = {"position_ids_BL": positions_1N, "cu_seq_lens": bounds}
    else:
        input_ids_BL, mask_BL, rows_T, cols_T, targets_T = (
            to_device(t, device) for t in pad_batch(sequences)
        )
        model_inputs = (input_ids_BL, mask_BL)
        packed = {}
    transforms = [seq.transform for seq in sequences for _ in seq.completion_ids]
    if keep is not None:
        # Kept positions as an index built on the host: a boolean mask on the device would make
        # the host wait for the GPU (nonzero) once per micro-batch.
        if len(keep) != len(transforms):
            raise ValueError(f"keep has {len(keep)} flags for {len(transforms)} completion tokens")
        kept = [position for position, flag in enumerate(keep) if flag]
        if len(kept) != len(transforms):
            index_T = to_device(torch_long(kept), device)
            rows_T, cols_T, targets_T = rows_T[index_T], cols_T[index_T], targets_T[index_T]
            transforms = [transforms[position] for position in kept]
    scoring = HeadScoring(targets_T, _token_groups(transforms, device), with_entropy)
    return scorer(*model_inputs, rows_T, cols_T, **packed, scoring=scoring)


def torch_long(values: Sequence[int]):
    import torch

    return torch.tensor(list(values), dtype=torch.long)


@dataclass(frozen=True)
class HeadScoring:
    """What the scorer's head scores: the target of each token, the tokens of each transform."""

    targets_T: torch.Tensor
    groups: tuple[TokenGroup, ...]
    with_entropy: bool


def _token_groups(transforms: Sequence[SamplingTransform], device) -> tuple[TokenGroup, ...]:
    """One group per distinct transform (usually one per micro-batch: no index, no gather)."""
    import torch

    if len(set(transforms)) <= 1:
        return (TokenGroup(transforms[0] if transforms else SamplingTransform(), None),)
    positions: dict[SamplingTransform, list[int]] = defaultdict(list)
    for position, transform in enumerate(transforms):
        positions[transform].append(position)
    return tuple(
        TokenGroup(transform, to_device(torch.tensor(index, dtype=torch.long), device))
        for transform, index in positions.items()
    )
