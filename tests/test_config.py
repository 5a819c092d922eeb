"""The one run config: a single source for every default, layered overrides, errors that name the key.

The launcher, the three services and `parity check` all load `ParityConfig`; these tests print the
effective config from each real entrypoint (subprocesses, clean environment) and compare them, and
hold docker-compose's config file to the same schema.
"""

from __future__ import annotations

import json
import os
import re
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
        (["--dtype", "bfloat16"], {}, r"^--dtype: ambiguous.*use --rollout\.dtype or --trainer\.dtype"),
        (["--stpes", "3"], {}, r"^--stpes: unknown option; did you mean --steps\?"),
        (["--dtyp", "x"], {}, r"did you mean --rollout\.dtype or --trainer\.dtype\?"),
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


def test_a_redis_url_with_a_password_is_refused_on_the_command_line() -> None:
    url = "redis://:hunter2@127.0.0.1:6379/0"
    # redis-py also reads a password from the query string; a socket URL has no user part at all
    in_query = ("redis://127.0.0.1:6379/0?password=hunter2", "unix:///tmp/r.sock?db=0&Password=hunter2")
    for argv in (["--redis_url", url], [f"--run.redis_url={url}"], *(["--redis_url", q] for q in in_query)):
        with pytest.raises(
            ConfigError, match=r"^run\.redis_url: a secret is never taken from the command line"
        ):
            load(argv, home="trainer", environ={})
    endpoint = "https://user:hunter2@collector:4318"
    with pytest.raises(ConfigError, match=r"^observability\.otlp_endpoint: a secret is never taken"):
        load(["--observability.otlp_endpoint", endpoint], home="trainer", environ={})
    assert load([], environ={"PARITY_RUN_REDIS_URL": url}).config.run.redis_url == url
    plain = "redis://127.0.0.1:6379/0"  # no password: a flag is fine
    assert load(["--redis_url", plain], home="trainer", environ={}).config.run.redis_url == plain


@pytest.mark.parametrize(
    ("home", "argv", "key", "value"),
    [
        ("run", ["--max_tokens", "9"], "task.max_tokens", 9),  # a documented shorthand of `parity run`
        ("rollout", ["--temperature", "0.9"], "task.temperature", 0.9),
        ("check", ["--max_tokens", "9"], "check.max_tokens", 9),  # `parity check`'s own section
        ("trainer", ["--dtype", "bfloat16"], "trainer.dtype", "bfloat16"),
        ("run", ["--lr", "1e-4"], "trainer.lr", 1e-4),  # only one section has it
    ],
)
def test_bare_flags_follow_the_commands_shorthands_then_its_section_then_the_one_owner(
    home, argv, key, value
) -> None:
    section, _, name = key.partition(".")
    config = load(argv, home=home, environ={}).config
    assert getattr(getattr(config, section), name) == value


def test_parity_run_refuses_flags_for_the_keys_it_sets_for_each_child() -> None:
    with pytest.raises(ConfigError, match=r"^trainer\.run_dir: set by `parity run` itself.*use --out"):
        load(["--trainer.run_dir", "x"], home="run", environ={}, as_command=True)
    with pytest.raises(ConfigError, match=r"^check\.max_tokens: set by `parity run` itself"):
        load(["--check.max_tokens", "8"], home="run", environ={}, as_command=True)
    with pytest.raises(
        ConfigError, match=r"^trainer\.await_workers: set by `parity run` itself.*rollout_workers"
    ):
        load(["--trainer.await_workers", "0"], home="run", environ={}, as_command=True)
    for argv in (["--trainer.after_last_step", "serve"], ["--max_groups", "1"]):  # a run that never ends
        with pytest.raises(ConfigError, match=r"set by `parity run` itself"):
            load(argv, home="run", environ={}, as_command=True)
    # the same keys are a service's own options
    assert load(["--run_dir", "x"], home="trainer", environ={}, as_command=True).config.trainer.run_dir == "x"


