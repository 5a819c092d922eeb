"""Backend mismatch at each token's own version on every step, mixed-context tokens as their own
class, no fake zeros, and the running gate (issue 17), on the trainer in-process (tiny model, real
Redis). Rollouts are synthetic: sampled by the trainer's own model (tests/fakes), so the backend
mismatch at the right version is float32 noise (< 1e-8 k3) and anything else is a bug."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from parity.rollout_queue import RolloutQueue
from tests.fakes.synthetic_rollouts import make_group
from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics
from trainer.mismatch_gate import GATED_METRIC, MismatchGate, MismatchGateError
from trainer.policy import load_model


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path):
    return load_model(tiny_model)


def group(model, gid: str, version: int = 0, seed: int = 0, rewards=(1.0, 0.0, 0.0, 1.0)):
    return make_group(model, gid, rewards, version=version, generator=torch.Generator().manual_seed(seed))


def test_own_version_mismatch_is_measured_on_a_step_with_only_stale_tokens(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "a"))
    queue.publish(group(reference_model, "b", seed=1))  # trained at version 1: every token lag 1
    make_trainer(redis_url, tmp_path, steps=2, max_lag=1, lr=1e-3).run()
    first, second = metrics(tmp_path)
    assert second["lag0_token_frac"] == 0.0 and second["mismatch_k3"] is None  # no lag-0 token
    # ... but the own-version mismatch is there on both steps: version 0's snapshot rescored them.
    for row in (first, second):
        assert row["mismatch_k3_own_version"] is not None and 0.0 <= row["mismatch_k3_own_version"] < 1e-8
        assert row["mismatch_max_abs_own_version"] < 1e-4
        assert row["own_version_score_s"] >= 0.0
    assert first["own_version_rescored_tokens"] == 0  # lag-0 tokens come from the step's own forward
    assert second["own_version_rescored_tokens"] == second["own_version_tokens"] == second["num_tokens"]
    # The same step against the current weights is policy drift, a different and larger number.
    assert second["policy_drift_k3"] > 100 * max(second["mismatch_k3_own_version"], 1e-12)


def test_own_version_off_leaves_the_metric_absent_not_zero(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "a"))
    queue.publish(group(reference_model, "b", seed=1))
    make_trainer(redis_url, tmp_path, steps=2, max_lag=1, lr=1e-3, own_version_groups=0).run()
    for row in metrics(tmp_path):
        assert "mismatch_k3_own_version" not in row


def test_mixed_context_tokens_are_their_own_class(redis_url: str, tmp_path: Path, reference_model) -> None:
    # Step 1 trains a plain group (-> version 1). Step 2 gets a group sampled like a keep-mode
    # update mid-decode: the first half of each sample by version 0, the second half labelled
    # version 1 but attending to the prompt KV version 0 computed (context version 0).
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "plain"))
    mixed = group(reference_model, "mixed", seed=2)
    for sample in mixed.samples:
        n = len(sample.token_ids)
        sample.token_weight_versions[:] = [0] * (n // 2) + [1] * (n - n // 2)
        sample.token_context_versions[:] = [0] * n
    mixed.max_weight_version = 1
    queue.publish(mixed)
    make_trainer(redis_url, tmp_path, steps=2, max_lag=1, lr=1e-3).run()
    first, second = metrics(tmp_path)
    n_tokens = sum(len(s.token_ids) for s in mixed.samples)
    n_mixed = sum(len(s.token_ids) - len(s.token_ids) // 2 for s in mixed.samples)
    assert second["mixed_context_tokens"] == n_mixed
    assert second["lag0_token_frac"] == pytest.approx(n_mixed / n_tokens)
    # The lag-0 tokens are all mixed-context: none is a clean lag-0 token, so no lag-0 mismatch ...
    assert second["mismatch_k3"] is None and second["mismatch_tokens"] == 0
    assert first["mismatch_tokens"] == first["num_tokens"]  # the plain group: every token clean lag-0
    # ... they are measured as their own class (sampled by v0 weights, scored by v1: not ~0) ...
    assert second["mismatch_k3_mixed_context"] > 1e-6
    # ... and the own-version number only covers the clean (version-0) half, rescored at version 0.
    assert second["own_version_tokens"] == n_tokens - n_mixed
    assert second["mismatch_k3_own_version"] < 1e-8


def test_nothing_measured_is_null_never_zero(redis_url: str, tmp_path: Path, reference_model) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "flat", rewards=(1.0, 1.0, 1.0, 1.0)))  # zero variance
    make_trainer(redis_url, tmp_path, steps=1, skip_zero_variance=False).run()
    (row,) = metrics(tmp_path)
    assert row["trainable_tokens"] == 0
    # Nothing was trained: no loss, no clip rate, no IS weights (and no reference model: no kl_ref).
    for key in ("loss", "clip_rate", "is_weight_mean", "is_corrected_frac", "kl_ref"):
        assert row[key] is None, (key, row[key])


def test_gate_counts_consecutive_measured_steps_and_ignores_unmeasured_ones() -> None:
    gate = MismatchGate(threshold=1e-3, steps=3, action="warn")
    over, under, nan = {GATED_METRIC: 5e-3}, {GATED_METRIC: 1e-4}, {}
    assert gate.observe(1, over) == "" and gate.observe(2, over) == ""
    assert gate.observe(3, under) == ""  # a passing step breaks the streak
    assert gate.observe(4, over) == "" and gate.observe(5, nan) == "" and gate.observe(6, over) == ""
    warning = gate.observe(7, {GATED_METRIC: math.inf})  # inf is not measured either
    assert warning == ""
    warning = gate.observe(8, over)
    assert "exceeded the running gate's threshold 0.001 (check.gate_threshold) for 3 consecutive" in warning
    assert "head_dtype" in warning
    with pytest.raises(MismatchGateError, match="prefix_caching"):
        MismatchGate(1e-3, 1, "stop").observe(1, over)


def test_impossible_version_tags_are_counted_per_token() -> None:
    from parity.versions import impossible_tags

    assert impossible_tags([0, 0, 1, 1, 2]) == 0  # versions only move forward
    assert impossible_tags([2, 2, 1, 1]) == 2  # tagged older than an earlier token of the sample
    assert impossible_tags([1, 2, 1, 2]) == 1  # the dip only; the 2 after it is possible again
    assert impossible_tags([1, 1, 2], [1, 1, 1]) == 0  # KV older than the token: keep mode, possible
    assert impossible_tags([1, 1], [1, 2]) == 1  # KV newer than the weights that sampled it
    assert impossible_tags([]) == 0


def test_gate_acts_at_once_on_impossible_version_tags_whatever_the_numbers() -> None:
    clean_numbers = {GATED_METRIC: 1e-12, "version_tag_violations": 3}
    with pytest.raises(MismatchGateError, match="version_tag_violations: 3 token"):
        MismatchGate(1e-3, 3, "stop").observe(1, clean_numbers, explain=lambda: "wrong_version_tag")
    gate, explained = MismatchGate(1e-3, 3, "warn"), []
    first = gate.observe(1, clean_numbers, explain=lambda: explained.append(1) or "here")
    again = gate.observe(2, clean_numbers, explain=lambda: explained.append(2) or "here")
    assert "version accounting" in first and "Localisation: here" in first and "Localisation" not in again
    assert explained == [1]  # localised once, warned on each step
    assert gate.observe(3, {GATED_METRIC: 1e-12, "version_tag_violations": 0}) == ""


def test_a_run_whose_engine_tags_a_completions_second_half_one_version_older_is_stopped(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    """wrong_version_tag as a live engine shows it: its older-tagged tokens follow newer ones, so the
    own-version check leaves them out as mixed context and its numbers read clean."""
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "clean"))  # step 1 trains version 0's rollouts, then version 1
    bad = group(reference_model, "tags", version=1, seed=1)
    for sample in bad.samples:  # sampled at 1 throughout (KV too); its second half tagged 0
        n = len(sample.token_weight_versions)
        sample.token_weight_versions[n // 2 :] = [0] * (n - n // 2)
        del sample.token_context_versions[:]
        sample.token_context_versions.extend([1] * n)
    bad.min_weight_version = 0
    queue.publish(bad)
    trainer = make_trainer(redis_url, tmp_path, steps=2, max_lag=2)
    with pytest.raises(MismatchGateError, match="version_tag_violations"):
        trainer.run()
    first, second = metrics(tmp_path)
    assert first["version_tag_violations"] == 0
    n = [len(s.token_weight_versions) for s in bad.samples]
    assert second["version_tag_violations"] == sum(k - k // 2 for k in n) > 0


@pytest.mark.parametrize("action", ["stop", "warn"])
def test_running_gate_stops_a_run_whose_rollout_logprobs_are_off(
    redis_url: str, tmp_path: Path, reference_model, action: str
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    for step in range(2):
        bad = group(reference_model, f"bad{step}", seed=step)
        for sample in bad.samples:  # an engine whose logprobs are 0.3 nats off (e.g. raw vs processed)
            sample.logprobs[:] = [lp - 0.3 for lp in sample.logprobs]
        queue.publish(bad)
    trainer = make_trainer(redis_url, tmp_path, steps=2, gate_steps=2, on_mismatch=action)
    if action == "stop":
        with pytest.raises(MismatchGateError, match="2 consecutive measured steps"):
            trainer.run()
        assert len(metrics(tmp_path)) == 2  # the step that tripped the gate is recorded, then the run stops
    else:
        trainer.run()
        rows = metrics(tmp_path)
        assert len(rows) == 2 and all(r["mismatch_k3_own_version_informative"] > 1e-3 for r in rows)


def test_degenerate_tokens_are_not_informative_and_a_step_of_them_is_not_measured(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    # top_k=1: every processed distribution has one candidate, logprob 0 on both sides whatever
    # the engine did. An engine 0.3 nats off on its (never reported) other candidates cannot show.
    from parity.sampling import SamplingTransform

    queue = RolloutQueue(redis_url, stream=STREAM)
    top1 = SamplingTransform(1.0, 1, 1.0)
    queue.publish(make_group(reference_model, "top1", (1.0, 0.0, 0.0, 1.0), transform=top1,
                             generator=torch.Generator().manual_seed(0)))  # fmt: skip
    queue.publish(group(reference_model, "plain", seed=1))
    make_trainer(redis_url, tmp_path, steps=2, max_lag=1, lr=1e-3, gate_steps=1, on_mismatch="stop").run()
    degenerate, plain = metrics(tmp_path)
    assert degenerate["own_version_tokens"] == degenerate["num_tokens"] > 0
    assert degenerate["mismatch_k3_own_version"] == 0.0  # measured over tokens that cannot differ
    assert degenerate["own_version_informative_tokens"] == 0
    assert degenerate["mismatch_k3_own_version_informative"] is None  # not measured, never a pass
    assert degenerate["mismatch_max_abs_own_version_informative"] is None
    assert plain["own_version_informative_tokens"] == plain["own_version_tokens"] > 0  # rescored at v0
    assert 0.0 <= plain["mismatch_k3_own_version_informative"] < 1e-8
