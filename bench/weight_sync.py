"""Weight-sync benchmark: an end-to-end update (weight sync v2) vs a raw gloo broadcast.

    python bench/weight_sync.py                      # SmolLM2-135M (fp32, ~538 MB) + a 1 GiB random model
    python bench/weight_sync.py --large_mb 0 --repeats 5 --vllm_updates 0

For each model, in the same run and on the same machine:
- raw:  one bucketed gloo broadcast (pre-faulted buffers) of the same bytes from this process to
        `--receivers` receiver processes, timed until the last one holds every byte: the floor for
        moving these bytes with torch.distributed's own broadcast (the goal's baseline);
- raw chain: the same bytes over the data plane's gloo algorithm (parity.weights.wire "chain": rank 0
        to rank 1, which forwards each bucket to rank 2 as it lands), with no service, checksum or
        swap: e2e / raw chain is what the protocol costs over its own wire;
- e2e:  this process is the trainer: PublishVersion(v) to a real broadcast service (the control
        plane), the bytes straight to the workers over the epoch's data group (held across
        versions; a chain on gloo), and the clock stops when every worker has received, verified every checksum,
        paused, swapped and resumed (WaitVersion DISTRIBUTED). Workers are stand-in rollout workers
        (tests/fakes/fake_receiver.py: the real worker's receiver, no engine);
- stall: the longest paused time a worker reported for that update (workers receive and verify
        while generating, and pause only for the swap);
- trainer cost: publish + send, i.e. until the trainer may train again.
Then, for SmolLM2 only, a real vLLM rollout service (`parity serve rollout`) is the worker while four
clients keep it generating (`--vllm_updates`, 0 skips it): its e2e, its stall, and its generation
rate during updates vs before them, once per swap mode (`--vllm_swap prepared,in_place`: the
rollout.prepared_swap option on, the default, and off), so the two are compared in the same run.
Raw and e2e rounds alternate, and each ratio is the median of per-round ratios, so background load
on a shared host hits both alike. It also measures WSUM64 checksum cost (ms per 100 MB).
Goals: e2e / raw <= 1.2 and stall / raw <= 1.5. The final stdout line is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from parity.ports import free_port
from parity.procs import ServiceProcess, start_service
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import broadcast_pb2_grpc, common_pb2
from parity.weights import checksum, wsum_kernel
from parity.weights.group import GroupHolder
from parity.weights.layout import DEFAULT_BUCKET_BYTES, Layout, allocate_packed
from parity.weights.wire import TransferGroup


def log(message: str) -> None:
    print(f"[weight_sync {time.strftime('%H:%M:%S')}] {message}", flush=True)


def smollm2_weights() -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    from parity import models

    path = models.resolve("smollm2-135m") / "model.safetensors"
    return sorted(load_file(str(path)).items())


def smollm2_shaped_weights(seed: int = 0) -> list[tuple[str, object]]:
    """SmolLM2-135M's 272 tensors (names, shapes, fp32: 538,060,032 bytes) with random values, for a
    host without the checkpoint (a GPU host that cannot download): the transfer sees the same layout."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, kv, inter, vocab = 576, 192, 1536, 49152
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(30):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    return sorted((name, torch.rand(shape, generator=gen)) for name, shape in shapes.items())


