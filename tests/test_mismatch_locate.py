"""The localiser's stale prefix-cache replay (trainer/mismatch_locate.py) on the tiny model, and the
weight history it needs: an engine whose prefix cache served the prompts' shared system turn from KV
an older version computed, in whole KV blocks (as vLLM's cache does across different prompts), is
named as stale_prefix_kv, with how many prompt tokens were stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from parity.sampling import SamplingTransform, processed_logprobs
from parity.v1 import common_pb2, rollouts_pb2
from tests.fakes.trainer_helpers import make_trainer
from trainer.mismatch_locate import _common_prefix, _in_blocks, locate
from trainer.weight_history import WeightHistory

SYSTEM_LEN, TAIL_LEN, COMPLETION_LEN = 40, 9, 6  # 40 shared tokens: two whole 16-token blocks
TRANSFORM = SamplingTransform(temperature=1.0, top_k=0, top_p=1.0)


def test_shared_prefix_and_whole_blocks() -> None:
    assert _common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert _common_prefix([[7, 8], [7, 8]]) == 2

    class Prompt:
        prompt = list(range(50))

    assert _in_blocks(40, 16)(Prompt) == 32  # the shared 40 tokens hold two whole blocks
    assert _in_blocks(40, 128)(Prompt) == 0  # not one whole CPU block
    assert _in_blocks(500, 16)(Prompt) == 48  # never the prompt's last token


@pytest.fixture(scope="module", params=[False, True], ids=["sdpa", "packed"])
def lm(request: pytest.FixtureRequest, tiny_model: Path):
    """The tiny model with plain SDPA, and with the packed attention the trainer's frozen copy runs."""
    from trainer.policy import load_model

    return load_model(tiny_model, packing=request.param).float().eval()


def test_a_forward_after_a_kv_cache_equals_the_whole_forward(lm) -> None:
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = lm(input_ids=ids[:, :32], use_cache=True).past_key_values
        tail = lm(input_ids=ids[:, 32:], past_key_values=cache).logits[0]
        whole = lm(input_ids=ids).logits[0]
    assert torch.allclose(tail, whole[32:], atol=1e-5), float((tail - whole[32:]).abs().max())


def _history(lm, newest: int = 1) -> WeightHistory:
    """Version 0 = the tiny model; each later version = the one before with every tensor moved by a
    few percent."""
    generator = torch.Generator().manual_seed(0)
    history = WeightHistory(keep=newest + 1)
    weights = [(n, p.detach().clone()) for n, p in lm.named_parameters()]
    history.record(0, weights)
    for version in range(1, newest + 1):
        weights = [(n, t + 0.05 * t.std() * torch.randn(t.shape, generator=generator)) for n, t in weights]
        history.record(version, weights)
    return history


def _load(lm, weights: dict) -> None:
    with torch.no_grad():
        for name, param in lm.named_parameters():
            param.copy_(weights[name])