def test_repeated_config_files_layer_in_order(tmp_path: Path) -> None:
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text("[run]\nseed = 1\nsteps = 5\n[trainer]\nlr = 1e-4\n")
    second.write_text("[run]\nsteps = 7\n")
    loaded = load(["--config", str(first), f"--config={second}"], home="run", environ={})
    run = loaded.config.run
    assert (run.seed, run.steps, loaded.config.trainer.lr) == (1, 7, 1e-4)
    assert loaded.sources == {"run.seed": str(first), "run.steps": str(second), "trainer.lr": str(first)}


def test_a_secret_in_a_config_file_is_refused_naming_the_key_and_its_variable(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[broadcast]\nauth_token = "tok"\n')
    with pytest.raises(
        ConfigError,
        match=r"^broadcast\.auth_token: a secret is never taken from a config file .*"
        r"set PARITY_BROADCAST_AUTH_TOKEN in the environment",
    ):
        load(["--config", str(path)], home="broadcast", environ={})


def test_wiring_variables_that_name_no_key_are_not_config_and_are_listed(tmp_path: Path) -> None:
    """docker-compose.yml's PARITY_TRAINER_GPU / PARITY_RUN_NAME once failed `parity run`."""
    environ = {
        "PARITY_TRAINER_GPU": "0",
        "PARITY_RUN_NAME": "exp1",
        "PARITY_ROLLOUT_2_GPU": "2",
        "PARITY_TRAINER_LRR": "1",
        "PARITY_TRAINER_LR": "1e-4",
    }
    loaded = load([], home="run", environ=environ)
    assert loaded.config.trainer.lr == 1e-4
    assert set(config_env_keys(environ)) == {"PARITY_TRAINER_LR"}
    assert loaded.ignored_env == {
        "PARITY_TRAINER_GPU": "",
        "PARITY_RUN_NAME": "",
        "PARITY_ROLLOUT_2_GPU": "",
        "PARITY_TRAINER_LRR": "PARITY_TRAINER_LR",
    }
    text = loaded.to_toml()
    assert "#   PARITY_TRAINER_LRR (did you mean PARITY_TRAINER_LR?)" in text
    assert "#   PARITY_RUN_NAME\n" in text and tomllib.loads(text)["trainer"]["lr"] == 1e-4
    # the real command, with compose's wiring in its environment
    printed = _print_config(["run"], env=_clean_env(PARITY_TRAINER_GPU="0", PARITY_RUN_NAME="exp1"))
    assert "PARITY_TRAINER_GPU" in printed


def test_resume_with_print_config_prints_the_resumed_runs_config(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stored = load(["--seed", "1", "--steps", "6", "--model", "tiny"], home="run", environ={}).config
    write_config(stored, run_dir / "config.toml")
    text = _print_config(["run"], "--resume", str(run_dir), "--steps", "9")
    values = tomllib.loads(text)
    assert values["run"]["seed"] == 1 and values["model"]["name"] == "tiny"  # from the run's config.toml
    assert values["run"]["steps"] == 9 and "steps = 9  # --steps" in text  # the command line on top
    assert f"seed = 1  # {run_dir / 'config.toml'}" in text
    missing = subprocess.run(
        [sys.executable, "-m", "commands.main", "run", "--resume", str(tmp_path / "none"), "--print-config"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert missing.returncode == 2 and "run.resume:" in missing.stderr and "no config.toml" in missing.stderr


def test_resume_of_a_run_whose_first_launch_died_before_its_config_names_the_first_command(
    tmp_path: Path,
) -> None:
    from commands.run import records
    from commands.run.resume import ResumeError, plan

    # run.json as a launcher writes it first; this process is its launcher, not a live other one
    records.start(tmp_path, 6, ["--seed", "1", "--out", str(tmp_path)], resumed_from_step=None, overrides={})
    with pytest.raises(ResumeError) as refused:
        plan(tmp_path, ["--resume", str(tmp_path)])
    assert "no config.toml" in str(refused.value)
    assert f"parity run --seed 1 --out {tmp_path}" in str(refused.value)


EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_config_loads_as_a_valid_run_config(path: Path) -> None:
    loaded = load(["--config", str(path)], home="run", environ={})
    assert loaded.sources, f"{path.name} sets nothing"
    for home in ("rollout", "trainer", "broadcast"):  # the services of a deployment read it too
        load([], home=home, environ={"PARITY_CONFIG": str(path)})


def test_the_examples_cover_cpu_one_gpu_eight_gpus_and_a_custom_task() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"cpu_demo.toml", "one_gpu.toml", "eight_gpus.toml", "custom_task.toml"} <= names
    one_gpu = load(["--config", str(ROOT / "examples" / "one_gpu.toml")], environ={}).config
    assert one_gpu.model.name == "Qwen/Qwen2.5-1.5B-Instruct" and one_gpu.rollout.dtype == "bfloat16"
    # The recipe leaves room on each rollout GPU for a whole float32 version staged by NCCL:
    # 1.5B parameters x 4 bytes beside vLLM's share of an 80 GB card, with the size check's headroom.
    eight = load(["--config", str(ROOT / "examples" / "eight_gpus.toml")], environ={}).config
    staged_gb = 1.54e9 * 4 / 1e9
    assert eight.model.name == "Qwen/Qwen2.5-1.5B-Instruct"
    assert (1 - eight.rollout.gpu_memory_utilization) * 80 * 0.9 > 1.5 * staged_gb
    custom = load(["--config", str(ROOT / "examples" / "custom_task.toml")], environ={}).config
    task_file = custom.task.name.removeprefix("jsonl:")
    assert custom.task.name.startswith("jsonl:") and (ROOT / task_file).exists()


@pytest.mark.parametrize(("value", "bound"), [("0", "greater than 0"), ("1.5", "less than or equal to 1")])
def test_gpu_memory_utilization_is_a_fraction_named_when_refused(value: str, bound: str) -> None:
    assert load([], home="run", environ={}).config.rollout.gpu_memory_utilization == 0.9
    half = load(["--rollout.gpu_memory_utilization", "0.5"], home="run", environ={}).config
    assert half.rollout.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError, match=rf"^rollout\.gpu_memory_utilization: .*{bound}"):
        load(["--rollout.gpu_memory_utilization", value], home="run", environ={})


def test_written_configs_and_records_never_hold_a_url_password() -> None:
    from commands.run.launcher import _public_config
    from parity.config.loader import to_toml
    from parity.url_secrets import redact_url, url_password

    urls = {
        "redis://:pw1secret@h:1/0": "redis://:***@h:1/0",
        "redis://h:1/0?password=pw2secret&db=1": "redis://h:1/0?password=***&db=1",
        "https://u:pw3secret@collector:4318": "https://u:***@collector:4318",
    }
    for url, redacted in urls.items():
        assert url_password(url) and redact_url(url) == redacted
    assert url_password("redis://h:1/0?db=1") is None and url_password("not a url") is None
    environ = {
        "PARITY_RUN_REDIS_URL": "redis://h:1/0?password=pw2secret",
        "PARITY_OBSERVABILITY_OTLP_ENDPOINT": "https://u:pw3secret@collector:4318",
    }
    config = load([], home="run", environ=environ).config
    for text in (to_toml(config), json.dumps(_public_config(config))):
        assert "pw2secret" not in text and "pw3secret" not in text, text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--startup_timeout_s", "inf"], "run.startup_timeout_s"),
        (["--trainer.dist_timeout_s", "nan"], "trainer.dist_timeout_s"),
        (["--lr", "1e999"], "trainer.lr"),
        (["--task.temperature", "inf"], "task.temperature"),
    ],
)
def test_infinite_and_nan_settings_are_refused_naming_the_key(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(named)}: Input should be a finite number"):
        load(argv, home="run", environ={}, as_command=True)


