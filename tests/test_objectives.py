"""Loss, off-policy and mismatch functions against hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from parity import mismatch
from trainer import objectives, offpolicy


def test_grpo_advantages_are_group_normalised_and_zero_variance_groups_are_zero() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]])
    adv = objectives.group_advantages(rewards)
    # group 0: mean 0.5, population std 0.5 -> ±1
    assert torch.allclose(adv.values_GN[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    # group 1: no variance -> exactly zero, flagged
    assert torch.equal(adv.values_GN[1], torch.zeros(4))
    assert adv.zero_variance_G.tolist() == [False, True, False]
    # group 2: mean 2, std sqrt(0.5)
    s = math.sqrt(0.5)
    assert torch.allclose(adv.values_GN[2], torch.tensor([1 / s, -1 / s, 0.0, 0.0]), atol=1e-5)
    # "ppo" (no critic): baseline only
    centred = objectives.group_advantages(rewards, normalise_std=False).values_GN
    assert torch.allclose(centred[2], torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_ppo_clip_takes_the_pessimistic_branch_per_token() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    loss, clipped = objectives.ppo_clip_token_loss(new, old, adv, 0.2, 0.2)
    # token 0: ratio 1.5, A>0 -> min(1.5, 1.2) = 1.2 -> -1.2
    # token 1: ratio 0.5, A>0 -> min(0.5, 0.8) = 0.5 -> -0.5 (unclipped branch kept)
    # token 2: ratio 1.1, A=-2 -> min(-2.2, -2.2) -> 2.2
    # token 3: ratio 0.7, A=-1 -> min(-0.7, -0.8) = -0.8 -> 0.8
    assert torch.allclose(loss, torch.tensor([-1.2, -0.5, 2.2, 0.8]), atol=1e-6)
    assert clipped.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_ppo_clip_gradient_vanishes_on_the_clipped_side() -> None:
    new = torch.log(torch.tensor([1.5, 1.0])).requires_grad_()
    loss, _ = objectives.ppo_clip_token_loss(new, torch.zeros(2), torch.tensor([1.0, 1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert new.grad[0] == 0.0  # clipped: no push further
    assert torch.isclose(new.grad[1], torch.tensor(-1.0))  # d(-ratio)/dlogp = -ratio = -1


def test_gspo_ratio_is_exp_of_mean_token_log_ratio_per_sequence() -> None:
    new = torch.tensor([0.1, 0.3, -0.2, 0.0, 0.0])
    old = torch.zeros(5)
    seq = torch.tensor([0, 0, 1, 1, 1])
    ratio = objectives.gspo_sequence_ratio(new, old, seq, 2)
    assert torch.allclose(ratio, torch.tensor([math.exp(0.2), math.exp(-0.2 / 3)]), atol=1e-6)
    loss, clipped = objectives.gspo_sequence_loss(new, old, torch.tensor([1.0, -1.0]), seq, 2, 3e-4, 4e-4)
    # seq 0: ratio e^0.2 > 1.0004, A>0 -> clipped at 1.0004; seq 1: ratio < 0.9997, A<0 -> clipped too
    assert torch.allclose(loss, torch.tensor([-1.0004, 0.9997]), atol=1e-6)
    assert clipped.tolist() == [1.0, 1.0]


def test_token_and_sequence_aggregation_differ_as_defined() -> None:
    loss = torch.tensor([1.0, 1.0, 1.0, 4.0])
    seq = torch.tensor([0, 0, 0, 1])
    lengths = torch.tensor([3, 1])
    assert objectives.aggregate(loss, seq, lengths, "token", 4, 2).item() == pytest.approx(7 / 4)
    assert objectives.aggregate(loss, seq, lengths, "sequence", 4, 2).item() == pytest.approx((1 + 4) / 2)
    # micro-batches sum to the full-batch value
    part_a = objectives.aggregate(loss[:3], seq[:3], lengths[:1], "sequence", 4, 2)
    part_b = objectives.aggregate(loss[3:], torch.tensor([0]), lengths[1:], "sequence", 4, 2)
    assert (part_a + part_b).item() == pytest.approx(2.5)
    seq_loss = torch.tensor([2.0, -1.0])
    assert objectives.aggregate_sequences(seq_loss, lengths, "token", 4, 2).item() == pytest.approx(5 / 4)
    assert objectives.aggregate_sequences(seq_loss, lengths, "sequence", 4, 2).item() == pytest.approx(0.5)


def test_kl_k3_is_zero_at_equality_and_matches_formula() -> None:
    new = torch.tensor([-1.0, -2.0])
    assert torch.equal(objectives.kl_k3(new, new), torch.zeros(2))
    value = objectives.kl_k3(torch.tensor([-1.0]), torch.tensor([-1.5]))
    assert value.item() == pytest.approx(math.exp(-0.5) + 0.5 - 1.0, rel=1e-6)


def test_tis_truncates_and_mis_masks_per_token_and_per_sequence() -> None:
    behaviour = torch.zeros(4)
    proximal = torch.log(torch.tensor([0.5, 3.0, 1.5, 1.5]))
    seq = torch.tensor([0, 0, 1, 1])
    w, corrected = offpolicy.is_weights(proximal, behaviour, seq, 2, "tis", "token", 2.0)
    assert torch.allclose(w, torch.tensor([0.5, 2.0, 1.5, 1.5]), atol=1e-6)
    assert corrected.tolist() == [0.0, 1.0, 0.0, 0.0]
    w, corrected = offpolicy.is_weights(proximal, behaviour, seq, 2, "mis", "token", 2.0)
    assert torch.allclose(w, torch.tensor([0.5, 0.0, 1.5, 1.5]), atol=1e-6)
    # per sequence: seq 0 ratio 0.5*3 = 1.5 (kept), seq 1 ratio 2.25 (> cap)
    w, _ = offpolicy.is_weights(proximal, behaviour, seq, 2, "tis", "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([1.5, 1.5, 2.0, 2.0]), atol=1e-5)
    w, corrected = offpolicy.is_weights(proximal, behaviour, seq, 2, "mis", "sequence", 2.0)
    assert torch.allclose(w, torch.tensor([1.5, 1.5, 0.0, 0.0]), atol=1e-5)
    assert corrected.tolist() == [0.0, 0.0, 1.0, 1.0]
    w, _ = offpolicy.is_weights(proximal, behaviour, seq, 2, "none", "token", 2.0)
    assert torch.equal(w, torch.ones(4))


def test_ess_is_one_for_equal_weights_and_one_over_n_for_a_single_weight() -> None:
    assert mismatch.effective_sample_size(torch.full((10,), 0.3)) == pytest.approx(1.0)
    assert mismatch.effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    # (1+3)^2 / (2 * (1+9)) = 0.8
    assert mismatch.effective_sample_size(torch.tensor([1.0, 3.0])) == pytest.approx(0.8)
    assert math.isnan(mismatch.effective_sample_size(torch.zeros(0)))  # no weights: not measured


def test_mismatch_stats_are_zero_for_identical_logprobs_and_positive_otherwise() -> None:
    lp = torch.log(torch.tensor([0.2, 0.5, 0.9, 0.01]))
    same = mismatch.mismatch_stats(lp, lp.clone())
    assert (same.k1, same.k2, same.k3, same.max_abs, same.mean_abs) == (0, 0, 0, 0, 0)
    assert same.ratio_p01 == same.ratio_p50 == same.ratio_p99 == 1.0 and same.ess == 1.0
    assert (same.tokens, same.nonfinite_tokens, same.finite_tokens) == (4, 0, 4)
    other = mismatch.mismatch_stats(lp + torch.tensor([0.1, -0.2, 0.05, 0.3]), lp)
    assert other.k2 > 0 and other.k3 > 0 and other.max_abs == pytest.approx(0.3, abs=1e-6)
    assert other.mean_abs == pytest.approx(0.1625, abs=1e-6)
    assert other.ratio_p05 < 1.0 < other.ratio_p95 and other.ess < 1.0
    # k1 estimates KL(q||p) on samples from q: positive when the tokens come from the rollout side.
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(50), -1)
    p = torch.softmax(torch.log(q) + 0.5 * torch.randn(50), -1)
    tokens = torch.multinomial(q, 20000, replacement=True)
    sampled = mismatch.mismatch_stats(torch.log(p)[tokens], torch.log(q)[tokens])
    exact_kl = float((q * (q.log() - p.log())).sum())
    assert sampled.k1 > 0 and sampled.k1 == pytest.approx(exact_kl, rel=0.1)
    assert sampled.k3 == pytest.approx(exact_kl, rel=0.1)


def test_mismatch_stats_match_hand_computed_values_on_any_input_type() -> None:
    rollout = [-1.0, -2.0, -0.5]
    trainer = [-1.1, -1.8, -0.5]
    r = [-0.1, 0.2, 0.0]
    expected = {
        "k1": -sum(r) / 3,
        "k2": sum(x * x / 2 for x in r) / 3,
        "k3": sum(math.exp(x) - 1 - x for x in r) / 3,
        "max_abs": 0.2,
        "ratio_p50": 1.0,
        "ess": sum(math.exp(x) for x in r) ** 2 / (3 * sum(math.exp(2 * x) for x in r)),
    }
    for make in (list, torch.tensor, lambda xs: torch.tensor(xs, dtype=torch.float64)):
        stats = mismatch.mismatch_stats(make(trainer), make(rollout))
        for key, value in expected.items():
            assert getattr(stats, key) == pytest.approx(value, rel=1e-6, abs=1e-7), (make, key)


def test_non_finite_logprobs_are_counted_and_left_out_not_clamped() -> None:
    rollout = torch.tensor([-1.0, -2.0, -0.5, float("nan"), -3.0])
    trainer = torch.tensor([-1.1, float("-inf"), -0.5, -1.0, float("-inf")])
    stats = mismatch.mismatch_stats(trainer, rollout)
    assert (stats.tokens, stats.nonfinite_tokens, stats.finite_tokens) == (5, 3, 2)
    assert (stats.nonfinite_trainer, stats.nonfinite_rollout) == (2, 1)
    # The statistics are those of the two finite tokens alone (r = -0.1 and 0), nothing at ±20.
    finite = mismatch.mismatch_stats(trainer[[0, 2]], rollout[[0, 2]])
    for key in ("k1", "k2", "k3", "max_abs", "mean_abs", "ratio_p05", "ratio_p95", "ess"):
        assert getattr(stats, key) == getattr(finite, key), key
    assert stats.max_abs == pytest.approx(0.1, abs=1e-6)
    assert mismatch.finite_log_ratios(trainer, rollout).tolist() == pytest.approx([-0.1, 0.0], abs=1e-6)


@pytest.mark.parametrize(
    ("trainer", "rollout"),
    [([], []), ([float("-inf"), float("nan")], [-1.0, -2.0])],
    ids=["no tokens", "no finite token"],
)
def test_a_statistic_with_nothing_to_measure_is_nan_not_zero(trainer: list, rollout: list) -> None:
    stats = mismatch.mismatch_stats(torch.tensor(trainer), torch.tensor(rollout))
    assert stats.tokens == len(trainer) and stats.finite_tokens == 0
    for key in ("k1", "k2", "k3", "max_abs", "mean_abs", "ratio_p01", "ratio_p50", "ratio_p99", "ess"):
        assert math.isnan(getattr(stats, key)), key


def test_lag_is_trainer_minus_token_version_and_stale_beyond_max_lag() -> None:
    assert offpolicy.token_lags(5, [5, 4, 3]) == [0, 1, 2]
    assert offpolicy.lag_histogram([0, 2, 0, 1, 10]) == {"0": 2, "1": 1, "2": 1, "10": 1}
    assert not offpolicy.is_stale(5, 3, max_lag=2)
    assert offpolicy.is_stale(5, 2, max_lag=2)


def _loss_of(config_updates: dict, *, behaviour, new, recomputed=None, ref=None, advantages=(1.0, -1.0)):
    """policy_loss on two sequences of two tokens; returns (loss, grad of new, stats)."""
    from parity.config.trainer import TrainerConfig
    from trainer.loss import LossInputs, policy_loss

    new_T = torch.tensor(new, requires_grad=True)
    inputs = LossInputs(
        new_T=new_T,
        behaviour_T=torch.tensor(behaviour),
        advantages_S=torch.tensor(advantages),
        seq_index_T=torch.tensor([0, 0, 1, 1]),
        seq_lengths_S=torch.tensor([2, 2]),
        total_tokens=4,
        total_seqs=2,
        recomputed_T=None if recomputed is None else torch.tensor(recomputed),
        ref_T=None if ref is None else torch.tensor(ref),
    )
    loss, stats = policy_loss(TrainerConfig(**config_updates), inputs)
    loss.backward()
    return loss, new_T.grad, stats


@pytest.mark.parametrize("objective", ["grpo", "gspo"])
@pytest.mark.parametrize(
    ("case", "kwargs"),
    [  # one bad logprob each: it is left out, the step stays finite, the others still train
        ("old -inf, recompute", {"recomputed": [-1.0, -math.inf, -1.0, -1.0]}),
        ("old -inf on a negative advantage", {"recomputed": [-1.0, -1.0, -1.0, -math.inf]}),
        ("behaviour NaN", {"behaviour_nan": 1}),
        ("new -inf (the trainer's mask)", {"new_inf": 2}),
    ],
)
def test_a_token_with_a_non_finite_logprob_is_left_out_and_the_step_stays_finite(
    objective: str, case: str, kwargs: dict
) -> None:
    behaviour = [-1.0, -1.2, -0.8, -1.1]
    new = [-0.9, -1.1, -0.9, -1.0]
    kwargs = dict(kwargs)  # the parametrized dict is shared between the objectives
    if "behaviour_nan" in kwargs:
        behaviour[kwargs.pop("behaviour_nan")] = math.nan
    if "new_inf" in kwargs:
        new[kwargs.pop("new_inf")] = -math.inf
    loss, grad, stats = _loss_of({"objective": objective}, behaviour=behaviour, new=new, **kwargs)
    assert math.isfinite(float(loss.detach())), case
    assert torch.isfinite(grad).all(), (case, grad)
    assert int(stats.nonfinite_tokens) == 1, case
    assert int(torch.isnan(stats.kl_new_old).sum()) == 1  # not measured there, never 0
    assert grad.abs().sum() > 0  # the other tokens still train


def test_an_extreme_log_ratio_or_an_excluded_reference_token_gives_no_inf_or_nan() -> None:
    # a log-ratio of 100 overflows float32's exp; with the KL penalty on and a zero advantage this
    # gave inf * 0 = NaN
    loss, grad, _ = _loss_of(
        {"kl_coef": 0.1},
        behaviour=[-101.0, -1.0, -1.0, -1.0],
        new=[-1.0, -1.0, -1.0, -1.0],
        ref=[-1.0, -1.0, -1.0, -1.0],
        advantages=(0.0, 0.0),
    )
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
    # a token outside the reference's top-p set (ref -inf): no KL there, measured NaN, not inf
    loss, grad, stats = _loss_of(
        {"kl_coef": 0.1}, behaviour=[-1.0] * 4, new=[-1.0] * 4, ref=[-1.0, -math.inf, -1.0, -1.0]
    )
    assert math.isfinite(float(loss.detach())) and torch.isfinite(grad).all()
    assert torch.isnan(stats.kl_ref[1]) and torch.isfinite(stats.kl_ref[[0, 2, 3]]).all()
