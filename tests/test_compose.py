"""docker-compose.yml, the collector and Prometheus configs, the Dockerfile, and the health probe.

There is no Docker engine here, so the compose file is checked the way `docker compose config`
would: YAML (with merge keys) -> variable interpolation -> validation by a Compose-spec parser
(the `compose-spec` package, a strict Rust implementation of the Compose specification). The
service graph, GPU reservations, healthchecks and wiring are then asserted explicitly.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV = {"PARITY_AUTH_TOKEN": "test-token-0123456789", "PARITY_REDIS_PASSWORD": "test-redis-password"}
PARITY_SERVICES = {
    "broadcast": "BROADCAST",
    "trainer": "TRAINER",
    "rollout": "ROLLOUT",
    "rollout-2": "ROLLOUT",
}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose-style `${VAR}`, `${VAR:-default}`, `${VAR:?error}` and `$$` substitution."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3)
        current = env.get(name)
        missing = current is None or (op is not None and op.startswith(":") and current == "")
        if op in (":-", "-"):
            return arg if missing else current
        if op in (":?", "?"):
            if missing:
                raise KeyError(f"{name}: {arg}")
            return current
        return current or ""

    return _VAR.sub(sub, value)


def load_compose(env: dict[str, str] = ENV) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def test_compose_file_validates_against_the_compose_spec(compose) -> None:
    compose_spec = pytest.importorskip("compose_spec", reason="compose-spec (a dev dependency) is missing")
    parsed = compose_spec.PyCompose.from_json(json.dumps(compose))
    parsed.validate()  # every volume/network a service uses is declared
    assert set(parsed.service_names()) == set(compose["services"])
    # The validator is strict: a misspelt key or a bad depends_on condition is rejected.
    broken = json.loads(json.dumps(compose))
    broken["services"]["trainer"]["depends_on"]["redis"]["condition"] = "service_hot"
    with pytest.raises(ValueError, match="service_hot"):
        compose_spec.PyCompose.from_json(json.dumps(broken))
    broken = json.loads(json.dumps(compose))
    broken["services"]["rollout"]["gpu_reservation"] = True
    with pytest.raises(ValueError, match="gpu_reservation"):
        compose_spec.PyCompose.from_json(json.dumps(broken))


def test_compose_config_with_docker_cli_when_available() -> None:
    docker = shutil.which("docker") or shutil.which("docker-compose")
    if docker is None:
        pytest.skip("no docker CLI on this machine")
    cmd = [docker, "compose"] if docker.endswith("docker") else [docker]
    if subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("the docker CLI here has no compose plugin; the spec validation above covers it")
    done = subprocess.run(
        [*cmd, "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **ENV},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_required_secrets_come_from_the_environment() -> None:
    for name in ENV:
        with pytest.raises(KeyError, match=name):
            load_compose({k: v for k, v in ENV.items() if k != name})


def test_service_graph_and_startup_order(compose) -> None:
    services = compose["services"]
    assert set(services) == {
        "redis", "broadcast", "trainer", "rollout", "rollout-2", "otel-collector", "jaeger", "prometheus",
    }  # fmt: skip
    healthy = lambda name: {"condition": "service_healthy"}  # noqa: E731
    assert services["trainer"]["depends_on"] == {"redis": healthy("redis"), "broadcast": healthy("broadcast")}
    for rollout in ("rollout", "rollout-2"):
        assert services[rollout]["depends_on"] == {"broadcast": healthy("x"), "redis": healthy("x")}
    # Every service_healthy dependency has a healthcheck, and the graph has no cycle.
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck but {name} waits on it"
    order: list[str] = []

    def visit(name: str, stack: tuple[str, ...] = ()) -> None:
        assert name not in stack, f"dependency cycle {(*stack, name)}"
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*stack, name))
        if name not in order:
            order.append(name)

    for name in services:
        visit(name)
    assert order.index("redis") < order.index("trainer") and order.index("broadcast") < order.index("rollout")
    assert services["rollout-2"]["profiles"] == ["gpu2"], "extra GPUs are opt-in"


def nccl_group_gpus(compose: dict[str, Any]) -> dict[str, list[str]]:
    """GPU ids of every rank of the weight-sync NCCL group: the trainer (rank 0) and each rollout
    service. Raises if the topology rule is broken: two ranks on one GPU (NCCL: "Duplicate GPU
    detected"), a rank without exactly one GPU, or a GPU on the broadcast service (the control plane
    joins no group)."""
    services = compose["services"]
    reservations = {
        name: [
            device
            for device in service.get("deploy", {})
            .get("resources", {})
            .get("reservations", {})
            .get("devices", [])
            if "gpu" in device.get("capabilities", [])
        ]
        for name, service in services.items()
    }
    if reservations.get("broadcast"):
        raise AssertionError("broadcast: the control plane must not reserve a GPU")
    ranks = ["trainer", *sorted(n for n in services if n == "rollout" or n.startswith("rollout-"))]
    gpus: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for name in ranks:
        devices = reservations.get(name, [])
        if len(devices) != 1 or len(devices[0].get("device_ids", [])) != 1:
            raise AssertionError(f"{name}: a rank of the NCCL group needs exactly one GPU, has {devices}")
        gpus[name] = list(devices[0]["device_ids"])
        gpu = gpus[name][0]
        if gpu in owner:
            raise AssertionError(f"{owner[gpu]} and {name} share GPU {gpu}: two ranks of one NCCL group")
        owner[gpu] = name
    return gpus


def test_gpu_topology_no_two_ranks_of_the_nccl_group_share_a_gpu(compose) -> None:
    gpus = nccl_group_gpus(compose)
    assert gpus == {"trainer": ["0"], "rollout": ["1"], "rollout-2": ["2"]}
    for name in ("redis", "otel-collector", "jaeger", "prometheus", "broadcast"):
        assert "deploy" not in compose["services"][name]
    overridden = load_compose({**ENV, "PARITY_ROLLOUT_GPU": "3"})
    assert nccl_group_gpus(overridden)["rollout"] == ["3"]
    # the rule bites: a rollout service moved onto the trainer's GPU, or two rollouts on one GPU
    for env in ({"PARITY_ROLLOUT_GPU": "0"}, {"PARITY_ROLLOUT_2_GPU": "1"}):
        with pytest.raises(AssertionError, match="share GPU"):
            nccl_group_gpus(load_compose({**ENV, **env}))
    with_gpu = load_compose(ENV)
    with_gpu["services"]["broadcast"]["deploy"] = with_gpu["services"]["trainer"]["deploy"]
    with pytest.raises(AssertionError, match="broadcast"):
        nccl_group_gpus(with_gpu)


def test_parity_services_health_ipc_volumes_and_nccl(compose) -> None:
    for name, prefix in PARITY_SERVICES.items():
        service = compose["services"][name]
        env = service["environment"]
        test = service["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "parity.health"]
        # Rollout services bind (and register) their own DNS name; the others bind 0.0.0.0.
        host = name if prefix == "ROLLOUT" else "0.0.0.0"
        assert env[f"PARITY_{prefix}_HOST"] == host
        assert service.get("hostname", name) == name
        assert test[4] == f"{'127.0.0.1' if host == '0.0.0.0' else host}:{env[f'PARITY_{prefix}_PORT']}"
        assert service["ipc"] == "host"
        assert service["ulimits"]["memlock"] == -1
        assert "parity-data:/data" in service["volumes"]
        assert env["PARITY_HOME"].startswith("/data/")
        assert env["NCCL_SOCKET_IFNAME"] and env["GLOO_SOCKET_IFNAME"]
        assert env[f"PARITY_{prefix}_AUTH_TOKEN"] == ENV["PARITY_AUTH_TOKEN"]
        assert env["OTEL_SERVICE_NAME"] == f"parity-{prefix.lower()}"
    assert compose["services"]["trainer"]["environment"]["PARITY_TRAINER_RUN_DIR"].startswith("/data/")
    assert (
        compose["services"]["rollout"]["environment"]["PARITY_ROLLOUT_WORKER_ID"]
        != (compose["services"]["rollout-2"]["environment"]["PARITY_ROLLOUT_WORKER_ID"])
    )


def test_redis_has_aof_and_a_password_on_no_command_line(compose, tmp_path: Path) -> None:
    """The redis service's own command, run here (redis-server on PATH, the config file and the
    data in tmp_path, a free port): AOF on, the password required, and on no process's argv."""
    import redis as redis_py

    from parity.ports import free_port

    service = compose["services"]["redis"]
    assert service["command"][:2] == ["sh", "-c"] and "--appendonly yes" in service["command"][2]
    # redis-server soon rewrites its process title, so its argv is checked here as well as below
    assert "--requirepass" not in service["command"][2]
    assert service["environment"]["REDIS_PASSWORD"] == ENV["PARITY_REDIS_PASSWORD"]
    port = free_port()
    script = service["command"][2].replace("/tmp/redis.conf", str(tmp_path / "redis.conf"))
    script += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    password = "pw-" + os.urandom(8).hex()
    proc = subprocess.Popen(["sh", "-c", script], env={**os.environ, "REDIS_PASSWORD": password})
    try:
        client = redis_py.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis_py.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port, socket_timeout=5).ping()
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # exec: the shell became redis-server
        assert b"redis-server" in argv and password.encode() not in argv, argv
    finally:
        proc.terminate()
        proc.wait(30)
    for name in ("trainer", "rollout"):
        url = compose["services"][name]["environment"]["PARITY_RUN_REDIS_URL"]
        assert url == f"redis://:{ENV['PARITY_REDIS_PASSWORD']}@redis:6379/0"