def _engine_logprobs(lm, history: WeightHistory, prompt: list[int], completion: list[int], cached: int):
    """What an engine reports when the prompt's first `cached` tokens' KV came from version 0 and
    the rest was computed at version 1."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        _load(lm, history.get(0))
        cache = lm(input_ids=ids[:, :cached], use_cache=True).past_key_values
        _load(lm, history.get(1))
        logits = lm(input_ids=ids[:, cached:-1], past_key_values=cache).logits[0].float()
    rows = logits[len(prompt) - 1 - cached :]
    lp = processed_logprobs(rows, TRANSFORM).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)
    return lp.tolist()


def _groups(lm, history: WeightHistory, cached: int) -> list:
    generator = torch.Generator().manual_seed(1)
    vocab = lm.get_output_embeddings().weight.shape[0]
    system = torch.randint(3, vocab, (SYSTEM_LEN,), generator=generator).tolist()
    groups = []
    for g in range(2):
        prompt = system + torch.randint(3, vocab, (TAIL_LEN,), generator=generator).tolist()
        samples = []
        for _ in range(2):
            completion = torch.randint(3, vocab, (COMPLETION_LEN,), generator=generator).tolist()
            samples.append(
                rollouts_pb2.RolloutSample(
                    token_ids=completion,
                    logprobs=_engine_logprobs(lm, history, prompt, completion, cached),
                    token_weight_versions=[1] * COMPLETION_LEN,
                )
            )
        groups.append(
            rollouts_pb2.RolloutGroup(
                group_id=f"g{g}",
                prompt_token_ids=prompt,
                samples=samples,
                sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=COMPLETION_LEN),
                worker_id="worker-0",
            )
        )
    return groups


def test_a_prefix_cache_hit_on_older_kv_in_whole_blocks_is_named_with_its_length(lm) -> None:
    history = _history(lm)
    report = locate(lm, history, _groups(lm, history, cached=32), budget_s=5.0)
    assert report is not None and report.k3 > 0
    top = report.candidates[0]
    assert top.fault == "stale_prefix_kv", report.candidates[:3]
    assert top.score > 0.99, top
    assert "first 32 tokens" in top.evidence and "one version older" in top.evidence, top


def test_candidate_lengths_that_coincide_are_replayed_once(lm, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both groups share their whole 49-token prompt: "all but the last token" and "the shared
    # prefix in 16-token blocks" are both 48 tokens, one replay per sample and version, not two.
    from trainer import mismatch_locate

    history = _history(lm)
    groups = _groups(lm, history, cached=32)
    groups[1].prompt_token_ids[:] = groups[0].prompt_token_ids
    calls: list[tuple] = []
    replay = mismatch_locate._Scorer.stale_prefix_logits

    def counted(self, sample, version: int, stale: int, cached: int):
        calls.append((tuple(sample.prompt), tuple(sample.completion), version, stale, cached))
        return replay(self, sample, version, stale, cached)

    monkeypatch.setattr(mismatch_locate._Scorer, "stale_prefix_logits", counted)
    locate(lm, history, groups, budget_s=5.0)
    replays = [c for c in calls if c[-1] > 0]  # 128-token blocks: 0 tokens, nothing to replay
    assert {c[-1] for c in replays} == {48}, calls
    assert len(replays) == len(set(replays)) == 4, calls  # 4 samples, one older version held


def test_a_clean_engine_has_nothing_to_locate(lm) -> None:
    history = _history(lm)
    report = locate(lm, history, _clean(lm, history))
    assert report is not None and report.k3 < 1e-9 and report.candidates == []


def test_mixed_context_tokens_are_left_out_as_the_own_version_check_leaves_them_out(lm) -> None:
    # Keep-mode tokens whose KV came from older weights: no replay at one version rebuilds their
    # logprobs, so they must not read as a fault (here: far off, as if the old KV mattered a lot).
    history = _history(lm)
    groups = _clean(lm, history)
    for group in groups:
        for sample in group.samples:
            sample.token_context_versions[:] = [1, 1, 1, 0, 0, 0]
            for j in (3, 4, 5):
                sample.logprobs[j] -= 2.0
    report = locate(lm, history, groups, budget_s=5.0)
    assert report is not None and report.tokens == 4 * 3 and report.k3 < 1e-9, report
    assert report.candidates == [], report.candidates[:3]
    assert "last" not in report.by_position, report.by_position  # each sample's last token was mixed


def _clean(lm, history: WeightHistory, conditioned=lambda prompt: prompt) -> list:
    """Groups whose logprobs an honest engine at version 1 reported, conditioned on
    `conditioned(prompt)` (the recorded prompt, unless a test says otherwise)."""
    groups = _groups(lm, history, cached=1)
    _load(lm, history.get(1))
    for group in groups:
        prompt = conditioned(list(group.prompt_token_ids))
        for sample in group.samples:
            ids = torch.tensor([prompt + list(sample.token_ids)])
            with torch.no_grad():
                rows = lm(input_ids=ids).logits[0].float()[len(prompt) - 1 : -1]
            lp = processed_logprobs(rows, TRANSFORM).gather(
                -1, torch.tensor(list(sample.token_ids)).unsqueeze(-1)
            )
            sample.logprobs[:] = lp.squeeze(-1).tolist()
    return groups


def test_a_sync_mode_trainer_keeps_the_previous_version_for_the_localiser(
    redis_url: str, tmp_path: Path
) -> None:
    trainer = make_trainer(redis_url, tmp_path, max_lag=0)
    try:
        assert trainer.old_model is not None and trainer.history.keep == 2
    finally:
        trainer.close()


def _tagged(lm, history: WeightHistory, versions: list[int], loss_mask: list[bool]) -> list:
    """The clean groups with every sample's model tokens (`loss_mask`) tagged `versions`, and the
    logprobs an honest engine reports at those versions: only the tags are wrong."""
    groups = _groups(lm, history, cached=1)
    model_at = [i for i, m in enumerate(loss_mask) if m]
    for group in groups:
        prompt = list(group.prompt_token_ids)
        for sample in group.samples:
            ids = torch.tensor([prompt + list(sample.token_ids)])
            per_version = {}
            for v in set(versions):
                _load(lm, history.get(v))
                with torch.no_grad():
                    rows = lm(input_ids=ids).logits[0].float()[len(prompt) - 1 : -1]
                per_version[v] = processed_logprobs(rows, TRANSFORM)
            targets = list(sample.token_ids)
            sample.logprobs[:] = [
                float(per_version[v][at, targets[at]]) for at, v in zip(model_at, versions, strict=True)
            ]
            sample.token_weight_versions[:] = versions
            sample.loss_mask[:] = loss_mask
    return groups


def test_an_episode_that_kept_its_first_turns_version_is_named_from_its_tags(lm) -> None:
    # Two model turns (completion tokens 0-1 and 4-5; 2-3 are the environment's). The first turn was
    # sampled across an update (tags 0, 1); the second is tagged 0 again, as an episode loop that
    # kept its first turn's version writes it. The logprobs are honest, so only the tags tell.
    history = _history(lm)
    groups = _tagged(lm, history, [0, 1, 0, 0], [True, True, False, False, True, True])
    report = locate(lm, history, groups, budget_s=5.0)
    assert report is not None
    assert report.top(2) == ["episode_version_tag", "wrong_version_tag"], report.candidates
    assert "later model turns" in report.candidates[0].evidence, report.candidates[0]


def test_a_later_turn_sampled_two_versions_on_but_tagged_like_the_first_is_named(lm) -> None:
    # The second model turn was sampled at version 2 (two updates landed between the turns) and
    # tagged 0 like the first: the tags are possible, so only a replay at version 2 explains it.
    history = _history(lm, newest=2)
    mask = [True, True, False, False, True, True]
    groups = _tagged(lm, history, [0, 0, 2, 2], mask)
    for group in groups:
        for sample in group.samples:
            sample.token_weight_versions[:] = [0, 0, 0, 0]
    report = locate(lm, history, groups, budget_s=5.0)
    assert report is not None and report.k3 > 1e-4
    top = report.candidates[0]
    assert top.fault == "episode_version_tag" and top.score > 0.99, report.candidates[:3]
    assert "2 versions newer" in top.evidence, top


@pytest.mark.parametrize("contexts", [[], [1] * COMPLETION_LEN])
def test_a_span_tagged_older_inside_a_turn_is_a_wrong_version_tag(lm, contexts: list[int]) -> None:
    # With contexts: as a live engine reports them, the span's KV came from version 1 (newer than
    # its tag): impossible, so kept, unlike keep-mode tokens whose KV is older than their tag.
    history = _history(lm)
    groups = _tagged(lm, history, [1, 1, 0, 0, 1, 1], [True] * COMPLETION_LEN)
    for group in groups:
        for sample in group.samples:
            sample.token_context_versions[:] = contexts
    report = locate(lm, history, groups, budget_s=5.0)
    assert report is not None
    assert report.top(1) == ["wrong_version_tag"], report.candidates
    assert "episode_version_tag" not in report.top(), report.candidates


@pytest.mark.parametrize(("edit", "what"), [(lambda p: p[:1] + p, "twice"), (lambda p: p[1:], "missing")])
def test_a_prompt_whose_first_token_the_engine_doubled_or_lost_is_named(lm, edit, what: str) -> None:
    # The engine conditioned on the recorded prompt with its first token doubled (a template's BOS
    # added to a prompt that has one) or dropped, and reported honest logprobs for that context.
    history = _history(lm)
    report = locate(lm, history, _clean(lm, history, conditioned=edit), budget_s=5.0)
    assert report is not None and report.k3 > 0
    top = report.candidates[0]
    assert top.fault == "prompt_token_drift" and top.score > 0.99, report.candidates[:3]
    assert f"first token {what}" in top.evidence, top


def test_a_bf16_trainer_replays_as_its_scorer_scores(tiny_model: Path) -> None:
    """With the trainer in bf16 (a bf16 decoder over float32 weights, the head weight rounded to
    bf16), the localiser's replays are the trainer's own function: an engine that reported exactly
    the trainer's bf16 logprobs leaves nothing to locate. (The HF model's own head would multiply
    the decoder's bf16 output by the float32 weight: a dtype error, so no report at all.)"""
    from trainer.policy import SequenceInput, load_model, pad_batch, scorer_for

    plain = load_model(tiny_model).float().eval()
    history = _history(plain)
    groups = _groups(plain, history, cached=1)
    lm = load_model(tiny_model).eval()
    scorer = scorer_for(lm, "bf16")
    _load(lm, history.get(1))
    for group in groups:
        for sample in group.samples:
            inputs = SequenceInput(tuple(group.prompt_token_ids), tuple(sample.token_ids), TRANSFORM)
            ids, mask, rows, cols, targets = pad_batch([inputs])
            with torch.no_grad():
                logits = scorer(ids, mask, rows, cols)
            lp = processed_logprobs(logits, TRANSFORM).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            sample.logprobs[:] = lp.tolist()
    report = locate(lm, history, groups, budget_s=5.0, precision="bf16")
    assert report is not None and report.tokens == 4 * COMPLETION_LEN, report
    assert report.k3 < 1e-9 and report.candidates == [], (report.k3, report.candidates[:3])


