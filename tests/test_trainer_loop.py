"""The trainer loop in-process on the tiny model and a real Redis: dedupe, claim, staleness,
checkpoint/restore, metrics, and that the objective actually moves the policy."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from parity.rollout_queue import RolloutQueue
from parity.sampling import SamplingTransform
from tests.fakes.synthetic_rollouts import make_group
from tests.fakes.trainer_helpers import STREAM, make_trainer, metrics
from trainer.consumer import Batch
from trainer.own_version import rescore_at_versions
from trainer.policy import SequenceInput, load_model, token_logprobs
from trainer.prepare import prepare
from trainer.telemetry import REQUIRED_METRICS


@pytest.fixture(scope="module")
def reference_model(tiny_model: Path):
    return load_model(tiny_model)


def trained_ids(run_dir: Path) -> list[str]:
    lines = (run_dir / "trained_rollouts.jsonl").read_text().splitlines()
    return [rid for line in lines for rid in json.loads(line)["rollout_ids"]]


def group(model, gid: str, version: int = 0, rewards=(1.0, 0.0, 0.0, 1.0), seed: int = 0, **kw):
    return make_group(
        model, gid, rewards, version=version, generator=torch.Generator().manual_seed(seed), **kw
    )


def test_duplicate_delivery_is_trained_once(redis_url: str, tmp_path: Path, reference_model) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    g0 = group(reference_model, "g0")
    queue.publish(g0)
    queue.publish(g0)  # at-least-once producer: the same group twice
    queue.publish(group(reference_model, "g1", seed=1))
    trainer = make_trainer(redis_url, tmp_path, steps=2)
    trainer.run()
    ids = trained_ids(tmp_path)
    assert sorted(ids) == sorted([f"g0/{i}" for i in range(4)] + [f"g1/{i}" for i in range(4)])
    assert trainer.state.duplicates_skipped_total == 1
    assert metrics(tmp_path)[1]["duplicates_skipped"] == 1
    assert queue.backlog() == 0  # the duplicate was acknowledged with the step


def test_a_killed_consumers_entries_are_claimed_and_trained(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    trainer = make_trainer(redis_url, tmp_path, steps=2, claim_idle_ms=200)
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "a"))
    queue.publish(group(reference_model, "b", seed=1))
    taken = RolloutQueue(redis_url, stream=STREAM).read("crashed-trainer", count=2, block_ms=10)
    assert len(taken) == 2  # ... and that consumer dies without acking
    start = time.monotonic()
    trainer.run()
    assert time.monotonic() - start >= 0.2  # only after they were idle for claim_idle_ms
    assert sorted(trained_ids(tmp_path)) == sorted(
        [f"a/{i}" for i in range(4)] + [f"b/{i}" for i in range(4)]
    )
    consumers = {c["name"].decode(): c["pending"] for c in queue.redis.xinfo_consumers(STREAM, "trainer")}
    assert consumers == {"crashed-trainer": 0, "trainer-0": 0}
    assert queue.backlog() == 0


def test_an_entry_beyond_max_lag_is_dropped_and_counted(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    # Every synthetic group is sampled at version 0's weights; labelled 1 or 2 it is what the running
    # gate calls stale weights (and stops on). This test is about the lag bound: warn only.
    trainer = make_trainer(redis_url, tmp_path, steps=3, max_lag=1, on_mismatch="warn")
    queue.publish(group(reference_model, "v0", version=0))
    queue.publish(group(reference_model, "v1", version=1, seed=1))
    queue.publish(group(reference_model, "stale", version=0, seed=2))  # trainer at v2: lag 2 > 1
    queue.publish(group(reference_model, "fresh", version=2, seed=3))
    trainer.run()
    rows = metrics(tmp_path)
    assert [r["weight_version"] for r in rows] == [0, 1, 2]
    assert rows[2]["dropped_stale"] == 1 and rows[2]["lag_max"] == 0
    assert trainer.state.dropped_stale_total == 1
    assert not any(rid.startswith("stale/") for rid in trained_ids(tmp_path))
    assert queue.backlog() == 0


def test_metrics_have_the_contract_names_and_lag0_mismatch_is_zero_for_reference_rollouts(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    # Two transforms in one micro-batch exercise the per-transform replay.
    queue.publish(group(reference_model, "k", transform=SamplingTransform(0.8, 20, 1.0)))
    queue.publish(group(reference_model, "p", seed=1, transform=SamplingTransform(1.2, 0, 0.9)))
    trainer = make_trainer(redis_url, tmp_path, groups_per_step=2, micro_batch_size=8)
    trainer.run()
    row = metrics(tmp_path)[0]
    assert set(REQUIRED_METRICS) <= set(row)
    assert row["lag0_token_frac"] == 1.0 and row["lag_hist"] == {"0": 64}
    # Same weights, same numerics: float32 reduction-order noise only (|Δlogprob| ~1e-6).
    assert row["mismatch_max_abs"] < 1e-4 and row["mismatch_k3"] < 1e-9
    assert 0.9999 < row["ess"] <= 1.0 + 1e-12
    assert row["entropy"] > 0 and row["reward_mean"] == 0.5
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("parity_trainer_step") == 1.0
    assert REGISTRY.get_sample_value("parity_trainer_weight_version") == 1.0
    assert REGISTRY.get_sample_value("parity_trainer_mismatch_k3") == pytest.approx(row["mismatch_k3"])


def test_tokens_outside_the_trainers_mask_are_counted_not_clamped(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    # Sampled at top-k 5, replayed by the trainer at top-k 1: every token that was not the argmax is
    # outside the trainer's distribution (logprob -inf), the engine-sampled-outside failure.
    g = group(reference_model, "masked", transform=SamplingTransform(1.0, 5, 1.0), seed=3)
    g.sampling.top_k = 1
    RolloutQueue(redis_url, stream=STREAM).publish(g)
    trainer = make_trainer(redis_url, tmp_path)
    replay = SamplingTransform(1.0, 1, 1.0)
    rollout_lp, trainer_lp = [], []
    with torch.no_grad():
        for sample in g.samples:
            inputs = SequenceInput(tuple(g.prompt_token_ids), tuple(sample.token_ids), replay)
            trainer_lp += token_logprobs(trainer.model, [inputs])[0].tolist()
            rollout_lp += list(sample.logprobs)
    trainer.run()
    (row,) = metrics(tmp_path)
    masked = sum(1 for lp in trainer_lp if lp == float("-inf"))
    assert 0 < masked < len(trainer_lp)  # the case needs both kinds of token
    assert row["mismatch_nonfinite_tokens"] == row["policy_drift_nonfinite_tokens"] == masked
    assert row["trainer_nonfinite_tokens"] == masked
    # The statistics are those of the finite tokens alone: no -inf clamped to ±20 among them.
    r = [t - q for t, q in zip(trainer_lp, rollout_lp, strict=True) if t != float("-inf")]
    assert row["mismatch_max_abs"] == pytest.approx(max(abs(x) for x in r), abs=1e-5)
    assert row["mismatch_k1"] == pytest.approx(-sum(r) / len(r), abs=1e-5)


def test_lag0_mismatch_of_a_step_without_lag0_tokens_is_null_not_zero(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    from prometheus_client import REGISTRY

    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "v0a"))
    queue.publish(group(reference_model, "v0b", seed=1))  # trained at version 1: lag 1
    make_trainer(redis_url, tmp_path, steps=2, max_lag=1, lr=1e-3).run()
    first, second = metrics(tmp_path)
    assert first["lag0_token_frac"] == 1.0 and second["lag0_token_frac"] == 0.0
    for key in ("mismatch_k1", "mismatch_k3", "mismatch_max_abs", "mismatch_ratio_p50", "ess_lag0"):
        assert isinstance(first[key], float) and second[key] is None, key
    assert second["policy_drift_k3"] > 0 and second["mismatch_nonfinite_tokens"] == 0
    # The gauge says "not measured", not the previous step's value.
    assert math.isnan(REGISTRY.get_sample_value("parity_trainer_mismatch_k3"))


def test_zero_variance_groups_add_no_gradient_and_are_counted(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "flat", rewards=(1.0, 1.0, 1.0, 1.0)))
    trainer = make_trainer(redis_url, tmp_path, lr=1e-2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.run()
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    row = metrics(tmp_path)[0]
    assert row["zero_variance_groups"] == 1 and row["trainable_tokens"] == 0 and row["num_tokens"] == 32


@pytest.mark.parametrize(
    ("objective", "loss_agg", "extra"),
    [
        ("grpo", "token", {}),
        ("gspo", "sequence", {"gspo_clip_eps_low": 0.2, "gspo_clip_eps_high": 0.2}),
        ("ppo", "sequence", {"is_correction": "tis", "is_level": "sequence"}),
        ("grpo", "token", {"kl_coef": 0.1, "is_correction": "mis"}),
    ],
)
def test_each_objective_raises_the_likelihood_of_rewarded_completions(
    redis_url: str, tmp_path: Path, reference_model, objective: str, loss_agg: str, extra: dict
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    template = group(reference_model, "t", rewards=(1.0, 0.0, 0.0, 0.0))
    for i in range(3):  # the same completions three times, as fresh groups
        copy = type(template)()
        copy.CopyFrom(template)
        copy.group_id = f"t{i}"
        for j, sample in enumerate(copy.samples):
            sample.rollout_id = f"t{i}/{j}"
        queue.publish(copy)
    trainer = make_trainer(
        redis_url, tmp_path, steps=3, lr=3e-3, max_lag=5, objective=objective, loss_agg=loss_agg, **extra
    )

    def seq_logprob(index: int) -> float:
        sample = template.samples[index]
        inputs = SequenceInput(tuple(template.prompt_token_ids), tuple(sample.token_ids), SamplingTransform())
        with torch.no_grad():
            return float(token_logprobs(trainer.model, [inputs])[0].sum())

    before = [seq_logprob(i) for i in range(4)]
    trainer.run()
    after = [seq_logprob(i) for i in range(4)]
    assert after[0] - before[0] > 0.05  # the rewarded completion became more likely
    assert sum(after[1:]) < sum(before[1:])  # the others less
    rows = metrics(tmp_path)
    if extra.get("kl_coef"):
        assert rows[-1]["kl_ref"] > 0
    assert rows[0]["grad_norm"] > 0 and all(0 <= r["clip_rate"] <= 1 for r in rows)


def test_checkpoint_restores_weights_optimizer_version_and_dedupe_state(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    for i in range(2):
        queue.publish(group(reference_model, f"c{i}", seed=i))
    first = make_trainer(redis_url, tmp_path, steps=2, lr=1e-3)
    first.run()
    assert first.state.step == 2 and first.state.weight_version == 2
    second = make_trainer(redis_url, tmp_path, steps=3, lr=1e-3)
    assert (second.state.step, second.state.weight_version) == (2, 2)
    assert second.applied_ids == {f"c{i}/{j}" for i in range(2) for j in range(4)}
    for (name, a), (_, b) in zip(
        first.model.named_parameters(), second.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    sa, sb = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert (
        torch.equal(sa[0]["exp_avg"], sb[0]["exp_avg"]) and float(sa[0]["step"]) == float(sb[0]["step"]) == 2
    )
    queue.publish(group(reference_model, "c0"))  # a duplicate across the restart
    queue.publish(group(reference_model, "c2", seed=2))
    second.run()
    assert second.state.step == 3 and second.state.weight_version == 3
    assert second.state.duplicates_skipped_total == 1
    assert len(trained_ids(tmp_path)) == len(set(trained_ids(tmp_path))) == 12


def test_recomputed_old_logprobs_use_the_tokens_own_version(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "r0"))
    trainer = make_trainer(redis_url, tmp_path, steps=1, lr=1e-2, old_logprobs="recompute", max_lag=3)
    trainer.run()
    assert trainer.state.weight_version == 1 and trainer.history.versions() == [0, 1]
    old_group = group(reference_model, "r1", version=0, seed=5)  # sampled by version 0
    seqs = prepare(Batch(groups=[old_group]), trainer.config).sequences
    behaviour = torch.tensor([lp for s in seqs for lp in s.rollout_logprobs])
    recomputed, known = rescore_at_versions(
        trainer.old_model, trainer.history, seqs, behaviour, trainer.device
    )
    assert bool(known.all())  # version 0 is kept: every token was rescored at its own version
    assert torch.allclose(recomputed, behaviour, atol=1e-4)  # version-0 weights, not the current ones
    current, _ = token_logprobs(trainer.model, [s.inputs for s in seqs])
    assert (current.detach() - behaviour).abs().max() > 1e-3  # ... which do differ
    # The step reported backend mismatch at each token's own version, on every token.
    (row,) = metrics(tmp_path)
    assert row["at_version_token_frac"] == 1.0
    assert 0.0 <= row["mismatch_k3_at_version"] < 1e-8 and row["mismatch_max_abs_at_version"] < 1e-4


def test_the_at_version_mismatch_leaves_out_mixed_context_tokens(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    """A keep-mode update landed mid-sequence: the last tokens are tagged v1 but attended to KV
    computed at v0. The replay at v1 recomputes their context at v1 too, so they measure the
    update, not the backend: the at-version mismatch leaves them out (with them, k3 read the
    version change as backend error)."""
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "m0"))
    trainer = make_trainer(redis_url, tmp_path, steps=2, lr=1e-2, old_logprobs="recompute", max_lag=3)
    mixed = group(reference_model, "m1", version=0, seed=7)  # logprobs of the v0 weights
    for sample in mixed.samples:
        n = len(sample.token_ids)
        sample.token_weight_versions[:] = [0] * (n - 3) + [1] * 3  # tagged v1 ...
        sample.token_context_versions[:] = [0] * n  # ... over KV of v0
    mixed.max_weight_version = 1
    queue.publish(mixed)
    trainer.run()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["mismatch_k3_mixed_context"] is not None
    row = rows[1]
    n = len(mixed.samples[0].token_ids)
    assert row["at_version_token_frac"] == pytest.approx((n - 3) / n)  # the clean v0 tokens only
    assert 0.0 <= row["mismatch_k3_at_version"] < 1e-8, row["mismatch_k3_at_version"]


def test_each_version_is_rescored_over_the_sequences_that_hold_it(
    redis_url: str, tmp_path: Path, reference_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.own_version as own_version

    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "w0"))
    trainer = make_trainer(redis_url, tmp_path, steps=1, lr=1e-2, old_logprobs="recompute", max_lag=3)
    trainer.run()
    assert trainer.history.versions() == [0, 1]
    batch = Batch(
        groups=[
            group(reference_model, "a", version=0, seed=5),
            group(reference_model, "b", version=1, seed=6),
        ]
    )
    seqs = prepare(batch, trainer.config).sequences
    half = len(seqs[0].versions) // 2
    seqs[0].versions[half:] = [1] * (len(seqs[0].versions) - half)  # one sequence across the update
    behaviour = torch.tensor([lp for s in seqs for lp in s.rollout_logprobs])
    # What a forward of the whole chunk at each version gives, token by token.
    expected = behaviour.clone()
    versions = torch.tensor([v for s in seqs for v in s.versions])
    params = dict(trainer.old_model.lm.named_parameters())
    with torch.no_grad():
        for version in (0, 1):
            for name, tensor in trainer.history.get(version).items():
                params[name].copy_(tensor)
            whole, _ = token_logprobs(trainer.old_model, [s.inputs for s in seqs], with_entropy=False)
            expected[versions == version] = whole[versions == version]
    forwarded: list[int] = []
    real = own_version.token_logprobs

    def counted(model, sequences, **kw):
        forwarded.append(len(sequences))
        return real(model, sequences, **kw)

    monkeypatch.setattr(own_version, "token_logprobs", counted)
    recomputed, known = rescore_at_versions(
        trainer.old_model, trainer.history, seqs, behaviour, trainer.device
    )
    assert bool(known.all())
    # Equal up to the float32 rounding of another batch shape (a few ulps of logprobs near -4).
    assert torch.allclose(recomputed, expected, rtol=1e-6, atol=1e-6), (recomputed - expected).abs().max()
    # Version 0: group a (4 sequences); version 1: group b and the sequence across the update.
    assert forwarded == [4, 5], forwarded


def test_consume_train_and_publish_spans_link_to_the_producer(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from parity import tracing

    spans = InMemorySpanExporter()
    assert tracing.init("parity-trainer-test", exporter=spans)
    try:
        with tracing.span("publish", kind="producer"):
            traceparent = tracing.current_traceparent()
        RolloutQueue(redis_url, stream=STREAM).publish(
            group(reference_model, "traced"), traceparent=traceparent
        )
        make_trainer(redis_url, tmp_path).run()
        finished = {s.name: s for s in spans.get_finished_spans()}
    finally:
        tracing.shutdown()
    consume, step, publish = finished["consume"], finished["train_step"], finished["publish_version"]
    assert consume.kind == trace.SpanKind.CONSUMER
    assert [link.context.span_id for link in consume.links] == [finished["publish"].context.span_id]
    assert consume.attributes["parity.lag"] == 0 and consume.attributes["parity.tokens"] == 32
    assert step.attributes["parity.weight_version"] == 0 and step.attributes["parity.tokens"] == 32
    assert publish.attributes["parity.weight_version"] == 1


def test_without_checkpoints_the_consumed_stream_is_trimmed(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    """checkpoint_every 0 (the default): the replay floor follows what the trainer consumed, so a
    publisher's trim at maxlen removes trained entries; with the floor left at the start the stream
    grew for the whole run."""
    queue = RolloutQueue(redis_url, stream=STREAM, maxlen=2)
    for index in range(6):
        queue.publish(group(reference_model, f"t{index}", seed=index))
    trainer = make_trainer(redis_url, tmp_path, steps=6, checkpoint_every=0, on_mismatch="warn")
    for _ in range(6):  # the steps of `run`, without its final checkpoint (which sets the floor too)
        trainer.train_step(trainer.consumer.collect(1, trainer.state.weight_version, 2, lambda: False))
    assert queue.backlog() == 0
    queue.publish(group(reference_model, "t6", seed=6))  # over maxlen: trims what is safe
    assert queue.redis.xlen(STREAM) <= 2, queue.redis.xlen(STREAM)


def test_a_group_from_a_version_the_trainer_never_had_is_dropped_and_counted(
    redis_url: str, tmp_path: Path, reference_model
) -> None:
    """A fresh trainer (version 0) on a stream that still holds an earlier run's groups (version
    44): those are not this lineage's; they were admitted as if lag could be negative."""
    queue = RolloutQueue(redis_url, stream=STREAM)
    queue.publish(group(reference_model, "old-run", version=44))
    queue.publish(group(reference_model, "this-run", version=0, seed=1))
    trainer = make_trainer(redis_url, tmp_path, steps=1)
    trainer.run()
    assert sorted(trained_ids(tmp_path)) == [f"this-run/{i}" for i in range(4)]
    assert metrics(tmp_path)[0]["dropped_future_version"] == 1
