"""A grpc.health.v1 probe for container healthchecks: `python -m parity.health HOST:PORT`.

Exit codes: 0 when the service reports SERVING, 1 when it answers anything else (NOT_SERVING,
SERVICE_UNKNOWN) or cannot be reached within `--timeout_s`, 2 on bad arguments. It imports only
grpc and the health stubs, so a probe every few seconds costs a fraction of a second of CPU.

docker-compose uses it as
    healthcheck: {test: ["CMD", "python", "-m", "parity.health", "127.0.0.1:50051"]}

`check` is the one health probe in the code base: `parity.procs.wait_healthy` and the `parity run`
supervisor poll through it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(
    address: str, service: str = "", timeout_s: float = 3.0, wait_for_ready: bool = True
) -> tuple[bool, str]:
    """One Check call: (serving, status name or error).

    With `wait_for_ready` the call waits up to `timeout_s` for the server to accept connections;
    without it, an address nobody listens on answers UNAVAILABLE at once (for callers that poll).
    """
    with grpc.insecure_channel(address) as chan:
        stub = health_pb2_grpc.HealthStub(chan)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout_s,
                wait_for_ready=wait_for_ready,
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity.health", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="HOST:PORT of a Parity gRPC service")
    parser.add_argument("--service", default="", help="health service name; '' is the whole server")
    parser.add_argument("--timeout_s", type=float, default=3.0, help="deadline of the Check call")
    args = parser.parse_args(argv)
    if args.timeout_s <= 0:
        parser.error("--timeout_s: must be > 0")
    serving, status = check(args.address, args.service, args.timeout_s)
    print(f"{args.address}: {status}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