def test_the_cpu_kv_cache_is_whole_gib_as_vllm_reads_it() -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.kv_cache_gib: .*integer"):
        load(["--rollout.kv_cache_gib", "0.4"], home="rollout", environ={})
    assert load(["--rollout.kv_cache_gib", "2"], home="rollout", environ={}).config.rollout.kv_cache_gib == 2


def test_an_empty_resume_is_refused_not_a_new_run() -> None:
    for argv in (["--resume", ""], ["--resume=  "]):
        with pytest.raises(ConfigError, match=r"^run\.resume: empty"):
            load(argv, home="run", environ={}, as_command=True)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "utf16.toml"
    path.write_bytes("[run]\nsteps = 3\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"utf16\.toml: not UTF-8 text"):
        load(["--config", str(path)], home="run", environ={})


def test_check_max_tokens_must_fit_the_engines_context() -> None:
    with pytest.raises(ConfigError, match=r"^check\.max_tokens: must be <= 511"):
        load(["--max_tokens", "600"], home="check", environ={}, as_command=True)
    assert (
        load(
            ["--max_tokens", "600", "--max_model_len", "1024"], home="check", environ={}
        ).config.check.max_tokens
        == 600
    )


@pytest.mark.parametrize(
    ("home", "argv", "named"),
    [
        ("rollout", ["--broadcast_address", "broadcast.svc"], "rollout.broadcast_address"),
        ("check", ["--rollout_address", "rollout.svc"], "check.rollout_address"),
        ("trainer", ["--broadcast_address", ":99999999"], "trainer.broadcast_address"),
        ("trainer", ["--broadcast_address", "h:0"], "trainer.broadcast_address"),
    ],
)
def test_every_address_setting_must_be_host_and_port(home: str, argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{re.escape(named)}: must be host:port"):
        load(argv, home=home, environ={})


def test_addresses_that_are_host_and_port_load() -> None:
    for value in ("broadcast:50051", "[::1]:5000", "10.0.0.2:1"):
        assert (
            load(["--broadcast_address", value], home="rollout", environ={}).config.rollout.broadcast_address
            == value
        )


def test_a_misspelt_section_or_a_missing_one_in_a_variable_gets_a_suggestion() -> None:
    environ = {"PARITY_TRAINR_LR": "1", "PARITY_STEPS": "3", "PARITY_IMAGE": "x", "PARITY_AUTH_TOKEN": "t"}
    ignored = load([], home="run", environ=environ).ignored_env
    assert ignored.get("PARITY_TRAINR_LR") == "PARITY_TRAINER_LR"
    assert ignored.get("PARITY_STEPS") == "PARITY_RUN_STEPS"
    assert "PARITY_IMAGE" not in ignored  # compose's wiring: nothing close, nothing said


def test_a_toml_boolean_for_a_number_or_a_number_for_a_switch_is_refused(tmp_path: Path) -> None:
    for body, message in (
        (
            "[run]\nsteps = true\n",
            r"^run\.steps: expected a value of its own type, not true/false \(got true",
        ),
        ("[run]\nskip_preflight = 1\n", r"^run\.skip_preflight: expected true or false \(got 1"),
    ):
        path = tmp_path / "run.toml"
        path.write_text(body)
        with pytest.raises(ConfigError, match=message):
            load(["--config", str(path)], home="run", environ={})
    path.write_text("[run]\nskip_preflight = true\nsteps = 4\n")
    run = load(["--config", str(path)], home="run", environ={}).config.run
    assert (run.skip_preflight, run.steps) == (True, 4)


def test_an_empty_config_path_is_named_as_such() -> None:
    for argv in (["--config="], ["--config", ""]):
        with pytest.raises(ConfigError, match=r"^--config: expected a TOML file path, got an empty one"):
            load(argv, home="run", environ={})