def random_weights(total_mb: int, seed: int = 0) -> list[tuple[str, object]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = 4096
    per_tensor = 64 * 1024 * 1024  # 64 MiB tensors of float32
    count = max(1, total_mb * 1024 * 1024 // per_tensor)
    return [
        (f"layer{i}.weight", torch.rand(rows, per_tensor // 4 // rows, generator=gen)) for i in range(count)
    ]


def bump(named: list[tuple[str, object]], version: int) -> None:
    """Make version v's values differ from v-1 (cheap: one element per tensor)."""
    for _, tensor in named:
        tensor.view(-1)[0] = float(version)


RAW_SECRET = "raw-baseline-secret-0123456789"


# -- raw baseline ------------------------------------------------------------------------------
def _raw_receiver(
    rank: int, world: int, port: int, total: int, bucket: int, rounds: int, algorithm: str, q, done
) -> None:
    import torch

    torch.set_num_threads(1)
    metas = [common_pb2.TensorMeta(name="flat", shape=[total], dtype="uint8")]
    rdv = common_pb2.Rendezvous(
        host="127.0.0.1",
        port=port,
        rank=rank,
        world_size=world,
        backend="gloo",
        group_name="raw",
        timeout_s=600,
        secret=RAW_SECRET,
    )
    group = TransferGroup.join(rdv, algorithm=algorithm)
    out = torch.empty(total, dtype=torch.uint8)
    out.fill_(0)  # pre-fault pages: the raw baseline measures the wire, not page faults
    for _ in range(rounds):
        group.recv_packed(metas, bucket, out=out)
        q.put(rank)  # this receiver holds every byte
    done.wait(600)  # exit only after the last e2e round: a process exiting competes for the cores
    group.close()


class RawBaseline:
    """A bucketed transfer of `total` bytes from this process to `receivers` processes over a gloo
    group, with no service, no checksum and no swap; each round is timed until the last receiver
    reports that it holds every byte. `algorithm`: "broadcast" (gloo's own broadcast, the issue's
    baseline) or "chain" (the data plane's gloo algorithm, parity.weights.wire)."""

    def __init__(self, total: int, receivers: int, bucket: int, rounds: int, algorithm: str) -> None:
        import torch

        ctx = mp.get_context("spawn")
        self.q, self.done = ctx.Queue(), ctx.Event()
        port = free_port()
        world = receivers + 1
        self.procs = [
            ctx.Process(
                target=_raw_receiver,
                args=(r, world, port, total, bucket, rounds, algorithm, self.q, self.done),
            )
            for r in range(1, world)
        ]
        for proc in self.procs:
            proc.start()
        rdv = common_pb2.Rendezvous(
            host="127.0.0.1",
            port=port,
            rank=0,
            world_size=world,
            backend="gloo",
            group_name="raw",
            timeout_s=600,
            secret=RAW_SECRET,
        )
        self.group = TransferGroup.join(rdv, host_store=True, algorithm=algorithm)
        self.buffer = torch.ones(total, dtype=torch.uint8)
        self.bucket = bucket

    def round(self) -> float:
        start = time.perf_counter()
        self.group.send_packed(self.buffer, self.bucket)
        for _ in self.procs:
            self.q.get(timeout=600)
        return time.perf_counter() - start

    def close(self) -> None:
        self.done.set()
        for proc in self.procs:
            proc.join(30)
        self.group.close()
        del self.buffer


# -- end to end --------------------------------------------------------------------------------
def start_broadcast(log_dir: Path, name: str, bucket_bytes: int) -> ServiceProcess:
    """A broadcast service with deadlines far above any transfer here (a benchmark never times out)."""
    args = [
        "--transfer_timeout_s",
        "600",
        "--heartbeat_timeout_s",
        "120",
        "--bucket_bytes",
        str(bucket_bytes),
    ]
    return start_service("broadcast", args, log_dir=log_dir, name=name).wait_ready(120)


def start_standin(log_dir: Path, broadcast: str, worker_id: str, *extra: str) -> ServiceProcess:
    port_file = log_dir / f"{worker_id}.port"
    log_path = log_dir / f"{worker_id}.log"
    cmd = [
        sys.executable,
        "-m",
        "tests.fakes.fake_receiver",
        "--broadcast_address",
        broadcast,
        "--worker_id",
        worker_id,
        "--port_file",
        str(port_file),
        *extra,
    ]
    with open(log_path, "ab") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    return ServiceProcess(name=worker_id, proc=proc, port_file=port_file, log_path=log_path)


TRAINER_GROUPS = GroupHolder()  # the trainer's epoch group, held across versions as the publisher does


def update_round(stub, model: str, named: list, version: int, bucket: int) -> dict[str, float]:
    """One version through the service; returns its timings."""
    tensors = [t for _, t in named]
    bump(named, version)
    start = time.perf_counter()
    metas = checksum.describe(named)
    described = time.perf_counter()
    request = pb.PublishVersionRequest(
        version=version,
        model=model,
        tensors=metas,
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
        bucket_bytes=bucket,
    )
    plan = stub.PublishVersion(request, timeout=30).plan
    with TRAINER_GROUPS.use(plan.rendezvous) as group:
        sent = group.send(tensors, plan.bucket_bytes)
    trainer_done = time.perf_counter()
    reply = stub.WaitVersion(
        pb.WaitVersionRequest(version=version, state=pb.VERSION_STATE_DISTRIBUTED, timeout_s=600), timeout=620
    )
    done = time.perf_counter()
    if not reply.reached:
        raise RuntimeError(f"v{version} not distributed: {reply}")
    status = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=10)
    behind = [w.worker_id for w in status.workers if w.weight_version != version or not w.verified]
    if behind:
        raise RuntimeError(f"v{version}: workers {behind} did not verify and apply it: {status.workers}")
    return {
        "checksum_s": described - start,
        "trainer_s": trainer_done - described,
        "e2e_s": done - described,
        "stall_s": max(
            (w.last_paused_seconds for w in status.workers if w.HasField("last_paused_seconds")),
            default=float("nan"),
        ),
        "bytes": sent,
        "epoch": status.epoch,
    }


class GenerationLoad:
    """Client threads that keep the rollout service generating (groups of `n`), so updates land on an
    engine that is busy, as they do in training. Each reply's end time and token count are kept, so
    the generation rate inside any time window can be read afterwards (`rate`)."""

    def __init__(self, address: str, n: int = 2, max_tokens: int = 8, clients: int = 4) -> None:
        from parity.v1 import rollout_pb2, rollout_pb2_grpc

        self.stop = threading.Event()
        self.tokens = 0
        self.replies: list[tuple[float, int]] = []  # (monotonic end time, tokens)
        self.errors: list[str] = []
        request = rollout_pb2.GenerateRequest(
            prompt_text="Count from one to twenty in words:",
            sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, n=n),
        )

        def loop() -> None:
            with grpc.insecure_channel(address) as chan:
                stub = rollout_pb2_grpc.RolloutServiceStub(chan)
                while not self.stop.is_set():
                    try:
                        reply = stub.Generate(request, timeout=300)
                    except grpc.RpcError as exc:
                        self.errors.append(f"{exc.code().name}: {exc.details()}")
                        return
                    count = sum(len(c.token_ids) for c in reply.completions)
                    self.tokens += count
                    self.replies.append((time.monotonic(), count))

        self.threads = [
            threading.Thread(target=loop, name=f"generation-load-{i}", daemon=True) for i in range(clients)
        ]
        for thread in self.threads:
            thread.start()

    def rate(self, start: float, end: float) -> float:
        """Tokens per second of the replies that ended inside [start, end]."""
        return sum(n for t, n in self.replies if start <= t <= end) / max(end - start, 1e-9)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)


def vllm_receiver_phase(args: argparse.Namespace, log_dir: Path, swap: str) -> dict:
    """SmolLM2 into one real vLLM rollout service (`parity serve rollout`) that keeps generating:
    the real worker's stall. Unlike the stand-ins, it receives and verifies into staging while it
    generates, and pauses only for the swap. `swap`: prepared (the new version's kernel form built
    on a shadow of the model while generating; the pause copies and rebinds) or in_place (vLLM's
    reload, weight processing included, inside the pause)."""
    import torch
    from transformers import AutoModelForCausalLM

    from parity import models

    with models.quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(models.resolve("smollm2-135m"), dtype=torch.float32)
    named = [(name, param.detach()) for name, param in model.named_parameters()]  # as the trainer publishes
    broadcast = start_broadcast(log_dir, f"broadcast-vllm-{swap}", args.bucket_bytes)
    rollout = start_service(
        "rollout",
        ["--model", "smollm2-135m", "--broadcast_address", broadcast.address, "--worker_id", "vllm",
         "--max_model_len", "512", "--prepared_swap", str(swap == "prepared").lower()],
        log_dir=log_dir,
        name=f"rollout-vllm-{swap}",
    )  # fmt: skip
    rows, load, idle_rate, busy_rate = [], None, float("nan"), float("nan")
    try:
        log(f"real vLLM receiver, {swap} swap: starting a SmolLM2 rollout service (log: {rollout.log_path})")
        rollout.wait_ready(900)
        load = GenerationLoad(rollout.address)
        deadline = time.monotonic() + 300
        while not load.tokens and not load.errors and time.monotonic() < deadline:
            time.sleep(0.2)  # the engine is warm and busy before the first update
        idle_from = time.monotonic()
        time.sleep(args.vllm_idle_s)
        idle_rate = load.rate(idle_from, time.monotonic())
        with grpc.insecure_channel(broadcast.address) as chan:
            stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
            for i in range(1 + args.vllm_updates):
                if i == 1:
                    updates_from = time.monotonic()  # after the warm-up update
                row = update_round(stub, "smollm2-135m", named, i + 1, args.bucket_bytes)
                worker = stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=10).workers[0]
                row["update_rpc_s"] = (
                    worker.last_update_seconds if worker.HasField("last_update_seconds") else float("nan")
                )
                log(
                    f"  vLLM update v{i + 1}: e2e {row['e2e_s']:.3f}s, worker RPC {row['update_rpc_s']:.3f}s, "
                    f"paused {row['stall_s']:.3f}s, {load.tokens} tokens generated so far"
                    + (" (warm-up, not counted)" if i == 0 else "")
                )
                if i:
                    rows.append(row)
            busy_rate = load.rate(updates_from, time.monotonic())  # back to back: the whole window
        if load.errors:
            raise RuntimeError(f"generation failed during updates: {load.errors[0]}")
    finally:
        if load is not None:
            load.close()
        rollout.stop(30)
        broadcast.stop(10)
    e2e, stall = statistics.median(r["e2e_s"] for r in rows), statistics.median(r["stall_s"] for r in rows)
    log(
        f"real vLLM receiver, {swap} swap: e2e {e2e:.3f}s, stall (paused) {stall:.3f}s (median of {len(rows)} "
        f"updates); generation {busy_rate:.1f} tokens/s across the updates vs {idle_rate:.1f} before them"
    )
    return {
        "swap": swap,
        "bytes": rows[0]["bytes"],
        "e2e_s": round(e2e, 4),
        "stall_s": round(stall, 4),
        "update_rpc_s": round(statistics.median(r["update_rpc_s"] for r in rows), 4),
        "generation_tokens_per_s_during_updates": round(busy_rate, 2),
        "generation_tokens_per_s_without_updates": round(idle_rate, 2),
        "generating_during_updates": True,
    }


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def checksum_ms_per_100mb(named: list) -> dict[str, float]:
    """ms per 100 MB, best of three alternating rounds each (the box is shared): the trainer's
    `describe` ("describe"), tensor by tensor on one thread ("one_thread"), and the run sums alone on
    one thread by the compiled kernel ("kernel", absent where it is not built) and by numpy's two
    passes ("numpy")."""
    import numpy as np
    import torch

    total = sum(t.numel() * t.element_size() for _, t in named)
    words = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for _, t in named]
    words = [w[: w.size - w.size % 8].view(np.uint64) for w in words]
    kernel = wsum_kernel.run_sums()
    runs = {
        "describe": lambda: checksum.describe(named),
        "one_thread": lambda: [checksum.tensor_checksum(tensor) for _, tensor in named],
        "numpy": lambda: [checksum.run_sums_numpy(w) for w in words],
    }
    if kernel is not None:
        runs["kernel"] = lambda: [kernel(w) for w in words]
    checksum.describe(named[:1])
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(3):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - start)
    return {key: min(values) * 1000 / (total / 1e8) for key, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--receivers", type=int, default=2, help="stand-in rollout workers")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds per model (after warm-up)")
    parser.add_argument("--bucket_bytes", type=int, default=DEFAULT_BUCKET_BYTES)
    parser.add_argument("--large_mb", type=int, default=1024, help="random model size; 0 skips it")
    parser.add_argument(
        "--vllm_updates", type=int, default=3, help="updates into a real vLLM rollout service (0 skips it)"
    )
    parser.add_argument(
        "--vllm_swap",
        default="prepared,in_place",
        help="comma-separated swap modes to run the real vLLM phase with, one rollout service each: "
        "prepared (rollout.prepared_swap true, the default) and/or in_place",
    )
    parser.add_argument(
        "--vllm_idle_s",
        type=float,
        default=6.0,
        help="seconds of generation measured before the first update",
    )
    parser.add_argument(
        "--layout",
        choices=("trainer", "scattered"),
        default="trainer",
        help="trainer: the tensors live in one packed buffer, as the trainer's flattened parameters "
        "do (trainer/flat_params.py), so the send copies nothing; scattered: separately allocated "
        "tensors (as sharded parameters gathered at publish time), packed into buckets as they go",
    )
    parser.add_argument(
        "--smollm2",
        choices=("file", "shape"),
        default="file",
        help="file: SmolLM2-135M's checkpoint; shape: its tensors' names and shapes with random values "
        "(same bytes and layout, no checkpoint needed)",
    )
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    models = [("smollm2-135m", smollm2_weights if args.smollm2 == "file" else smollm2_shaped_weights)]
    if args.large_mb:
        models.append((f"random-{args.large_mb}mb", lambda: random_weights(args.large_mb)))
    log_dir = Path(tempfile.mkdtemp(prefix="parity-bench-sync-"))
    results = {}
    for model_name, loader in models:
        if model_name.startswith("random") and available_bytes() < 13 * args.large_mb * 1024 * 1024:
            # trainer 1x, two raw senders + 2 raw receivers each 6x, 2 receivers 2x each
            log(
                f"{model_name}: skipped, needs ~{13 * args.large_mb} MB free, {available_bytes() >> 20} MB available"
            )
            continue
        named = loader()
        if args.layout == "trainer":
            _, placed = allocate_packed([t for _, t in named])
            named = [(name, t) for (name, _), t in zip(named, placed, strict=True)]
        total = Layout.of(
            [common_pb2.TensorMeta(shape=list(t.shape), dtype=checksum.dtype_name(t.dtype)) for _, t in named]
        ).total_bytes
        log(f"{model_name}: {len(named)} tensors, {total / 1e6:.1f} MB")
        checksum_ms = checksum_ms_per_100mb(named)
        ms, ms_one_thread = checksum_ms["describe"], checksum_ms["one_thread"]
        log(
            f"{model_name}: WSUM64 checksum {ms:.1f} ms per 100 MB "
            f"({ms_one_thread:.1f} tensor by tensor on one thread; run sums on one thread: "
            f"{wsum_kernel.kernel_name()} path, kernel {checksum_ms.get('kernel', float('nan')):.1f}, "
            f"numpy {checksum_ms['numpy']:.1f})"
        )
        warmup = 2  # connections, and the service's and receivers' two buffers each
        log(
            f"{model_name}: starting raw receivers, broadcast service and {args.receivers} stand-in receivers"
        )
        raw = RawBaseline(total, args.receivers, args.bucket_bytes, warmup + args.repeats, "broadcast")
        chain = RawBaseline(total, args.receivers, args.bucket_bytes, warmup + args.repeats, "chain")
        broadcast = start_broadcast(log_dir, f"broadcast-{model_name}", args.bucket_bytes)
        standins = [
            start_standin(log_dir, broadcast.address, f"{model_name}-w{i}") for i in range(args.receivers)
        ]
        rounds = []
        try:
            for standin in standins:
                standin.wait_ready(180)
            with grpc.insecure_channel(broadcast.address) as chan:
                stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
                # raw and e2e rounds alternate, so both see the same background load
                for i in range(warmup + args.repeats):
                    raw_round = raw.round()
                    chain_round = chain.round()
                    row = update_round(stub, model_name, named, i + 1, args.bucket_bytes)
                    row["raw_s"], row["raw_chain_s"] = raw_round, chain_round
                    log(
                        f"  round {i + 1}: raw {raw_round:.3f}s ({total / raw_round / 1e9:.2f} GB/s), "
                        f"raw chain {chain_round:.3f}s | "
                        f"e2e {row['e2e_s']:.3f}s ({total / row['e2e_s'] / 1e9:.2f} GB/s), ratio "
                        f"{row['e2e_s'] / raw_round:.2f} (over the chain {row['e2e_s'] / chain_round:.2f}), "
                        f"trainer busy {row['trainer_s']:.3f}s, "
                        f"stall {row['stall_s'] * 1000:.1f}ms, epoch {row['epoch']}"
                        + (" (warm-up, not counted)" if i < warmup else "")
                    )
                    if i >= warmup:
                        rounds.append(row)
        finally:
            raw.close()
            chain.close()
            TRAINER_GROUPS.close()
            for standin in standins:
                standin.stop(10)
            broadcast.stop(10)
        raw_s = statistics.median(r["raw_s"] for r in rounds)
        ratio = statistics.median(r["e2e_s"] / r["raw_s"] for r in rounds)
        raw_chain = statistics.median(r["raw_chain_s"] for r in rounds)
        chain_ratio = statistics.median(r["e2e_s"] / r["raw_chain_s"] for r in rounds)
        stall_ratio = statistics.median(r["stall_s"] / r["raw_s"] for r in rounds)
        e2e = statistics.median(r["e2e_s"] for r in rounds)
        trainer = statistics.median(r["trainer_s"] for r in rounds)
        stall = statistics.median(r["stall_s"] for r in rounds)
        results[model_name] = {
            "bytes": total,
            "receivers": args.receivers,
            "layout": args.layout,
            "raw_s": round(raw_s, 4),
            "e2e_s": round(e2e, 4),
            "trainer_busy_s": round(trainer, 4),
            "stall_s": round(stall, 4),
            "raw_bytes_per_s": round(total / raw_s),
            "e2e_bytes_per_s": round(total / e2e),
            "e2e_over_raw": round(ratio, 3),  # median of per-round ratios (paired)
            "e2e_over_raw_rounds": [round(r["e2e_s"] / r["raw_s"], 3) for r in rounds],
            # the same bytes over the data plane's own gloo algorithm, no service: e2e's overhead
            "raw_chain_s": round(raw_chain, 4),
            "raw_chain_over_raw": round(statistics.median(r["raw_chain_s"] / r["raw_s"] for r in rounds), 3),
            "e2e_over_raw_chain": round(chain_ratio, 3),
            "stall_over_raw": round(stall_ratio, 4),
            "epochs": sorted({r["epoch"] for r in rounds}),
            "trainer_over_raw": round(trainer / raw_s, 3),
            "checksum_ms_per_100mb": round(ms, 2),
            "checksum_one_thread_ms_per_100mb": round(ms_one_thread, 2),
            "checksum_one_thread_over_describe": round(ms_one_thread / ms, 2),
            # which run-sums path this process's checksums took, and both paths head to head
            "checksum_path": wsum_kernel.kernel_name(),
            "run_sums_numpy_ms_per_100mb": round(checksum_ms["numpy"], 2),
            **(
                {
                    "run_sums_kernel_ms_per_100mb": round(checksum_ms["kernel"], 2),
                    "run_sums_numpy_over_kernel": round(checksum_ms["numpy"] / checksum_ms["kernel"], 2),
                }
                if "kernel" in checksum_ms
                else {}
            ),
        }
        log(
            f"{model_name}: e2e/raw = {ratio:.2f} (median of paired rounds; goal <= 1.2), "
            f"e2e/raw chain = {chain_ratio:.2f}, "
            f"stall/raw = {stall_ratio:.3f} (goal <= 1.5), trainer busy/raw = {trainer / raw_s:.2f}, "
            f"stall {stall * 1000:.1f}ms"
        )
        del named
    vllm = {}
    for swap in args.vllm_swap.split(",") if args.vllm_updates else []:
        vllm[swap] = phase = vllm_receiver_phase(args, log_dir, swap)
        if "smollm2-135m" in results:
            # against the same bytes' raw broadcast measured above (to 2 receivers; this phase has 1)
            phase["stall_over_raw"] = round(phase["stall_s"] / results["smollm2-135m"]["raw_s"], 3)
            phase["e2e_over_raw"] = round(phase["e2e_s"] / results["smollm2-135m"]["raw_s"], 3)
    summary = {
        "benchmark": "weight_sync",
        "goal_e2e_over_raw": 1.2,
        "goal_stall_over_raw": 1.5,
        "met": all(r["e2e_over_raw"] <= 1.2 and r["stall_over_raw"] <= 1.5 for r in results.values()),
        "models": results,
        "vllm_receiver": vllm or None,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
