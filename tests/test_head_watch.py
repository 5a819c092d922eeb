"""The running head test (trainer/head_watch.py): the logit gaps between sibling samples' tokens at
shared contexts show a low-precision lm_head without any top logprobs; a run whose engine rounds its
logits to bf16 is stopped by it where the k3 gate cannot act, and a float32 run never is."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from commands.check.faults import run_fault
from parity.head_lattice import MIN_GAPS
from parity.v1 import common_pb2, rollouts_pb2
from trainer.head_watch import HeadWatch, sibling_gaps, sibling_rows
from trainer.mismatch_gate import MismatchGateError


def sample(tokens, logprobs, versions=None, contexts=None, mask=None) -> rollouts_pb2.RolloutSample:
    versions = versions if versions is not None else [0] * len(logprobs)
    return rollouts_pb2.RolloutSample(
        token_ids=tokens,
        logprobs=logprobs,
        token_weight_versions=versions,
        token_context_versions=contexts if contexts is not None else versions,
        loss_mask=mask or [],
    )


def group(*samples, temperature: float = 1.0) -> rollouts_pb2.RolloutGroup:
    return rollouts_pb2.RolloutGroup(
        samples=samples, sampling=common_pb2.SamplingParams(temperature=temperature)
    )


def test_rows_pair_only_tokens_sampled_at_one_shared_context() -> None:
    rows = sibling_rows(
        group(
            sample([5, 6, 7], [-1.0, -0.5, -2.0]),
            sample([5, 6, 8], [-1.0, -0.5, -3.0]),  # shares 5, 6 with the first: 7 vs 8 at depth 2
            sample([9, 1], [-1.5, -0.1]),  # differs at depth 0: 5 vs 9
            sample([5, 4], [-1.0, -0.7], versions=[0, 1]),  # 4 at depth 1, but at another version
        )
    )
    assert sorted(sorted(r) for r in rows) == [[-3.0, -2.0], [-1.5, -1.0]]
    # an episode counts up to its first environment token; a later one never pairs
    episode = sample([5, 6, 3, 3, 8], [-1.0, -0.5, -2.5], mask=[True, True, False, False, True])
    assert sibling_rows(group(sample([5, 6, 7], [-1.0, -0.5, -2.0]), episode)) == []
    assert sibling_rows(group(sample([5, 7], [-1.0, -2.0]), episode)) == [[-2.0, -0.5]]
    # greedy groups give nothing; gaps are taken times the temperature
    pair = (sample([1], [-1.0]), sample([2], [-1.25]))
    assert len(sibling_gaps([group(*pair, temperature=0.0)])) == 0
    assert sibling_gaps([group(*pair, temperature=2.0)]).tolist() == [0.5]


def sampled_groups(round_logits: bool, groups: int, seed: int) -> list[rollouts_pb2.RolloutGroup]:
    """Groups of 8 samples drawn from a toy model whose next-token logits at each context are fixed
    random float32 values (rounded to bf16 when `round_logits`), at temperature 0.8."""
    rng = np.random.default_rng(seed)
    temperature, vocab, length = 0.8, 50, 6
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def logprobs_at(context: tuple[int, ...]) -> np.ndarray:
        if context not in cache:
            z = torch.from_numpy(rng.normal(0.0, 3.0, vocab).astype(np.float32))
            z = z.bfloat16().float() if round_logits else z
            cache[context] = torch.log_softmax(z / temperature, -1).numpy()
        return cache[context]

    out = []
    for g in range(groups):
        samples = []
        for _ in range(8):
            tokens: list[int] = [g]  # the prompt: one token per group
            logprobs: list[float] = []
            for _ in range(length):
                lp = logprobs_at(tuple(tokens))
                p = np.exp(lp.astype(np.float64))
                token = int(rng.choice(vocab, p=p / p.sum()))
                tokens.append(token)
                logprobs.append(float(lp[token]))
            samples.append(sample(tokens[1:], logprobs))
        out.append(group(*samples, temperature=temperature))
    return out


def test_the_watch_finds_the_bf16_grid_and_none_in_float32_logits() -> None:
    bf16, fp32 = HeadWatch(True, "warn"), HeadWatch(True, "warn")
    few = bf16.observe([])  # nothing yet: not measured
    assert few["head_gaps"] == 0 and math.isnan(few["head_low_precision"])
    low = bf16.observe(sampled_groups(True, 6, seed=1))
    clean = fp32.observe(sampled_groups(False, 6, seed=1))
    assert low["head_gaps"] >= MIN_GAPS and clean["head_gaps"] >= MIN_GAPS
    assert low["head_low_precision"] == 1.0 and low["head_grid_exponent"] <= 6, low
    assert clean["head_low_precision"] == 0.0 and math.isnan(clean["head_grid_exponent"]), clean


def test_the_watch_stops_or_warns_only_where_a_float32_head_is_expected(caplog) -> None:
    groups = sampled_groups(True, 6, seed=2)
    stop = HeadWatch(True, "stop")
    stop.observe(groups)
    with pytest.raises(MismatchGateError, match=r"running head test at step 3: head precision: LOW"):
        stop.judge(3)
    warn = HeadWatch(True, "warn")
    warn.observe(groups)
    with caplog.at_level(logging.WARNING, logger="trainer.head_watch"):
        assert "LOW" in warn.judge(3) and warn.judge(4) == ""  # once per run
    bf16_configured = HeadWatch(False, "stop")  # rollout.head_dtype model under bf16: expected
    bf16_configured.observe(groups)
    assert bf16_configured.judge(3) == "" and bf16_configured.lattice.low_precision


def test_a_run_whose_engine_rounds_its_logits_is_stopped_by_the_head_test_alone(
    redis_url: str, tmp_path: Path, tiny_model: Path
) -> None:
    """In-process runs (real Trainer, Redis, two reference-engine workers): the k3 gate set where it
    cannot act (1.0), the engine's lm_head in bf16 from the start. The head test stops the run once
    its window holds enough gaps; the same run on a float32 head is never stopped."""
    import redis

    steps = 8
    control = run_fault(None, tiny_model, redis_url, tmp_path / "clean", steps=steps, threshold=1.0)
    assert control.caught_step is None and control.steps_run == steps, control
    rows = [json.loads(line) for line in (tmp_path / "clean" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["head_gaps"] >= MIN_GAPS and rows[-1]["head_low_precision"] == 0.0, rows[-1]
    redis.Redis.from_url(redis_url).flushall()
    caught = run_fault(
        "bf16_lm_head", tiny_model, redis_url, tmp_path / "bf16", steps=steps, inject_version=0, threshold=1.0
    )
    assert caught.caught_step is not None and caught.signal.startswith("head_grid_exponent="), caught
    rows = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["head_low_precision"] == 1.0 and rows[-1]["head_gaps"] >= MIN_GAPS, rows[-1]
    print(f"head test: stopped at step {caught.caught_step} ({caught.signal}); control: {control.signal}")
