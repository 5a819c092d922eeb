"""Packed micro-batches (trainer/packing.py) score and train exactly like unpacked ones.

- The decoder's hidden states of a packed row (and of rows of one length) equal each sequence run
  alone within 1e-10 in float64; the float32 logprobs equal each sequence scored alone and the
  padded batch's up to float32 rounding (a few ulps), under several sampling transforms (top-k/top-p
  masks give the same -inf pattern).
- The gradients of a packed micro-batch equal the padded micro-batch's.
- The token budget counts real tokens when packing: every sequence once, no micro-batch over budget
  unless a single sequence is, and no padding at all.
- A trainer step with `packing=true` gives the loss and weights of one with `packing=false`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from parity.sampling import SamplingTransform
from tests.conftest import config_for
from trainer.policy import SequenceInput, load_model, token_logprobs

# (prompt length, completion length): a one-token prompt, a one-token completion, long and short.
SHAPES = [(6, 5), (3, 20), (10, 1), (1, 40), (7, 7), (16, 64), (30, 33)]
TRANSFORMS = [SamplingTransform(1.0, 0, 1.0), SamplingTransform(0.7, 20, 0.9), SamplingTransform(1.3, 0, 0.8)]


def _sequences(vocab: int = 259, seed: int = 0) -> list[SequenceInput]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt_len, completion_len) in enumerate(SHAPES):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        completion = torch.randint(3, vocab, (completion_len,), generator=gen).tolist()
        out.append(SequenceInput(tuple(prompt), tuple(completion), TRANSFORMS[i % len(TRANSFORMS)]))
    return out


def _finite_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), "the masks differ"
    finite = torch.isfinite(a)
    return float((a[finite] - b[finite]).abs().max())


# float32 adds the rounding of GEMMs of another shape ([N, H] for the row vs [L, H] per sequence): a
# few ulps of logprobs up to ~10 in magnitude (ulp 9.5e-7). Measured here: packed vs alone 9.5e-7,
# packed vs padded 3.8e-6 (the padded batch is itself 3.8e-6 from alone). Exactness is shown in
# float64 below, on the decoder's hidden states (the head and logprobs are float32 by design).
def test_packed_logprobs_equal_each_sequence_alone(tiny_model: Path) -> None:
    padded_model = load_model(tiny_model)
    packed_model = load_model(tiny_model, packing=True)
    sequences = _sequences()
    with torch.no_grad():
        packed, packed_entropy = token_logprobs(packed_model, sequences)
        padded, padded_entropy = token_logprobs(padded_model, sequences)
        alone = torch.cat([token_logprobs(padded_model, [s])[0] for s in sequences])
    assert packed.numel() == sum(n for _, n in SHAPES)
    assert (~torch.isfinite(alone)).any()  # the top-k/top-p masks exclude some sampled tokens
    vs_alone, vs_padded = _finite_diff(packed, alone), _finite_diff(packed, padded)
    print(f"float32: packed vs alone {vs_alone:.2e}, vs padded {vs_padded:.2e}, "
          f"padded vs alone {_finite_diff(padded, alone):.2e}")  # fmt: skip
    assert vs_alone <= 2e-6 and vs_padded <= 1e-5
    assert float((packed_entropy - padded_entropy).abs().max()) <= 1e-5


def _hidden_alone(model, seq: SequenceInput) -> torch.Tensor:
    from trainer.packing import scored_length

    ids = torch.tensor(
        [
            list(
                (seq.prompt_ids + seq.completion_ids)[
                    : scored_length(len(seq.prompt_ids), len(seq.completion_ids))
                ]
            )
        ]
    )
    return model.model(input_ids=ids).last_hidden_state[0]


@pytest.mark.parametrize("one_length", [False, True])
def test_packed_hidden_states_equal_each_sequence_alone_in_float64(
    tiny_model: Path, one_length: bool
) -> None:
    from trainer.packing import pack_batch

    gen = torch.Generator().manual_seed(2)
    if one_length:  # same scored length (20), different prompt/completion splits: the [S, L] rows
        sequences = [
            SequenceInput(
                tuple(torch.randint(3, 259, (p,), generator=gen).tolist()),
                tuple(torch.randint(3, 259, (21 - p,), generator=gen).tolist()),
                TRANSFORMS[0],
            )
            for p in (1, 4, 9, 15)
        ]
    else:
        sequences = _sequences()
    packed_model = load_model(tiny_model, "float64", packing=True)
    plain_model = load_model(tiny_model, "float64")
    input_ids, positions, bounds, _, _, _ = pack_batch(sequences)
    assert (bounds is None) == one_length
    with torch.no_grad():
        extra = {} if bounds is None else {"position_ids": positions, "cu_seq_lens": bounds}
        hidden = packed_model.model(input_ids=input_ids, **extra).last_hidden_state.reshape(-1, 128)
        alone = torch.cat([_hidden_alone(plain_model, s) for s in sequences])
    assert hidden.dtype == torch.float64 and hidden.shape == alone.shape
    worst = float((hidden - alone).abs().max())
    print(
        f"float64 hidden states, {'rows of one length' if one_length else 'one packed row'}: max |Δ| {worst:.1e}"
    )
    assert worst <= 1e-10


def test_packed_and_padded_micro_batches_give_the_same_gradients(tiny_model: Path) -> None:
    sequences = _sequences(seed=1)
    grads = {}
    for packing in (False, True):
        model = load_model(tiny_model, "float64", packing=packing)
        logprobs, _ = token_logprobs(model, sequences)
        finite = torch.isfinite(logprobs)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=torch.float64)
        (logprobs[finite] * weights[finite]).sum().backward()
        grads[packing] = {name: p.grad.clone() for name, p in model.named_parameters()}
    worst = max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[True])
    scale = max(float(g.abs().max()) for g in grads[False].values())
    print(f"float64 gradients: max |Δ| {worst:.2e} (largest gradient {scale:.2e})")
    assert scale > 1e-3 and worst <= 1e-10 * scale


def test_the_token_budget_counts_real_tokens_when_packing() -> None:
    from trainer.packing import pack_batch, packed_tokens
    from trainer.policy import token_budget_batches

    sequences = _sequences() * 2
    batches = token_budget_batches(sequences, lambda s: s, max_sequences=4, max_tokens=64, packed=True)
    assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in sequences)
    for batch in batches:
        assert len(batch) <= 4
        assert len(batch) == 1 or packed_tokens(batch) <= 64
        input_ids, positions, bounds, rows, _cols, targets = pack_batch(batch)
        assert input_ids.numel() == packed_tokens(batch)  # no pad token anywhere
        if bounds is None:  # one length: rows of [S, L], each from position 0
            assert input_ids.shape[0] == len(batch)
            assert all(row.tolist() == list(range(input_ids.shape[1])) for row in positions)
        else:
            assert input_ids.shape[0] == 1 and bounds[0] == 0 and bounds[-1] == input_ids.shape[1]
            for start, end in itertools.pairwise(bounds):
                assert positions[0, start:end].tolist() == list(range(end - start))
        assert targets.numel() == rows.numel() == sum(len(s.completion_ids) for s in batch)
    unbounded = token_budget_batches(sequences, lambda s: s, max_sequences=4, packed=True)
    assert [len(b) for b in unbounded] == [4, 4, 4, 2]
    same = [SequenceInput((5, 6), (7, 8, 9), TRANSFORMS[0]), SequenceInput((1, 2), (3, 4, 5), TRANSFORMS[1])]
    assert pack_batch(same)[0].tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]


def test_a_packed_trainer_step_matches_a_padded_one(tmp_path: Path, tiny_model: Path) -> None:
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.loop import Trainer
    from trainer.prepare import prepare
    from trainer.step import split_micro_batches

    results = {}
    for packing in (False, True):
        trainer = Trainer(
            config_for(
                "trainer", model="tiny", device="cpu", run_dir=str(tmp_path / str(packing)), lr=1e-3,
                micro_batch_size=3, micro_batch_tokens=80, packing=str(packing).lower(),
            )
        )  # fmt: skip
        trainer.setup_model()
        gen = torch.Generator().manual_seed(5)
        groups = [
            make_group(trainer.model, f"g{g}", (1.0, 0.0, 0.0, 1.0), generator=gen, sample=False,
                       completion_len=5 + 7 * g)
            for g in range(3)
        ]  # fmt: skip
        sequences = prepare(Batch(groups=groups), trainer.config).sequences
        stats, result = trainer.update(sequences)
        assert result.stepped
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        chunks = split_micro_batches(sequences, trainer.config, trainer.device, distributed=False)
        results[packing] = (stats.loss, result.grad_norm, weights, len(chunks))
    (loss_pad, norm_pad, w_pad, chunks_pad), (loss_pack, norm_pack, w_pack, chunks_pack) = (
        results[False],
        results[True],
    )
    print(f"loss padded {loss_pad!r} packed {loss_pack!r}; micro-batches {chunks_pad} vs {chunks_pack}")
    assert abs(loss_pad - loss_pack) <= 1e-6
    assert abs(norm_pad - norm_pack) <= 1e-5 * norm_pad
    moved = max(float((w_pack[n] - w_pad[n]).abs().max()) for n in w_pad)
    assert moved <= 2e-3  # AdamW's first step: lr * g / (|g| + eps), eps-sized gradients aside
    close = sum(int(((w_pack[n] - w_pad[n]).abs() <= 1e-6).sum()) for n in w_pad)
    assert close >= 0.95 * sum(w.numel() for w in w_pad.values())


# --- shared prompts (trainer.share_prompts) -------------------------------------------------------
def _groups(seed: int = 3, vocab: int = 259) -> list[SequenceInput]:
    """Two GRPO-like groups (one prompt, completions of several lengths, a one-token one among them),
    one sequence alone, and the groups' samples interleaved as a trainer batch may hold them."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())  # noqa: E731
    first, second, alone = rand(12), rand(5), rand(9)
    sequences = []
    for i, length in enumerate((7, 1, 15, 7)):
        sequences.append(SequenceInput(first, rand(length), TRANSFORMS[i % 3]))
        sequences.append(SequenceInput(second, rand(length + 2), TRANSFORMS[(i + 1) % 3]))
    sequences.insert(3, SequenceInput(alone, rand(6), TRANSFORMS[0]))
    return sequences


