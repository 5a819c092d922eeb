"""Fault classes (parity/faults.py, injected by rollout/faults.py) in an in-process run on the tiny
model (real Trainer, real Redis, two reference-engine workers): the running gate (k3 over
informative own-version tokens, gate_steps 1) stops the run at the first step that trains on a
faulty token, its localisation (trainer/mismatch_locate.py) names the class among its three most
likely and writes its report, and a clean control is never stopped."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from commands.check.faults import run_fault
from rollout.faults import FAULTS, MULTI_TURN_FAULTS, fault_from_env, parse_fault
from trainer.mismatch_gate import GATED_METRIC, MismatchGate, MismatchGateError
from trainer.mismatch_locate import MISMATCH_REPORT

# Version 1 is trained at step 2: step 1 is clean, step 2 the first step with faulty tokens.
STEPS, INJECT_VERSION, FIRST_FAULTY_STEP = 2, 1, 2


@pytest.fixture
def fresh_stream(redis_url: str):
    import redis

    redis.Redis.from_url(redis_url).flushall()
    return redis_url


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_clean_control_is_never_stopped(
    multi_turn: bool, fresh_stream: str, tmp_path: Path, tiny_model: Path
) -> None:
    result = run_fault(
        None, tiny_model, fresh_stream, tmp_path, steps=STEPS + 1, inject_version=INJECT_VERSION,
        multi_turn=multi_turn,
    )  # fmt: skip
    assert result.caught_step is None and result.steps_run == STEPS + 1, result
    # tiny: every step has informative tokens, so every step is measured
    assert f"({STEPS + 1} of {STEPS + 1} steps measured)" in result.signal, result
    assert not (tmp_path / f"{MISMATCH_REPORT}.json").exists()


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_is_caught_at_the_first_faulty_step(
    name: str, fresh_stream: str, tmp_path: Path, tiny_model: Path
) -> None:
    result = run_fault(name, tiny_model, fresh_stream, tmp_path, steps=STEPS, inject_version=INJECT_VERSION)
    assert result.injected_step == FIRST_FAULTY_STEP
    assert result.caught_step == FIRST_FAULTY_STEP, result
    assert "mismatch_k3_own_version_informative" in result.signal
    # Localised: the class is among the report's three most likely, and the report is written.
    assert name in result.likely, result
    report = json.loads((tmp_path / f"{MISMATCH_REPORT}.json").read_text())
    assert [c["fault"] for c in report["candidates"][:3]] == list(result.likely)
    assert (tmp_path / f"{MISMATCH_REPORT}.png").stat().st_size > 10_000
    assert f"Most likely: {result.likely[0]}" in result.where
    if name in MULTI_TURN_FAULTS:  # where: the later model turns, the first one clean
        turns = report["by_turn"]
        assert turns["first model turn"]["distance"] < 1e-5 < turns["later model turns"]["distance"], turns


def test_report_says_where_one_stale_worker_is(fresh_stream: str, tmp_path: Path, tiny_model: Path) -> None:
    result = run_fault(
        "one_worker_not_updated",
        tiny_model,
        fresh_stream,
        tmp_path,
        steps=STEPS,
        inject_version=INJECT_VERSION,
    )
    report = json.loads((tmp_path / f"{MISMATCH_REPORT}.json").read_text())
    by_worker = report["by_worker"]
    assert by_worker["worker-0"]["distance"] < 1e-6 < by_worker["worker-1"]["distance"]
    assert result.likely[0] == "one_worker_not_updated"
    assert "largest at worker worker-1" in result.where


def test_gate_appends_its_localisation_and_a_failing_one_does_not_hide_the_verdict() -> None:
    over = {GATED_METRIC: 5e-3}
    with pytest.raises(MismatchGateError, match="Localisation: here"):
        MismatchGate(1e-3, 1, "stop").observe(1, over, explain=lambda: "here")

    def broken() -> str:
        raise RuntimeError("no history")

    with pytest.raises(MismatchGateError, match=r"localisation failed: RuntimeError\('no history'\)"):
        MismatchGate(1e-3, 1, "stop").observe(1, over, explain=broken)
    assert "Localisation" not in MismatchGate(1e-3, 2, "warn").observe(1, over, explain=lambda: "here")


def test_fault_setting_is_refused_unless_fault_injection_is_enabled() -> None:
    assert fault_from_env(False, {}) is None
    with pytest.raises(ValueError, match=r"rollout\.enable_fault_injection"):
        fault_from_env(False, {"PARITY_FAULT": "raw_logprobs@3"})
    spec = fault_from_env(True, {"PARITY_FAULT": "raw_logprobs@3"})
    assert spec is not None and spec.fault.name == "raw_logprobs" and spec.start_version == 3
    assert not spec.active(2) and spec.active(3)
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        parse_fault("nope@1")
    with pytest.raises(ValueError, match="must be an integer"):
        parse_fault("raw_logprobs@x")


def test_catalogue_run_writes_its_table_and_passes_only_when_every_class_is_caught_and_named(
    tmp_path: Path,
) -> None:
    from commands.check.faults import passed, run_catalogue

    lines: list[str] = []
    results = run_catalogue(
        tmp_path, ["raw_logprobs", "stale_weights"], steps=2, inject_version=1, progress=lines.append
    )
    assert [r.fault for r in results] == ["clean (control)", "raw_logprobs", "stale_weights"]
    assert passed(results) and len(lines) == 3 and lines[1].startswith("[2/3] raw_logprobs: caught at step 2")
    table = (tmp_path / "faults.md").read_text()
    assert "| stale_weights | weight update | 2 | 2 |" in table and "**stale_weights**" in table
    assert len(json.loads((tmp_path / "faults.json").read_text())) == 3
    assert (tmp_path / "raw_logprobs" / f"{MISMATCH_REPORT}.png").exists()
    # A class caught but not named among the three most likely does not pass.
    named_wrong = [results[0], replace(results[1], likely=("rope_theta",))]
    assert not passed(named_wrong)
    with pytest.raises(ValueError, match=r"check\.fault_classes: unknown fault nope"):
        run_catalogue(tmp_path, ["nope"])


def test_parity_check_faults_refuses_the_engine_flags() -> None:
    from commands.check.check import main

    assert main(["--faults", "--ablate"]) == 2


def test_running_gate_threshold_follows_the_numerics_unless_set() -> None:
    from parity.config import ParityConfig
    from trainer.mismatch_gate import FLOAT32_THRESHOLD, REDUCED_PRECISION_THRESHOLD, running_threshold

    def threshold(**sections) -> tuple[float, str]:
        return running_threshold(ParityConfig.model_validate({"model": {"name": "tiny"}, **sections}))

    assert threshold() == (FLOAT32_THRESHOLD, "default for float32 rollouts and trainer")
    value, why = threshold(rollout={"dtype": "bfloat16"})
    assert value == REDUCED_PRECISION_THRESHOLD and "rollout.dtype bfloat16" in why
    value, why = threshold(trainer={"precision": "bf16"})
    assert value == REDUCED_PRECISION_THRESHOLD and "trainer.precision bf16" in why
    assert threshold(rollout={"dtype": "bfloat16"}, check={"gate_threshold": 3e-4}) == (
        3e-4,
        "check.gate_threshold",
    )
    assert ParityConfig.model_validate({"model": {"name": "tiny"}}).check.gate_steps == 1
    assert "no preflight k3" in why
    bf16 = ParityConfig.model_validate({"model": {"name": "tiny"}, "rollout": {"dtype": "bfloat16"}})
    value, why = running_threshold(bf16, 2.61e-4)  # 10x of it is under the default: the default
    assert value == REDUCED_PRECISION_THRESHOLD and "the preflight's k3 2.61e-04 is lower" in why
    assert running_threshold(bf16, 3e-2) == (
        pytest.approx(0.3),
        "10x the preflight's k3 3.00e-02 (rollout.dtype bfloat16)",
    )


def test_with_bf16_parity_run_calibrates_the_running_gate_on_its_preflight() -> None:
    from commands.run.launcher import gate_env
    from parity.config import ParityConfig
    from trainer.mismatch_gate import GATE_MARGIN

    def config(**sections) -> ParityConfig:
        return ParityConfig.model_validate({"model": {"name": "tiny"}, **sections})

    preflight = {"ran": True, "report": {"rows": [{"stats": {"k3": 3e-2}}]}}
    env = gate_env(config(rollout={"dtype": "bfloat16"}), preflight)
    assert float(env["PARITY_CHECK_GATE_THRESHOLD"]) == pytest.approx(GATE_MARGIN * 3e-2)
    quiet = {"ran": True, "report": {"rows": [{"stats": {"k3": 7e-4}}]}}  # 10x of it is under 1e-1
    assert gate_env(config(rollout={"dtype": "bfloat16"}), quiet) == {}
    assert gate_env(config(), preflight) == {}  # float32: the fixed 1e-6, not the preflight's
    assert gate_env(config(rollout={"dtype": "bfloat16"}), {"ran": False}) == {}  # the trainer's 1e-1
    assert gate_env(config(rollout={"dtype": "bfloat16"}, check={"gate_threshold": 5e-3}), preflight) == {}


def test_parity_check_faults_runs_the_chosen_classes_on_the_chosen_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commands.check.check import main

    out = tmp_path / "faults"
    rc = main(
        ["--faults", "--fault_classes", "raw_logprobs", "--fault_model", "tiny", "--check.out", str(out)]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "in-process runs on tiny (check.fault_model)" in printed
    assert [r["fault"] for r in json.loads((out / "faults.json").read_text())] == [
        "clean (control)",
        "raw_logprobs",
    ]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--fault_classes", "raw_logprobs,nope"], "check.fault_classes: unknown fault nope"),
        (["--fault_model", "/nonexistent/model"], "check.fault_model:"),
    ],
    ids=["unknown-class", "unknown-model"],
)
def test_parity_check_faults_names_a_bad_class_or_model(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from commands.check.check import main

    assert main(["--faults", *flags, "--check.out", str(tmp_path / "faults")]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "faults").exists()  # refused before any run