def test_environment_names_real_config_keys_and_restates_no_default(compose) -> None:
    """Each PARITY_<SECTION>_<FIELD> variable is a key of the one config and is not its default (the
    defaults live in parity/config/ only); with infra/compose.toml every service's config loads."""
    from parity.config import ParityConfig, load
    from parity.config.loader import config_env_keys

    defaults = ParityConfig()
    raw = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    checked = 0
    for name, prefix in PARITY_SERVICES.items():
        env = {k: str(v) for k, v in compose["services"][name]["environment"].items()}
        # `${VAR:-default}`: set from the host's environment, which may well restate the default
        chosen = {k for k, v in raw[name]["environment"].items() if "${" in str(v)}
        assert env["PARITY_CONFIG"] == "/etc/parity/run.toml"
        assert "./infra/compose.toml:/etc/parity/run.toml:ro" in compose["services"][name]["volumes"]
        env["PARITY_CONFIG"] = str(ROOT / "infra" / "compose.toml")
        loaded = load([], home=prefix.lower(), environ=env)  # an unknown key would raise, naming it
        for key in config_env_keys(env):
            if key == "PARITY_CONFIG" or key in chosen:
                continue
            section, field = loaded.sources_key(key)
            default = getattr(getattr(defaults, section), field)
            assert getattr(getattr(loaded.config, section), field) != default, (
                f"{name}: {key} restates a default"
            )
        service = getattr(loaded.config, prefix.lower())
        service.check_security()  # not loopback, with the token: allowed
        assert service.host == env[f"PARITY_{prefix}_HOST"] and service.port == 50051
        assert service.metrics_port == 9100
        checked += 1
    assert checked == len(PARITY_SERVICES)


