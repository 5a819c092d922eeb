"""The trainer service on two ranks (`--nproc 2`: torchrun, real gloo on CPU) against one rank.

- `parity serve trainer --nproc 2` re-launches itself under torchrun; rank 0 serves gRPC, reads
  the Redis stream and publishes through the real broadcast service to a stand-in worker; rank 1
  gets its share of each batch from rank 0 (tensors, no pickle). Two steps on the same rollouts
  as an in-process one-rank Trainer give the same loss, gradient norm and whole-batch metrics
  (within 1e-6) and the same checkpointed weights (the tolerance of tests/test_trainer_fsdp.py:
  1e-6 where the gradient is well above AdamW's eps); the worker serves exactly the checkpointed
  weights (its WSUM64 checksums), so rank 0 published the all-gathered full tensors.
- SIGTERM to the service's process group (a supervisor's stop) stops every rank after rank 0
  finishes: STOP reaches rank 1, both ranks wrote their checkpoint shards, and the service exits 0
  (`trainer.agent`: plain torchrun exits 1 after any signal).
- With `--after_last_step serve`, rank 0 stops rank 1 after the last step and stays SERVING past
  the collective timeout (rank 1 left waiting would fail its collective and end the service); rank
  1 stays up, idle, until the service is stopped.
- A gated mismatch (rollouts whose logprobs are shifted by one token) is localised by rank 0 alone,
  on its whole frozen copy, with the same report as one rank's (logprobs_shifted first).
- Killing rank 1 ends the service with a non-zero status and torchrun's report naming the rank,
  within seconds, instead of a hang; a rank dies with its agent (it lives in a session of its own,
  out of reach of a process-group stop).
Fast unit tests cover the wire encoding (exact round trip), the balance of shards, the merge of the
ranks' measurements, the config checks and the relaunch command (no config value or secret on it).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parity.procs import ServiceProcess
from parity.rollout_queue import RolloutQueue
from tests.conftest import config_for
from tests.fakes.synthetic_rollouts import make_group
from tests.fakes.trainer_helpers import metrics
from tests.listeners import listening, off_loopback
from tests.service_exit import exit_code
from trainer.policy import load_model

TOKEN = "multirank-token"
LR = 1e-3


@pytest.fixture(scope="module")
def groups(tiny_model: Path) -> list:
    model = load_model(tiny_model)
    gen = torch.Generator().manual_seed(3)
    rewards = [(1.0, 0.0, 0.0, 1.0), (0.0, 1.0, 1.0, 1.0), (0.0, 0.0, 0.0, 0.0), (1.0, 0.0, 1.0, 0.0)]
    # Completion lengths differ, and group 2 has no reward variance (scored forward-only), so the
    # ranks get unequal micro-batches of both kinds.
    return [
        make_group(model, f"g{i}", rewards[i], generator=gen, sample=False, completion_len=4 + 3 * i)
        for i in range(4)
    ]


def service_args(redis_url: str, stream: str, run_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", "tiny", "--redis_url", redis_url, "--stream", stream, "--run_dir", str(run_dir),
        "--groups_per_step", "2", "--micro_batch_size", "3", "--read_block_ms", "100", "--max_lag", "100",
        "--lr", str(LR), "--device", "cpu", "--dist_timeout_s", "60", "--nproc", "2", *extra,
    ]  # fmt: skip


def publish_to_both(redis_url: str, streams: tuple[str, str], groups: list) -> None:
    """The same rollouts in the two-rank service's stream and the one-rank trainer's."""
    for stream in streams:
        queue = RolloutQueue(redis_url, stream=stream)
        for group in groups:
            queue.publish(group)


def train_one_rank(redis_url: str, stream: str, run_dir: Path, steps: int, **extra: object) -> None:
    """An in-process one-rank Trainer with service_args' settings, run to `steps`."""
    from trainer.loop import Trainer

    one = Trainer(
        config_for(
            "trainer", model="tiny", redis_url=redis_url, stream=stream, run_dir=str(run_dir), steps=steps,
            groups_per_step=2, micro_batch_size=3, read_block_ms=100, max_lag=100, lr=LR, device="cpu", **extra,
        )
    )  # fmt: skip
    one.setup()
    one.run()
    one.close()


