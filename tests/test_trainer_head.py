"""The chunked float32 head (trainer/head.py) against scoring the whole [T, V] at once with autograd.

- one transform, one chunk: bit for bit the unchunked reference's logprobs;
- mixed transforms (greedy, temperature, top-k, top-p), a keep mask (episode environment tokens)
  and any chunk size: logprobs within 5e-6 and entropies within 1e-5. The float32 head GEMM's
  rounding depends on how many rows it multiplies at once; today's path itself moves a logprob by up
  to 3.8e-6 when a sequence is scored alone instead of in a batch (tiny model, measured);
- float32 gradients of every parameter equal autograd's through the unchunked path (rtol 1e-4);
- bfloat16 backward GEMMs: the same logprobs, gradients in the same direction (cosine > 0.999);
- the packed and padded models give the same logprobs through the new head;
- bf16 mode: the logits of the bf16 copy of the head weight (what a bf16 engine multiplies by),
  and float32 gradients equal to autograd's through that rounding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.sampling import SamplingTransform, processed_logprobs
from trainer.head import HeadOptions
from trainer.policy import SequenceInput, load_model, pad_batch, scorer_for, token_logprobs

TRANSFORMS = (
    SamplingTransform(temperature=1.0),
    SamplingTransform(temperature=0.7),
    SamplingTransform(temperature=1.0, top_k=5),
    SamplingTransform(temperature=0.9, top_p=0.8),
    SamplingTransform(temperature=0.0),  # greedy
)


def _sequences(model, transforms=TRANSFORMS) -> list[SequenceInput]:
    """One sequence per transform, its completion sampled from that transform's processed
    distribution (so no sampled token is masked, as in a real rollout)."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    sequences = []
    with torch.no_grad():
        for index, transform in enumerate(transforms):
            ids = torch.randint(0, vocab, (3 + index,), generator=generator).tolist()
            prompt_len = len(ids)
            for _ in range(5 + 2 * index):
                logits_V = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                probs_V = processed_logprobs(logits_V.unsqueeze(0), transform)[0].exp()
                ids.append(int(torch.multinomial(probs_V, 1, generator=generator)))
            sequences.append(SequenceInput(tuple(ids[:prompt_len]), tuple(ids[prompt_len:]), transform))
    return sequences


def _reference(model, sequences, keep=None):
    """Today's definition: the whole [T, V] float32 logits, processed per transform, gathered."""
    ids_BL, mask_BL, rows_T, cols_T, targets_T = pad_batch(sequences)
    logits_TV = scorer_for(model)(ids_BL, mask_BL, rows_T, cols_T)
    return _processed(logits_TV, sequences, targets_T, keep)


def _processed(logits_TV, sequences, targets_T, keep=None):
    """Each sequence's [t, V] logits processed under its transform, its targets' logprobs gathered."""
    values, entropies, offset = [], [], 0
    for seq in sequences:
        count = len(seq.completion_ids)
        lp_tV = processed_logprobs(logits_TV[offset : offset + count], seq.transform)
        values.append(lp_tV.gather(-1, targets_T[offset : offset + count].unsqueeze(-1)).squeeze(-1))
        with torch.no_grad():
            p = lp_tV.exp()
            entropies.append(-(p * torch.where(p > 0, lp_tV, torch.zeros_like(lp_tV))).sum(-1))
        offset += count
    lp_T, entropy_T = torch.cat(values), torch.cat(entropies)
    if keep is not None:
        keep_T = torch.tensor(keep)
        lp_T, entropy_T = lp_T[keep_T], entropy_T[keep_T]
    return lp_T, entropy_T


def _model(tiny_model: Path, chunk_tokens: int, grad_dtype: str = "float32", packing: bool = False):
    model = load_model(tiny_model, packing=packing)
    return scorer_for(model, head=HeadOptions(chunk_tokens=chunk_tokens, grad_dtype=grad_dtype))


@pytest.mark.parametrize("chunk_tokens", [0, 1, 4, 1024])
def test_chunked_logprobs_equal_the_whole_vocabulary_at_once(tiny_model: Path, chunk_tokens: int) -> None:
    scorer = _model(tiny_model, chunk_tokens)
    sequences = _sequences(scorer.lm)
    total = sum(len(s.completion_ids) for s in sequences)
    keep = [index % 3 != 1 for index in range(total)]
    with torch.no_grad():
        for mask in (None, keep):
            ours_T, ours_entropy_T = token_logprobs(scorer, sequences, keep=mask)
            ref_T, ref_entropy_T = _reference(scorer, sequences, keep=mask)
            assert ours_T.shape == ref_T.shape
            assert bool(torch.isfinite(ref_T).all())
            assert float((ours_T - ref_T).abs().max()) <= 5e-6
            assert float((ours_entropy_T - ref_entropy_T).abs().max()) <= 1e-5
            assert float(ours_entropy_T.max()) > 0.1  # the entropies measured something


def test_one_transform_in_one_chunk_is_bit_for_bit_the_reference(tiny_model: Path) -> None:
    scorer = _model(tiny_model, chunk_tokens=1024)
    sequences = _sequences(scorer.lm, transforms=(SamplingTransform(temperature=0.8, top_p=0.9),) * 4)
    with torch.no_grad():
        ours_T, ours_entropy_T = token_logprobs(scorer, sequences)
        ref_T, ref_entropy_T = _reference(scorer, sequences)
    assert torch.equal(ours_T, ref_T) and torch.equal(ours_entropy_T, ref_entropy_T)