def rollout_services(compose: dict[str, Any], profiles: set[str]) -> list[str]:
    """The rollout services `docker compose --profile P ...` starts: those without a profile, and
    those with one of the enabled profiles."""
    return [
        name
        for name, service in compose["services"].items()
        if service.get("command") == ["serve", "rollout"]
        and (not service.get("profiles") or set(service["profiles"]) & profiles)
    ]


def test_the_trainer_awaits_every_rollout_service_the_file_starts() -> None:
    """trainer.await_workers is the number of rollout services up: 1 by default, 2 with the gpu2
    profile and PARITY_ROLLOUT_WORKERS=2 (docker-compose.yml's header)."""
    for profiles, env in (({"default"}, ENV), ({"gpu2"}, {**ENV, "PARITY_ROLLOUT_WORKERS": "2"})):
        compose = load_compose(env)
        awaited = int(compose["services"]["trainer"]["environment"]["PARITY_TRAINER_AWAIT_WORKERS"])
        assert awaited == len(rollout_services(compose, profiles)), (profiles, awaited)
    assert len(rollout_services(load_compose(), {"gpu2"})) == 2


def test_each_rollout_service_draws_its_own_share_of_the_prompts() -> None:
    """The actors partition the prompt stream: each rollout service has its own rollout.worker_index,
    0 to n-1, and run.rollout_workers n, the services the file starts (as the trainer awaits)."""
    from parity.config import load

    for profiles, env in (({"default"}, ENV), ({"gpu2"}, {**ENV, "PARITY_ROLLOUT_WORKERS": "2"})):
        compose = load_compose(env)
        names = rollout_services(compose, profiles)
        indexes = []
        for name in names:
            service_env = {k: str(v) for k, v in compose["services"][name]["environment"].items()}
            service_env["PARITY_CONFIG"] = str(ROOT / "infra" / "compose.toml")
            config = load([], home="rollout", environ=service_env).config
            assert config.run.rollout_workers == len(names), (name, profiles)
            indexes.append(config.rollout.worker_index)
        assert sorted(indexes) == list(range(len(names))), (profiles, dict(zip(names, indexes, strict=True)))


