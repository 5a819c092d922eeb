"""What tracing costs on the hot paths: off (the default), on with the SDK, against doing nothing.

    .venv/bin/python bench/tracing_overhead.py            # ~10 s
    .venv/bin/python bench/tracing_overhead.py --calls 200000

Measured in one process, in this order, best of `--repeats` timings each:
- bare: an empty function call (the baseline every figure is relative to);
- off: `with tracing.span("generate", attrs):` with tracing off, plus `current_traceparent()`;
- off_grpc: a unary gRPC call over loopback through GrpcServer/channel() with tracing off (no
  interceptors installed);
- on: the same span with tracing on (SDK, in-memory exporter, synchronous export), plus the
  traceparent; on_grpc: the gRPC call with the OpenTelemetry interceptors on both sides.

Off must cost nanoseconds per span and nothing measurable per RPC; the final stdout line is a JSON
object with every figure in nanoseconds and the ratios `on / off`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable

from parity import tracing

ATTRS = {"parity.weight_version": 3, "parity.group_id": "w0-1"}


def best_ns(fn: Callable[[], None], calls: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e9


def bare() -> None:
    pass


def traced() -> None:
    with tracing.span("generate", ATTRS):
        tracing.current_traceparent()


async def grpc_ns(calls: int, repeats: int) -> float:
    from parity.config import ServiceConfig
    from parity.server import GrpcServer, channel
    from parity.v1 import rollout_pb2, rollout_pb2_grpc

    class Echo(rollout_pb2_grpc.RolloutServiceServicer):
        async def Generate(self, request, context):
            return rollout_pb2.GenerateResponse(request_id=request.request_id)

    server = GrpcServer(ServiceConfig(), ["parity.v1.RolloutService"])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(Echo(), server.server)
    port = await server.start()
    best = float("inf")
    try:
        async with channel(f"127.0.0.1:{port}") as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)
            request = rollout_pb2.GenerateRequest(request_id="bench")
            await stub.Generate(request)
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(calls):
                    await stub.Generate(request)
                best = min(best, (time.perf_counter() - start) / calls)
    finally:
        await server.stop(0)
    return best * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="span calls per timing")
    parser.add_argument("--rpc_calls", type=int, default=300, help="gRPC calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure (best is kept)")
    args = parser.parse_args(argv)
    assert not tracing.enabled(), "run without OTEL_TRACES_EXPORTER set"
    results: dict[str, float] = {}
    results["bare_ns"] = best_ns(bare, args.calls, args.repeats)
    results["off_ns"] = best_ns(traced, args.calls, args.repeats) - results["bare_ns"]
    print(f"span off: {results['off_ns']:.0f} ns over an empty call", flush=True)
    results["off_grpc_ns"] = asyncio.run(grpc_ns(args.rpc_calls, args.repeats))
    print(f"gRPC call, tracing off: {results['off_grpc_ns'] / 1e3:.0f} us", flush=True)
    results["sdk_imported_when_off"] = float("opentelemetry.sdk" in sys.modules)

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.init("parity-bench", exporter=exporter)
    on_calls = max(1, args.calls // 20)
    results["on_ns"] = best_ns(traced, on_calls, args.repeats) - results["bare_ns"]
    exporter.clear()
    print(f"span on: {results['on_ns']:.0f} ns", flush=True)
    results["on_grpc_ns"] = asyncio.run(grpc_ns(args.rpc_calls, args.repeats))
    print(f"gRPC call, tracing on: {results['on_grpc_ns'] / 1e3:.0f} us", flush=True)
    results["span_on_over_off"] = results["on_ns"] / max(results["off_ns"], 1.0)
    results["grpc_on_over_off"] = results["on_grpc_ns"] / results["off_grpc_ns"]
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