def test_packed_rows_score_the_same_tokens(tiny_model: Path) -> None:
    sequences = _sequences(load_model(tiny_model))
    with torch.no_grad():
        padded_T, _ = token_logprobs(_model(tiny_model, 4), sequences)
        packed_T, _ = token_logprobs(_model(tiny_model, 4, packing=True), sequences)
    assert float((padded_T - packed_T).abs().max()) <= 1e-5


def _gradients(scorer, lp_T: torch.Tensor) -> dict[str, torch.Tensor]:
    weights_T = torch.linspace(-1.0, 1.0, lp_T.numel())
    scorer.zero_grad(set_to_none=True)
    (lp_T * weights_T).sum().backward()
    return {name: p.grad.detach().clone() for name, p in scorer.named_parameters() if p.grad is not None}


def test_float32_gradients_equal_autograd_through_the_whole_vocabulary(tiny_model: Path) -> None:
    scorer = _model(tiny_model, chunk_tokens=3)
    sequences = _sequences(scorer.lm)
    total = sum(len(s.completion_ids) for s in sequences)
    keep = [index % 4 != 2 for index in range(total)]
    ours = _gradients(scorer, token_logprobs(scorer, sequences, keep=keep)[0])
    reference = _gradients(scorer, _reference(scorer, sequences, keep=keep)[0])
    assert ours.keys() == reference.keys() and len(ours) > 3
    head = scorer.lm.get_output_embeddings().weight
    head_name = next(name for name, p in scorer.named_parameters() if p is head)
    assert float(reference[head_name].abs().max()) > 0
    for name, grad in reference.items():
        scale = float(grad.abs().max())
        assert float((ours[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_bfloat16_backward_keeps_the_logprobs_and_the_gradient_direction(tiny_model: Path) -> None:
    fp32 = _model(tiny_model, chunk_tokens=8, grad_dtype="float32")
    bf16 = _model(tiny_model, chunk_tokens=8, grad_dtype="bfloat16")
    sequences = _sequences(fp32.lm)
    lp32_T, _ = token_logprobs(fp32, sequences)
    lp16_T, _ = token_logprobs(bf16, sequences)
    assert torch.equal(lp32_T.detach(), lp16_T.detach())  # the logprobs never see grad_dtype
    grads32, grads16 = _gradients(fp32, lp32_T), _gradients(bf16, lp16_T)
    for name, grad in grads32.items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), grads16[name].flatten(), dim=0)
        assert float(cosine) > 0.999, name


def test_bf16_mode_scores_with_the_bf16_head_weight_and_trains_the_float32_one(tiny_model: Path) -> None:
    """A bf16 engine's fp32 head multiplies its bf16 head weight into float32 logits; the bf16
    trainer scores with that same bf16 copy of its float32 master weight, and the float32 gradient
    reaches the master weight through the rounding."""
    scorer = scorer_for(load_model(tiny_model), "bf16", head=HeadOptions(chunk_tokens=3))
    sequences = _sequences(load_model(tiny_model))
    weight = scorer.lm.get_output_embeddings().weight
    assert weight.dtype == torch.float32 and not torch.equal(weight, weight.to(torch.bfloat16).float())
    ids_BL, mask_BL, rows_T, cols_T, targets_T = pad_batch(sequences)
    hidden_TH = scorer.lm.model(input_ids=ids_BL, attention_mask=mask_BL).last_hidden_state[rows_T, cols_T]
    assert hidden_TH.dtype == torch.bfloat16
    # the rounded weight's value, with the gradient passed to the float32 weight unrounded (autograd
    # through `.to(bfloat16)` would round the gradient itself to bf16: ~2e-3 relative)
    rounded_VH = weight + (weight.to(torch.bfloat16).float() - weight).detach()
    rounded_TV = torch.nn.functional.linear(hidden_TH.float(), rounded_VH)
    reference_T, _ = _processed(rounded_TV, sequences, targets_T)
    ours_T, _ = token_logprobs(scorer, sequences)
    assert float((ours_T - reference_T).abs().max()) <= 5e-6  # chunking moves the GEMM's rounding
    with torch.no_grad():
        master_T, _ = _processed(torch.nn.functional.linear(hidden_TH.float(), weight), sequences, targets_T)
    assert float((ours_T - master_T).abs().max()) > 1e-3  # the rounding matters on this model
    ours, reference = _gradients(scorer, ours_T), _gradients(scorer, reference_T)
    assert ours.keys() == reference.keys() and len(ours) > 3
    for name, grad in reference.items():
        assert ours[name].dtype == torch.float32, name
        scale = float(grad.abs().max())
        assert scale > 0 and float((ours[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_the_head_bench_keeps_less_for_backward_and_the_same_logprobs() -> None:
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "bench" / "head_logprobs.py"),
            *("--vocab", "4096", "--hidden", "64", "--tokens", "64"),
            *("--chunk_tokens", "16", "--repeats", "1", "--threads", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["max_abs_logprob_diff"] <= 5e-6
    # whole: the [T, V] log_softmax output and the top-p mask; ours: one [T, V] gradient factor.
    assert summary["saved_ratio"] > 1.5, summary
    assert summary["whole_peak_gib"] is None  # no CUDA: absent, not 0.0