def test_shared_prompts_give_each_sequence_alone_hidden_states_in_float64(tiny_model: Path) -> None:
    from trainer.packing import SharedSegments, pack_batch, packed_tokens

    sequences = _groups()
    shared_model = load_model(tiny_model, "float64", packing=True, share_prompts=True)
    plain_model = load_model(tiny_model, "float64")
    input_ids, positions, bounds, _, cols, _ = pack_batch(sequences, share_prompts=True)
    assert isinstance(bounds, SharedSegments)
    # each prompt once (the groups' 12 and 5 tokens, three copies of each saved), then every continuation
    assert input_ids.numel() == packed_tokens(sequences, share_prompts=True)
    assert input_ids.numel() == packed_tokens(sequences) - 3 * 12 - 3 * 5
    with torch.no_grad():
        hidden = shared_model.model(input_ids=input_ids, position_ids=positions, cu_seq_lens=bounds)
        at_cols = hidden.last_hidden_state[0, cols]  # the states that predict each completion token
        alone = torch.cat([_hidden_alone(plain_model, s)[len(s.prompt_ids) - 1 :] for s in sequences])
    assert at_cols.dtype == torch.float64 and at_cols.shape == alone.shape
    worst = float((at_cols - alone).abs().max())
    print(f"float64 hidden states, shared prompts vs each sequence alone: max |Δ| {worst:.1e}")
    assert worst <= 1e-10