def checkpoint_weights(run_dir: Path, tiny_model: Path, step: int) -> dict[str, torch.Tensor]:
    from trainer.checkpoint import load_model_weights

    model = load_model(tiny_model)
    load_model_weights(model, run_dir / "checkpoints" / f"step_{step:08d}")
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def start_receiver(log_dir: Path, broadcast_address: str, *extra: str) -> ServiceProcess:
    port_file, log_path = log_dir / "w0.port", log_dir / "w0.log"
    cmd = [sys.executable, "-m", "tests.fakes.fake_receiver", "--broadcast_address", broadcast_address,
           "--worker_id", "w0", "--port_file", str(port_file), "--state_file", str(log_dir / "w0.json"), *extra]  # fmt: skip
    env = {**os.environ, "PARITY_AUTH_TOKEN": TOKEN}
    with open(log_path, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServiceProcess(name="w0", proc=proc, port_file=port_file, log_path=log_path)


@pytest.mark.slow
def test_two_rank_service_trains_like_one_rank_and_publishes_the_gathered_weights(
    redis_url: str, tmp_path: Path, start_services, groups: list, tiny_model: Path
) -> None:
    from parity.weights import checksum

    broadcast = start_services(
        "broadcast", "--auth_token", TOKEN, "--transfer_timeout_s", "20", name="broadcast", timeout_s=240
    )
    receiver = start_receiver(tmp_path, broadcast.address)
    try:
        receiver.wait_ready(240)
        two_dir, one_dir = tmp_path / "two", tmp_path / "one"
        publish_to_both(redis_url, ("mr:two", "mr:one"), groups)
        svc = start_services(
            "trainer",
            *service_args(redis_url, "mr:two", two_dir, "--steps", "3", "--checkpoint_every", "1"),
            "--broadcast_address", broadcast.address, "--auth_token", TOKEN, "--wait_committed_s", "20",
            name="trainer2", timeout_s=600,
        )  # fmt: skip
        # Two steps' rollouts for three steps: after step 2 (and its checkpoint) it waits for more;
        # then SIGTERM to its process group, as a supervisor stops it: a graceful stop of every rank.
        latest = two_dir / "checkpoints" / "LATEST"
        deadline = time.monotonic() + 120
        while not (latest.exists() and latest.read_text() == "step_00000002"):
            assert svc.proc.poll() is None and time.monotonic() < deadline, svc.log_tail(40)
            time.sleep(0.1)
        os.killpg(svc.proc.pid, signal.SIGTERM)
        assert exit_code(svc, 60) == 0, svc.log_tail(40)  # the agent ends as rank 0 did (trainer.agent)
        log = svc.log_path.read_text()
        assert "rank 1/2 ready" in log and "rank 1: stopped by rank 0 after 2 steps" in log, log[-3000:]
        assert "stopped by SIGTERM: rank 0 exited 0" in log, log[-3000:]
        shards = sorted((two_dir / "checkpoints" / "step_00000002" / "dcp").glob("*.distcp"))
        assert len(shards) == 2, shards  # each rank wrote its own

        train_one_rank(redis_url, "mr:one", one_dir, 2, checkpoint_every=1)

        rows_two, rows_one = metrics(two_dir), metrics(one_dir)
        assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one] == [1, 2]
        for two, ref in zip(rows_two, rows_one, strict=True):
            print(f"step {ref['step']}: loss 1 rank {ref['loss']!r}, 2 ranks {two['loss']!r}")
            # float32 summation order differs between one and two ranks (the head's chunks too):
            # measured 1.01e-6 on a loss of 0.0131, and 3.7e-7 on a loss of 2.2e-7 (GRPO's loss is
            # a sum of terms that cancel, so it can sit near 0 while its terms do not)
            assert math.isclose(two["loss"], ref["loss"], rel_tol=1e-4, abs_tol=2e-6), "loss"
            assert abs(two["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"]
            # Metrics of the whole batch, measured on two ranks and gathered on rank 0.
            for key in ("num_tokens", "trainable_tokens", "zero_variance_groups", "lag_hist"):
                assert two[key] == ref[key], key
            # Own-version mismatch (issue 17): rank 0 rescores stale tokens under the full weights
            # of their version, all-gathered from the shards when that version was published.
            for key in ("own_version_tokens", "own_version_rescored_tokens"):
                assert two[key] == ref[key], key
            for key in (
                "entropy",
                "kl_new_old",
                "clip_rate",
                "mismatch_k3",
                "policy_drift_k3",
                "policy_drift_max_abs",
                "mismatch_k3_own_version",
                "mismatch_max_abs_own_version",
            ):
                if ref[key] is None:  # nothing to measure (no lag-0 token at step 2)
                    assert two[key] is None, key
                else:
                    assert math.isclose(two[key], ref[key], rel_tol=1e-5, abs_tol=1e-6), key

        assert rows_two[1]["own_version_rescored_tokens"] > 0  # step 2 rescored v0 tokens under v0
        # After one step (the FSDP test's rule): 1e-6 wherever AdamW's first step moved the weight by
        # ~lr (gradient well above eps); eps-sized gradients turn summation-order noise into up to 2 lr.
        w0 = {name: p.detach() for name, p in load_model(tiny_model).named_parameters()}
        w2, w1 = checkpoint_weights(two_dir, tiny_model, 1), checkpoint_weights(one_dir, tiny_model, 1)
        worst, compared, total = 0.0, 0, 0
        for name in w1:
            diff = (w1[name] - w2[name]).abs()
            assert float(diff.max()) <= 2 * LR, name
            moved = (w1[name] - w0[name]).abs() >= 0.99 * LR
            if moved.any():
                worst = max(worst, float(diff[moved].max()))
            compared += int(moved.sum())
            total += diff.numel()
        print(f"after step 1: max |Δweight| {worst:.2e} over {compared} of {total} weights")
        assert worst <= 1e-6 and compared >= total // 2
        assert max(float((w1[n] - w0[n]).abs().max()) for n in w1) > 1e-4  # the step moved them
        # After step 2 the first step's eps-sized differences have entered the forward: almost every
        # weight still agrees within 1e-6, none by more than two AdamW steps.
        w2, w1 = checkpoint_weights(two_dir, tiny_model, 2), checkpoint_weights(one_dir, tiny_model, 2)
        close = sum(int(((w1[n] - w2[n]).abs() <= 1e-6).sum()) for n in w1)
        print(f"after step 2: {close} of {total} weights within 1e-6")
        assert close >= 0.99 * total
        assert max(float((w1[n] - w2[n]).abs().max()) for n in w1) <= 4 * LR

        state = json.loads((tmp_path / "w0.json").read_text())
        assert state["version"] == 2
        assert state["checksums"] == [str(m.checksum) for m in checksum.describe(list(w2.items()))]
    finally:
        receiver.stop(10)


@pytest.mark.slow
def test_followers_outlive_a_publish_longer_than_the_collective_timeout(
    redis_url: str, tmp_path: Path, start_services, groups: list
) -> None:
    # Publishing is rank 0's alone (the followers wait for the next command) and may take minutes
    # (a slow engine, retries). Rank 0's heartbeats keep rank 1 waiting: before them, rank 1 failed
    # its wait after dist_timeout_s and torchrun ended the service before the last checkpoint.
    timeout_s = 8
    broadcast = start_services(
        "broadcast", "--auth_token", TOKEN, "--transfer_timeout_s", "60", name="broadcast", timeout_s=240
    )
    receiver = start_receiver(tmp_path, broadcast.address, "--bucket_delay_s", "3.5")
    try:
        receiver.wait_ready(240)
        queue = RolloutQueue(redis_url, stream="slow:two")
        for group in groups[:2]:
            queue.publish(group)
        run_dir = tmp_path / "two"
        svc = start_services(
            "trainer", *service_args(redis_url, "slow:two", run_dir, "--steps", "1"),
            "--broadcast_address", broadcast.address, "--auth_token", TOKEN, "--wait_committed_s", "120",
            "--bucket_bytes", "262144", "--dist_timeout_s", str(timeout_s), name="trainer2", timeout_s=600,
        )  # fmt: skip
        assert exit_code(svc, 240) == 0, svc.log_tail(40)
        log = svc.log_path.read_text()
        assert "rank 1: stopped by rank 0 after 1 steps" in log, log[-3000:]
        # the publish outlasted the timeout twice over (the final checkpoint came after it)
        (seconds,) = re.findall(r"published version 1: [\d.]+ MB in ([\d.]+)s", log)
        print(f"publish of version 1: {seconds} s; dist_timeout_s {timeout_s}")
        assert float(seconds) > 2 * timeout_s, log[-3000:]
        assert (run_dir / "checkpoints" / "LATEST").read_text() == "step_00000001"
        assert json.loads((tmp_path / "w0.json").read_text())["version"] == 1
    finally:
        receiver.stop(10)


@pytest.mark.slow
def test_rank_0_localises_a_gated_mismatch_like_one_rank(
    redis_url: str, tmp_path: Path, start_services, groups: list
) -> None:
    # Step 1's rollouts carry an engine fault (token i reports token i+1's logprob). The gate (warn)
    # fires on two ranks and on one; rank 0 replays alone on its whole frozen copy while rank 1
    # waits, and names what one rank names.

    faulty = []
    for group in groups[:2]:
        copy = type(group)()
        copy.CopyFrom(group)
        for sample in copy.samples:
            sample.logprobs[:] = [*sample.logprobs[1:], sample.logprobs[-1]]
        faulty.append(copy)
    two_dir, one_dir = tmp_path / "two", tmp_path / "one"
    publish_to_both(redis_url, ("loc:two", "loc:one"), faulty)
    svc = start_services(
        "trainer", *service_args(redis_url, "loc:two", two_dir, "--steps", "1", "--check.on_mismatch", "warn"),
        name="trainer2", timeout_s=600,
    )  # fmt: skip
    assert exit_code(svc, 120) == 0, svc.log_tail(40)
    train_one_rank(redis_url, "loc:one", one_dir, 1, **{"check.on_mismatch": "warn"})
    reports = [json.loads((d / "mismatch_report.json").read_text()) for d in (two_dir, one_dir)]
    named = [[(c["fault"], round(c["score"], 3)) for c in r["candidates"][:3]] for r in reports]
    assert named[0] == named[1] and named[0][0][0] == "logprobs_shifted", named
    log = svc.log_path.read_text()
    assert "Localisation: " in log and "Most likely: logprobs_shifted" in log, log[-3000:]


@pytest.mark.slow
def test_two_ranks_serving_after_the_last_step_outlive_the_collective_timeout(
    redis_url: str, tmp_path: Path, start_services, groups: list
) -> None:
    # trainer.after_last_step serve (the Kubernetes overlays): rank 0 stays up after its last step.
    # Rank 1 must be stopped first: left waiting for a command, it would fail its collective after
    # dist_timeout_s, and torchrun would end the whole service.
    import grpc

    from parity import health
    from parity.v1 import trainer_pb2, trainer_pb2_grpc

    queue = RolloutQueue(redis_url, stream="serve:two")
    for group in groups[:2]:
        queue.publish(group)
    timeout_s = 20
    svc = start_services(
        "trainer", *service_args(redis_url, "serve:two", tmp_path / "two", "--steps", "1"),
        "--after_last_step", "serve", "--dist_timeout_s", str(timeout_s), name="trainer2", timeout_s=600,
    )  # fmt: skip
    with grpc.insecure_channel(svc.address) as chan:
        stub = trainer_pb2_grpc.TrainerServiceStub(chan)
        deadline = time.monotonic() + 120
        while not stub.GetStatus(trainer_pb2.TrainerServiceGetStatusRequest(), timeout=5).finished:
            assert svc.alive() and time.monotonic() < deadline, svc.log_tail(40)
            time.sleep(0.2)
        time.sleep(timeout_s + 5)
        assert svc.alive(), svc.log_tail(40)
        assert health.check(svc.address) == (True, "SERVING"), svc.log_tail(40)
        assert stub.GetStatus(trainer_pb2.TrainerServiceGetStatusRequest(), timeout=5).step == 1
    log = svc.log_path.read_text()
    assert "rank 1: stopped by rank 0 after 1 steps" in log, log[-3000:]
    # Rank 1 stays up too: an agent whose ranks all exited would end (in Kubernetes, a pod of
    # followers restarted into a rendezvous that can never complete).
    assert "rank 1: idle while rank 0 serves" in log and alive(rank_pids(svc.proc.pid)[1]), log[-3000:]
    # Nothing of the service listens off loopback: gRPC, the agent's rendezvous store, the ranks'
    # gloo sockets (trainer/local_rendezvous.py; torchrun's own store listens on every interface).
    pids = [svc.proc.pid, *rank_pids(svc.proc.pid).values()]
    assert len(pids) == 3 and all(listening(pid) for pid in pids[:2]), [listening(pid) for pid in pids]
    assert off_loopback(pids) == [], [listening(pid) for pid in pids]
    svc.signal(signal.SIGTERM)
    assert exit_code(svc, 60) == 0, svc.log_tail(40)  # rank 0's graceful stop, through trainer.agent


def rank_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the processes torchrun's agent (the service's pid, exec'd) started."""
    ranks = {}
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            ranks.update({int(e.split(b"=")[1]): int(child) for e in environ if e.startswith(b"RANK=")})
    return ranks


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_dies_with_its_agent(tmp_path: Path) -> None:
    """torchrun puts each rank in a session of its own, out of reach of a process-group stop: a
    rank must die with its parent (launch.die_with_agent, PR_SET_PDEATHSIG), or a SIGKILLed service
    would leave its ranks running. A stand-in agent (python) starts a rank (python) in a new session
    and is killed."""
    rank_pid_file = tmp_path / "rank.pid"
    rank = (
        "import os, time; from trainer import launch; launch.die_with_agent(); "
        f"open({str(rank_pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    agent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", agent], cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 30
    while not rank_pid_file.exists() or not rank_pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the rank did not start"
        time.sleep(0.05)
    rank_pid = int(rank_pid_file.read_text())
    assert os.getpgid(rank_pid) != os.getpgid(proc.pid) and alive(rank_pid)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    try:
        while alive(rank_pid):
            assert time.monotonic() < deadline, "the rank outlived its agent"
            time.sleep(0.05)
    finally:
        if alive(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)


@pytest.mark.slow
def test_killing_rank_1_ends_the_service_with_an_error_naming_it(
    redis_url: str, tmp_path: Path, start_services
) -> None:
    svc = start_services(
        "trainer", *service_args(redis_url, "mr:kill", tmp_path / "run", "--steps", "5"), timeout_s=600
    )
    ranks = rank_pids(svc.proc.pid)
    assert sorted(ranks) == [0, 1]
    killed_at = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    returncode = svc.proc.wait(60)
    took = time.monotonic() - killed_at
    log = svc.log_path.read_text()
    print(f"service exited {returncode} {took:.1f}s after rank 1 was killed")
    assert returncode != 0
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", log) and "Signal 9 (SIGKILL)" in log, log[-3000:]
    assert took < 45


# ---- fast unit tests -------------------------------------------------------------------------------
def _sequences(count: int):
    from parity.sampling import SamplingTransform
    from trainer.policy import SequenceInput
    from trainer.prepare import ScoredSequence

    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        n = 2 + i
        out.append(
            ScoredSequence(
                inputs=SequenceInput(
                    tuple(range(1, 3 + i)), tuple(range(50, 50 + n)), SamplingTransform(0.7, i, 0.9)
                ),
                rollout_logprobs=[float(x) for x in torch.randn(n, generator=gen).float()],
                versions=[i] * n,
                advantage=float(torch.randn(1, dtype=torch.float64, generator=gen)),
                trainable=i % 3 != 0,
                contexts=[max(0, i - 1)] * n,
                group_index=i // 2,
            )
        )
    return out


def test_sequences_cross_the_wire_exactly() -> None:
    from trainer import scatter

    sequences = _sequences(7)
    ints, floats = scatter.encode_sequences(sequences)
    assert ints.dtype == torch.int64 and floats.dtype == torch.float64
    assert scatter.decode_sequences(ints, floats) == sequences
    assert scatter.decode_sequences(*scatter.encode_sequences([])) == []


def test_shards_are_balanced_by_tokens_and_keep_every_sequence_once() -> None:
    from trainer import scatter

    sequences = _sequences(9)
    length = lambda s: len(s.inputs.prompt_ids) + len(s.inputs.completion_ids)  # noqa: E731
    shards = scatter.balance(sequences, 2, length)
    assert sorted(id(s) for shard in shards for s in shard) == sorted(id(s) for s in sequences)
    loads = [sum(length(s) for s in shard) for shard in shards]
    assert max(loads) - min(loads) <= max(length(s) for s in sequences)
    assert scatter.balance(sequences[:1], 3, length)[1:] == [[], []]  # fewer sequences than ranks


def test_the_ranks_measurements_merge_into_the_whole_batch() -> None:
    from trainer import scatter
    from trainer.stats import StepStats

    def stats(values: list[float], loss: float, clean: bool) -> StepStats:
        part = StepStats.empty()
        part.trainer_logprobs = torch.tensor(values)
        part.rollout_logprobs = torch.tensor(values) - 0.5
        part.clip = torch.tensor([True] * len(values))
        part.lags = torch.tensor([1] * len(values), dtype=torch.long)
        part.clean = torch.tensor([clean] * len(values), dtype=torch.bool)
        part.loss, part.nonfinite_tokens, part.train_forward_tokens = loss, 1, 7
        return part

    parts = [stats([-1.0, -2.0], 0.25, True), stats([], math.nan, False), stats([-3.0], 0.5, False)]
    encoded = [scatter.encode_stats(p) for p in parts]
    merged = scatter.decode_stats([p for p, _ in encoded], [n for _, n in encoded])
    assert merged.trainer_logprobs.tolist() == [-1.0, -2.0, -3.0]
    assert merged.rollout_logprobs.tolist() == [-1.5, -2.5, -3.5]
    assert merged.clip.tolist() == [1.0, 1.0, 1.0]
    assert merged.lags.tolist() == [1, 1, 1] and merged.clean.tolist() == [True, True, False]
    assert merged.lags.dtype == torch.long and merged.clean.dtype == torch.bool
    assert merged.loss == 0.75  # the rank that trained nothing adds no loss (its own is NaN)
    assert merged.nonfinite_tokens == 3 and merged.train_forward_tokens == 21
    assert merged.kl_ref.numel() == 0 and merged.at_version_trainer_logprobs is None


def test_every_step_statistic_crosses_the_wire() -> None:
    """The wire format derives from StepStats' fields: a field added there travels without a
    second list to update (each per-token field gets distinct values and must come back)."""
    from trainer import scatter
    from trainer.stats import StepStats, tensor_fields

    part = StepStats.empty()
    for index, name in enumerate(tensor_fields()):
        dtype = {"lags": torch.long, "clean": torch.bool}.get(name, torch.float32)
        setattr(part, name, torch.tensor([index + 1, index + 2]).to(dtype))
    payload, lengths = scatter.encode_stats(part)
    merged = scatter.decode_stats([payload], [lengths])
    for name in tensor_fields():
        assert torch.equal(getattr(merged, name), getattr(part, name)), name


def test_nproc_is_validated_naming_the_field() -> None:
    from parity.config import ConfigError

    assert config_for("trainer", nproc=4).trainer.nproc == 4
    for bad in ({"nproc": 0}, {"nproc": 2, "old_logprobs": "recompute"}):
        with pytest.raises(ConfigError, match="nproc"):
            config_for("trainer", **bad)


def test_the_relaunch_command_carries_no_config_and_no_secret(tmp_path: Path) -> None:
    from parity.config import load
    from trainer import launch

    environ = {
        "PARITY_TRAINER_AUTH_TOKEN": "tok-123",
        "PARITY_RUN_REDIS_URL": "redis://:pw-456@127.0.0.1:1/0",
    }
    config = load(
        ["--nproc", "2", "--lr", "0.0123", "--run_dir", str(tmp_path)], home="trainer", environ=environ
    ).config
    command = launch.torchrun_command(config.trainer.nproc)
    assert "--nproc-per-node=2" in command and command[-3:] == ["commands.main", "serve", "trainer"]
    assert not any("0.0123" in arg or "tok-123" in arg or "pw-456" in arg for arg in command)
    path = tmp_path / "config.toml"
    from parity.config.loader import write_config

    write_config(config, path)
    env = launch.child_environment(config, path)
    assert "tok-123" not in path.read_text() and "pw-456" not in path.read_text()
    assert env["PARITY_TRAINER_AUTH_TOKEN"] == "tok-123"
    assert env["PARITY_RUN_REDIS_URL"] == "redis://:pw-456@127.0.0.1:1/0"
    reloaded = load([], home="trainer", environ=env).config
    assert reloaded == config  # the ranks see exactly this process's config


def test_the_ranks_keep_a_flag_that_overrode_an_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from parity.config import load
    from parity.config.loader import write_config
    from trainer import launch

    monkeypatch.setenv("PARITY_TRAINER_LR", "1e-05")
    argv = ["--nproc", "2", "--lr", "3e-05", "--run_dir", str(tmp_path)]
    config = load(argv, home="trainer", environ=dict(os.environ)).config
    assert config.trainer.lr == 3e-05  # a flag beats the environment
    path = tmp_path / "config.toml"
    write_config(config, path)
    env = launch.child_environment(config, path)
    assert "PARITY_TRAINER_LR" not in env
    assert load([], home="trainer", environ=env).config.trainer.lr == 3e-05


def test_recompute_under_a_torchrun_of_its_own_is_refused_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """trainer.nproc stays 1 where the deployment starts torchrun itself (Kubernetes): the world size
    comes from its environment, and recompute, which several ranks do not support, is refused
    before any process group is joined."""
    from parity.config.base import ConfigError
    from trainer.build import build_models

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = config_for("trainer", model="tiny", old_logprobs="recompute").trainer
    with pytest.raises(ConfigError, match=r"^trainer\.old_logprobs: .*WORLD_SIZE=2"):
        build_models(config, seed=0, model_name="tiny")