def test_a_bf16_trainer_passes_its_precision_to_the_localiser(redis_url: str, tmp_path: Path) -> None:
    """The trainer's gate explains a bf16 step with its own scorer's numerics: an engine that
    reported the trainer's own bf16 logprobs is replayed to no mismatch at all."""
    from tests.fakes.synthetic_rollouts import make_group
    from trainer.consumer import Batch
    from trainer.policy import SequenceInput, load_model, token_logprobs

    trainer = make_trainer(redis_url, tmp_path, precision="bf16")
    try:
        engine = load_model(trainer.model_dir).eval()  # samples the tokens
        groups = [
            make_group(engine, f"g{i}", (1.0, 0.0), generator=torch.Generator().manual_seed(i))
            for i in range(2)
        ]
        for group in groups:
            for sample in group.samples:
                inputs = SequenceInput(tuple(group.prompt_token_ids), tuple(sample.token_ids), TRANSFORM)
                with torch.no_grad():
                    sample.logprobs[:] = token_logprobs(trainer.old_model, [inputs])[0].tolist()
        summary = trainer.locate_mismatch(Batch(groups=groups))
        assert "Report:" in summary, summary
        report = json.loads((tmp_path / "mismatch_report.json").read_text())
        assert report["tokens"] == 2 * 2 * 8 and report["k3"] < 1e-9, report
    finally:
        trainer.close()