def test_collector_wires_otlp_receiver_to_jaeger(compose) -> None:
    collector = yaml.safe_load((ROOT / "infra" / "otel-collector.yaml").read_text())
    service = compose["services"]["otel-collector"]
    assert "./infra/otel-collector.yaml:/etc/otelcol/config.yaml:ro" in service["volumes"]
    assert "--config=/etc/otelcol/config.yaml" in service["command"]
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    grpc_endpoint = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc_endpoint == "0.0.0.0:4317"
    for processor in pipeline["processors"]:
        assert processor in collector["processors"]
    (jaeger_exporter,) = [e for e in pipeline["exporters"] if e.startswith("otlp")]
    endpoint = collector["exporters"][jaeger_exporter]["endpoint"]
    env_name = re.fullmatch(r"\$\{env:([A-Z_]+)\}", endpoint).group(1)
    host, port = service["environment"][env_name].split(":")
    assert host in compose["services"] and host == "jaeger" and port == "4317"
    assert compose["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    for name in PARITY_SERVICES:
        env = compose["services"][name]["environment"]
        assert env["OTEL_TRACES_EXPORTER"] == "otlp"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"


def test_prometheus_scrapes_every_service_metrics_port(compose) -> None:
    config = yaml.safe_load((ROOT / "infra" / "prometheus.yml").read_text())
    targets: dict[str, set[str]] = {}
    for job in config["scrape_configs"]:
        found = targets.setdefault(job["job_name"], set())
        for static in job.get("static_configs", []):
            found.update(static["targets"])
        for sd in job.get("dns_sd_configs", []):
            found.update(f"{name}:{sd['port']}" for name in sd["names"])
    expected = {
        f"{name}:{compose['services'][name]['environment'][f'PARITY_{prefix}_METRICS_PORT']}"
        for name, prefix in PARITY_SERVICES.items()
    }
    assert set().union(*targets.values()) == expected
    assert set(targets) == {"parity-rollout", "parity-trainer", "parity-broadcast"}


def test_dockerfile_uses_cuda_base_and_gpu_setup() -> None:
    dockerfile = (ROOT / "infra" / "Dockerfile").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+$", dockerfile, re.M)
    assert "FROM ${CUDA_IMAGE}" in dockerfile
    assert "PARITY_DEVICE=gpu" in dockerfile and "scripts/setup.sh" in dockerfile
    assert 'CMD ["python", "-m", "parity.health", "127.0.0.1:50051"]' in dockerfile
    assert 'ENTRYPOINT ["parity"]' in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \[.*"vllm', pyproject, re.M), "the gpu extra installs the vllm wheel"
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and not line.startswith("COPY --"):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


def test_the_example_configs_data_files_are_in_the_image() -> None:
    """A config mounted into the containers (examples/*.toml) reads its data from /app: the file
    must be in a directory the Dockerfile copies."""
    import tomllib

    copied = set()
    for line in (ROOT / "infra" / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and not line.startswith("COPY --"):
            copied.update(source.rstrip("/") for source in line.split()[1:-1])
    checked = 0
    for path in sorted((ROOT / "examples").glob("*.toml")):
        name = tomllib.loads(path.read_text()).get("task", {}).get("name", "")
        source, _, data = name.partition(":")
        if source in ("jsonl", "hf") and not data.startswith("/"):
            data = data.split(":")[0]
            assert (ROOT / data).exists(), (path.name, data)
            assert Path(data).parts[0] in copied, f"{path.name}: {data} is not in the image"
            checked += 1
    assert checked >= 1


def test_healthcheck_probe_exit_codes() -> None:
    """`python -m parity.health` exits 0 only for SERVING (real GrpcServer on loopback)."""
    from parity.config import ServiceConfig
    from parity.server import GrpcServer

    def probe(address: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "parity.health", address, "--timeout_s", "2"],
            capture_output=True,
            text=True,
            timeout=30,
        )

    async def scenario() -> list[subprocess.CompletedProcess]:
        server = GrpcServer(ServiceConfig(), [])
        port = await server.start()
        address = f"127.0.0.1:{port}"
        results = [await asyncio.to_thread(probe, address)]
        await server.set_serving(True)
        results.append(await asyncio.to_thread(probe, address))
        await server.stop(0)
        results.append(await asyncio.to_thread(probe, address))
        return results

    not_serving, serving, stopped = asyncio.run(scenario())
    assert (not_serving.returncode, serving.returncode, stopped.returncode) == (1, 0, 1)
    assert "NOT_SERVING" in not_serving.stdout and "SERVING" in serving.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "parity.health", "127.0.0.1:1", "--timeout_s", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2


def test_the_trainer_has_time_to_stop_gracefully(compose) -> None:
    """A stop finishes the step, publishes and checkpoints: compose waits longer than the agent waits
    for its ranks (compose's own default, 10 s, would SIGKILL it mid-checkpoint)."""
    from trainer.agent import SHUTDOWN_TIMEOUT_S

    grace = compose["services"]["trainer"]["stop_grace_period"]
    assert grace.endswith("s") and int(grace[:-1]) > SHUTDOWN_TIMEOUT_S, grace


def test_published_ports_bind_loopback_unless_told_otherwise() -> None:
    """The OTLP receiver, the Jaeger UI and Prometheus are published on 127.0.0.1 by default (an
    open OTLP port lets anyone write spans; the UIs show the run); PARITY_PUBLISH_HOST opens them."""
    published = {
        name: service.get("ports", [])
        for name, service in load_compose()["services"].items()
        if service.get("ports")
    }
    assert set(published) == {"otel-collector", "jaeger", "prometheus"}
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:") and str(port).count(":") == 2, (name, port)
    opened = load_compose({**ENV, "PARITY_PUBLISH_HOST": "0.0.0.0"})["services"]["jaeger"]["ports"]
    assert opened == ["0.0.0.0:16686:16686"]