# The head and logprobs are float32 by design: a hidden state that moves by 1e-15 can round its
# float32 logits one ulp the other way. Measured: logprobs 1.9e-6, gradients 1.3e-7 of the largest.
def test_shared_prompts_give_each_sequence_alone_logprobs(tiny_model: Path) -> None:
    sequences = _groups()
    shared_model = load_model(tiny_model, packing=True, share_prompts=True)
    plain_model = load_model(tiny_model)
    with torch.no_grad():
        shared, shared_entropy = token_logprobs(shared_model, sequences)
        alone = [token_logprobs(plain_model, [s]) for s in sequences]
    assert shared.numel() == sum(len(s.completion_ids) for s in sequences)
    worst = _finite_diff(shared, torch.cat([lp for lp, _ in alone]))
    print(f"float32 shared-prompt logprobs vs each alone: max |Δ| {worst:.1e}")
    assert worst <= 1e-5
    assert float((shared_entropy - torch.cat([e for _, e in alone])).abs().max()) <= 1e-5


def test_shared_prompts_give_the_gradients_of_every_copy(tiny_model: Path) -> None:
    sequences = _groups(seed=4)
    grads = {}
    for share in (False, True):
        model = load_model(tiny_model, "float64", packing=True, share_prompts=share)
        logprobs, _ = token_logprobs(model, sequences)
        finite = torch.isfinite(logprobs)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=torch.float64)
        (logprobs[finite] * weights[finite]).sum().backward()
        grads[share] = {name: p.grad.clone() for name, p in model.named_parameters()}
    worst = max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[True])
    scale = max(float(g.abs().max()) for g in grads[False].values())
    print(f"gradients, shared vs copied prompts: max |Δ| {worst:.2e} (largest {scale:.2e})")
    assert scale > 1e-3 and worst <= 1e-6 * scale


