"""The one run config: a single source for every default, layered overrides, errors that name the key.

The launcher, the three services and `parity check` all load `ParityConfig`; these tests print the
effective config from each real entrypoint (subprocesses, clean environment) and compare them, and
hold docker-compose's config file to the same schema.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from parity.config import ConfigError, ParityConfig, env_for, load, to_toml, write_config
from parity.config.loader import config_env_keys

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINTS = {
    "run": ["run"],
    "rollout": ["serve", "rollout"],
    "trainer": ["serve", "trainer"],
    "broadcast": ["serve", "broadcast"],
    "check": ["check"],
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in config_env_keys(os.environ)}
    return {**env, **extra}


def _print_config(command: list[str], *flags: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "commands.main", *command, "--print-config", *flags],
        capture_output=True,
        text=True,
        env=env or _clean_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_launcher_services_and_check_print_one_and_the_same_default_config() -> None:
    printed = {name: _print_config(command) for name, command in ENTRYPOINTS.items()}
    expected = to_toml(ParityConfig(), {})
    for name, text in printed.items():
        assert text == expected, f"{name} prints a config that differs from the schema defaults"
    values = tomllib.loads(printed["run"])
    assert set(values) == {
        "model",
        "task",
        "run",
        "rollout",
        "trainer",
        "broadcast",
        "check",
        "observability",
    }
    # Values that once drifted apart between the launcher and the services now have one home each.
    assert values["task"]["group_size"] == 8 and values["run"]["groups_per_step"] == 4
    assert values["task"]["name"] == "arithmetic_final"
    assert "group_size" not in values["rollout"] and "groups_per_step" not in values["trainer"]
    # Every line names its source: all defaults here.
    lines = [line for line in printed["run"].splitlines() if " = " in line]
    assert lines and all(line.endswith("# default") for line in lines)


def test_print_config_names_the_source_of_every_overridden_value(tmp_path: Path) -> None:
    config_file = tmp_path / "run.toml"
    config_file.write_text('[trainer]\nlr = 1e-4\nobjective = "gspo"\n[task]\ngroup_size = 4\n')
    env = _clean_env(PARITY_TASK_GROUP_SIZE="6", PARITY_TRAINER_OBJECTIVE="ppo")
    text = _print_config(
        ["run"], "--config", str(config_file), "--task.group_size", "5", "--steps=3", env=env
    )
    values = tomllib.loads(text)
    assert values["trainer"]["lr"] == 1e-4 and values["trainer"]["objective"] == "ppo"
    assert values["task"]["group_size"] == 5 and values["run"]["steps"] == 3
    assert f"lr = 0.0001  # {config_file}" in text
    assert 'objective = "ppo"  # env PARITY_TRAINER_OBJECTIVE' in text
    assert "group_size = 5  # --task.group_size" in text and "steps = 3  # --steps" in text


@pytest.mark.parametrize(
    ("argv", "environ", "named"),
    [
        (
            ["--trainer.lrr", "1"],
            {},
            r"^trainer\.lrr: unknown key \(from --trainer\.lrr\); did you mean trainer\.lr\?",
        ),
        (["--trainr.lr", "1"], {}, r"^trainr: unknown section"),
        (["--bogus"], {}, r"^--bogus: unknown option"),
        (
            [],
            {"PARITY_ROLLOUT_BOGUS": "1"},
            r"^rollout\.bogus: unknown key \(from env PARITY_ROLLOUT_BOGUS\)",
        ),
        (["--steps", "0"], {}, r"^run\.steps: .*greater than or equal to 1 \(got '0'; from --steps\)"),
        (["--rollout.max_tokens_limit", "600"], {}, r"^rollout\.max_tokens_limit: must be < max_model_len"),
        (["--task.group_size", "20"], {}, r"^task\.group_size: must be <= rollout\.max_n=16"),
        (["--mode", "sync", "--rollout_workers", "3"], {}, r"^run\.groups_per_step: in sync mode"),
        (["--publish_every", "20"], {}, r"^run\.publish_every: must be <= run\.steps"),
        (["stray"], {}, r"^unexpected argument 'stray'"),
    ],
)
def test_bad_keys_and_values_are_errors_that_name_the_key(argv, environ, named) -> None:
    with pytest.raises(ConfigError, match=named):
        load(argv, home="run", environ=environ)


def test_unknown_key_in_a_file_is_named_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[rollout]\nprefix_cache = true\n")
    with pytest.raises(
        ConfigError, match=rf"^rollout\.prefix_cache: unknown key \(from {path}\); did you mean"
    ):
        load(["--config", str(path)], environ={})


def test_precedence_is_default_then_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[run]\nseed = 1\nsteps = 5\nmax_lag = 4\n")
    environ = {"PARITY_CONFIG": str(path), "PARITY_RUN_STEPS": "6", "PARITY_RUN_MAX_LAG": "3"}
    loaded = load(["--max_lag", "1"], home="trainer", environ=environ)
    run = loaded.config.run
    assert (run.seed, run.steps, run.max_lag, run.groups_per_step) == (1, 6, 1, 4)
    assert loaded.sources == {
        "run.seed": str(path),
        "run.steps": "env PARITY_RUN_STEPS",
        "run.max_lag": "--max_lag",
    }


def test_a_bare_flag_resolves_to_the_commands_own_section_first() -> None:
    trainer = load(
        ["--dtype", "bfloat16", "--model", "tiny", "--task", "arithmetic"], home="trainer", environ={}
    )
    assert trainer.config.trainer.dtype == "bfloat16" and trainer.config.rollout.dtype == "float32"
    assert trainer.config.model.name == "tiny" and trainer.config.task.name == "arithmetic"
    rollout = load(["--dtype", "bfloat16", "--prefix-caching"], home="rollout", environ={})
    assert rollout.config.rollout.dtype == "bfloat16" and rollout.config.rollout.prefix_caching is True


def test_secrets_are_never_printed_or_written(tmp_path: Path) -> None:
    environ = {"PARITY_TRAINER_AUTH_TOKEN": "tok-123", "PARITY_RUN_REDIS_URL": "redis://:pw-456@db:6379/0"}
    loaded = load([], environ=environ)
    assert loaded.config.trainer.auth_token == "tok-123"
    written = write_config(loaded.config, tmp_path / "config.toml").read_text()
    for text in (loaded.to_toml(), written):
        assert "tok-123" not in text and "pw-456" not in text
    assert "redis://:***@db:6379/0" in written and "auth_token: secret, set" in loaded.to_toml()


def test_a_child_reads_the_written_config_plus_its_instance_environment(tmp_path: Path) -> None:
    """What `parity run` hands a rollout service: the run's file, and its own id, index and token."""
    run = load(["--model", "tiny", "--steps", "3", "--trainer.lr", "2e-5"], home="run", environ={}).config
    path = write_config(run, tmp_path / "config.toml")
    environ = {
        "PARITY_CONFIG": str(path),
        **env_for("rollout", worker_id="rollout1", worker_index=1, auth_token="t"),
    }
    child = load([], home="rollout", environ=environ).config
    assert child.model_copy(update={"rollout": run.rollout}) == run
    assert (child.rollout.worker_id, child.rollout.worker_index, child.rollout.auth_token) == (
        "rollout1",
        1,
        "t",
    )
    assert child.engine_seed() == run.run.seed + 1
    with pytest.raises(ConfigError, match=r"rollout\.workr_id: unknown key"):
        env_for("rollout", workr_id="x")


def test_compose_config_file_restates_no_default_and_loads_for_every_service() -> None:
    path = ROOT / "infra" / "compose.toml"
    document = tomllib.loads(path.read_text())
    defaults = ParityConfig()
    for section, body in document.items():
        for name, value in body.items():
            default = getattr(getattr(defaults, section), name)
            assert value != default, f"infra/compose.toml restates the default {section}.{name} = {default!r}"
    for home in ("rollout", "trainer", "broadcast"):
        loaded = load([], home=home, environ={"PARITY_CONFIG": str(path)})
        assert loaded.config.rollout.dtype == "bfloat16" and loaded.config.run.steps == 200


def test_a_secret_is_refused_on_the_command_line() -> None:
    with pytest.raises(
        ConfigError, match=r"^trainer\.auth_token: a secret is never taken from the command line"
    ):
        load(["--trainer.auth_token", "tok"], environ={})
    assert load([], environ={"PARITY_TRAINER_AUTH_TOKEN": "tok"}).config.trainer.auth_token == "tok"