def test_micro_batches_keep_a_group_together_and_count_its_prompt_once() -> None:
    from trainer.packing import pack_batch, packed_tokens
    from trainer.policy import token_budget_batches

    sequences = _groups()
    for budget in (0, 60):
        batches = token_budget_batches(
            sequences, lambda s: s, max_sequences=4, max_tokens=budget, packed=True, share_prompts=True
        )
        assert sorted(id(s) for b in batches for s in b) == sorted(id(s) for s in sequences)
        for batch in batches:
            assert len(batch) <= 4
            assert budget == 0 or len(batch) == 1 or packed_tokens(batch, share_prompts=True) <= budget
            assert pack_batch(batch, share_prompts=True)[0].numel() == packed_tokens(
                batch, share_prompts=True
            )
        # a group of four is written in at most two micro-batches of four (its prompt at most twice)
        for prompt in {s.prompt_ids for s in sequences}:
            holding = [b for b in batches if any(s.prompt_ids == prompt for s in b)]
            assert len(holding) <= 2, (budget, [[s.prompt_ids[:2] for s in b] for b in batches])


def _dense_reference(query, key, value, segments):
    """Attention of a packed row through one [N, N] mask built position by position: the
    definition `varlen_attention` must compute, without its segment loop."""
    n = query.shape[2]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for prefix_start, prefix_end, start, end in segments:
        for q in range(start, end):
            allowed[q, prefix_start:prefix_end] = True
            allowed[q, start : q + 1] = True
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=allowed)


@pytest.mark.parametrize("layout", ["plain", "shared", "prefix_inside_a_segment"])
def test_packed_attention_and_its_gradients_equal_one_masked_call(layout: str) -> None:
    from trainer.packing import SharedSegments, varlen_attention

    if layout == "plain":  # bounds of four sequences
        bounds = (0, 5, 6, 17, 30)
        segments = [(s, s, s, e) for s, e in itertools.pairwise(bounds)]
    else:
        # A prompt [0, 6) and two continuations; then a sequence alone [15, 24) and one whose prefix
        # is the first 4 positions of that sequence (not a whole segment: sliced, not split).
        segments = [(0, 0, 0, 6), (0, 6, 6, 11), (0, 6, 11, 15), (15, 15, 15, 24)]
        segments.append((15, 19, 24, 30) if layout == "prefix_inside_a_segment" else (0, 6, 24, 30))
        bounds = SharedSegments(segments)
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 3, 30, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    weights = torch.linspace(-1.0, 1.0, 30 * 3 * 8, dtype=torch.float64).view(1, 3, 30, 8)
    outputs, grads = {}, {}
    for name in ("segments", "dense"):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        if name == "segments":
            out = varlen_attention(None, q, k, v, None, cu_seq_lens=bounds)[0].transpose(1, 2)
        else:
            out = _dense_reference(q, k, v, segments)
        (out * weights).sum().backward()
        outputs[name] = out.detach()
        grads[name] = [t.grad for t in (q, k, v)]
    assert float((outputs["segments"] - outputs["dense"]).abs().max()) <= 1e-12
    for got, want in zip(grads["segments"], grads["dense"], strict=True):
        assert float(want.abs().max()) > 1e-3
        assert float((got - want).abs().max()) <= 1e-12


def test_packed_attention_refuses_bounds_that_do_not_cover_the_row() -> None:
    from trainer.packing import varlen_attention

    q = torch.randn(1, 2, 10, 4)
    with pytest.raises(ValueError, match="cover 9 positions, the packed row has 10"):
        varlen_attention(None, q, q, q, None, cu_seq_lens=(0, 4, 9))
