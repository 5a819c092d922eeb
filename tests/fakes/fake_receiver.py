"""A stand-in rollout worker: the receiving half of the update protocol, without an engine.

It implements only `RolloutService.UpdateWeights` (other RPCs answer UNIMPLEMENTED) plus the
membership side of a rollout service, with the rollout service's own `MembershipClient`
(RegisterWorker at startup, heartbeats, NOT_SERVING until it holds a version >= the latest). The
tests and bench/weight_sync.py use it where a real vLLM rollout service would cost a minute to
start; the real one is `rollout/`.

    python -m tests.fakes.fake_receiver --broadcast_address 127.0.0.1:PORT --worker_id w0 \\
        [--state_file F] [--enable_fault_injection] [--bucket_delay_s 0.2] [--port_file F]

Invariants (the same as the real worker's):
- Updates are serialised; received bytes go to a fresh buffer, never into the served weights.
- Only if every tensor's shape, dtype and WSUM64 match the plan are the new tensors swapped in;
  otherwise the old weights and version stay and the answer is FAILED naming the tensors.
- After each swap `--state_file` holds {"version", "checksums"} of the weights it serves (for tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

log = logging.getLogger("parity.standin_receiver")


class StandinReceiver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = 0
        self.weights: list = []
        self.served_buffer = None  # the packed buffer self.weights view
        self.spare_buffer = None  # a buffer nobody serves from: received into next time
        self.latest_seen = 0
        self.lock = asyncio.Lock()
        self.server = None  # GrpcServer, set in serve()

    def _write_state(self) -> None:
        if not self.args.state_file:
            return
        from parity.checksum import tensor_checksum

        path = Path(self.args.state_file)
        tmp = path.with_suffix(".tmp")
        state = {"version": self.version, "checksums": [str(tensor_checksum(t)) for t in self.weights]}
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    def _receive(self, plan, corrupt: str) -> tuple[object, list, list[int], list[str], float]:
        """Blocking: join, receive, (optionally corrupt), checksum.
        Returns (buffer, tensors, sums, bad names, seconds)."""
        import torch

        from parity.transport import Layout, StreamVerifier, TransferGroup

        start = time.monotonic()
        layout = Layout.of(plan.tensors)
        spare = self.spare_buffer
        buffer = spare if spare is not None and spare.numel() == layout.total_bytes else None
        if buffer is None:
            buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
        verifier = StreamVerifier(buffer, plan.tensors)
        corrupt_at = -1
        if corrupt:
            index = [m.name for m in plan.tensors].index(corrupt)
            corrupt_at = layout.offsets[index]
        delay = self.args.bucket_delay_s

        def progress(end: int) -> None:
            nonlocal corrupt_at
            if 0 <= corrupt_at < end:
                buffer[corrupt_at] ^= 0xFF  # flip one byte in flight, as a bad link or copy would
                corrupt_at = -1
            verifier.advance(end)  # checksum finished tensors while the next bucket arrives
            if delay:
                time.sleep(delay)

        group = TransferGroup.join(plan.rendezvous)
        try:
            group.recv_packed(plan.tensors, plan.bucket_bytes, out=buffer, progress=progress)
        finally:
            group.close()
        bad = verifier.mismatched()
        tensors, sums = verifier.tensors, verifier.checksums
        return buffer, tensors, sums, bad, time.monotonic() - start

    async def UpdateWeights(self, request, context: grpc.aio.ServicerContext):
        from parity.transport import TransferError
        from parity.v1 import rollout_pb2

        plan = request.plan
        if not plan.tensors or not plan.HasField("rendezvous"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "plan: tensors and rendezvous are required")
        corrupt = request.fault_corrupt_tensor
        if corrupt and not self.args.enable_fault_injection:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "fault_corrupt_tensor: fault injection is disabled (--enable_fault_injection)",
            )
        if corrupt and corrupt not in {m.name for m in plan.tensors}:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"fault_corrupt_tensor: no tensor {corrupt!r}"
            )
        corrupt = corrupt or self.args.corrupt_tensor_at.get(plan.version, "")
        async with self.lock:
            if plan.version == self.version:
                return rollout_pb2.UpdateWeightsResponse(
                    outcome=rollout_pb2.UPDATE_OUTCOME_ALREADY_CURRENT, weight_version=self.version
                )
            if plan.version < self.version:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"plan.version: {plan.version} is older than the served {self.version}",
                )
            paused_at = time.monotonic()  # pause(keep): a real engine stops scheduling here
            try:
                buffer, tensors, sums, bad, transfer_s = await asyncio.to_thread(self._receive, plan, corrupt)
            except TransferError as exc:
                return rollout_pb2.UpdateWeightsResponse(
                    outcome=rollout_pb2.UPDATE_OUTCOME_FAILED,
                    weight_version=self.version,
                    error=f"transfer: {exc}",
                    paused_seconds=time.monotonic() - paused_at,
                )
            if bad:
                self.spare_buffer = buffer
                return rollout_pb2.UpdateWeightsResponse(
                    outcome=rollout_pb2.UPDATE_OUTCOME_FAILED,
                    weight_version=self.version,
                    error=f"checksum mismatch on {', '.join(bad[:5])}; kept version {self.version}",
                    checksums=sums,
                    transfer_seconds=transfer_s,
                    paused_seconds=time.monotonic() - paused_at,
                )
            # the swap: reference assignments; the buffer served until now becomes the spare
            self.spare_buffer, self.served_buffer = self.served_buffer, buffer
            self.weights, self.version = tensors, plan.version
            self._write_state()
            paused_s = time.monotonic() - paused_at  # resume
        if self.version >= self.latest_seen:
            await self.server.set_serving(True)
        log.info("now serving v%d (transfer %.2fs, paused %.2fs)", self.version, transfer_s, paused_s)
        return rollout_pb2.UpdateWeightsResponse(
            outcome=rollout_pb2.UPDATE_OUTCOME_APPLIED,
            weight_version=self.version,
            checksums=sums,
            transfer_seconds=transfer_s,
            paused_seconds=paused_s,
        )

    async def caught_up_to(self, latest_version: int) -> None:
        """Registered: serve only once holding the broadcast service's latest version."""
        self.latest_seen = latest_version
        await self.server.set_serving(self.version >= self.latest_seen)

    async def serve(self) -> int:
        from parity.config import ServiceConfig
        from parity.membership_client import MembershipClient
        from parity.server import GrpcServer, install_shutdown_handlers
        from parity.v1 import rollout_pb2_grpc

        name = "parity.v1.RolloutService"
        config = ServiceConfig(port=0, auth_token=self.args.auth_token, port_file=self.args.port_file)
        self.server = GrpcServer(config, [name], protected_methods=[f"/{name}/UpdateWeights"])
        servicer = rollout_pb2_grpc.RolloutServiceServicer()
        servicer.UpdateWeights = self.UpdateWeights  # the one RPC a stand-in needs
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, self.server.server)
        port = await self.server.start()
        self._write_state()
        membership = MembershipClient(
            broadcast_address=self.args.broadcast_address,
            worker_id=self.args.worker_id,
            address=f"127.0.0.1:{port}",
            auth_token=self.args.auth_token,
            heartbeat_interval_s=1.0,
            weight_version=lambda: self.version,
            on_registered=self.caught_up_to,
        )
        member = asyncio.ensure_future(membership.run())

        async def shutdown() -> None:
            member.cancel()
            await membership.unregister()
            await self.server.stop(1.0)

        stopped = install_shutdown_handlers(shutdown)
        await stopped.wait()
        await self.server.server.wait_for_termination()
        return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broadcast_address", required=True, help="HOST:PORT of the broadcast service")
    parser.add_argument("--worker_id", required=True, help="membership id")
    parser.add_argument("--auth_token", default=os.environ.get("PARITY_AUTH_TOKEN", ""), help="shared token")
    parser.add_argument("--port_file", default="", help="write the gRPC port here once serving")
    parser.add_argument("--state_file", default="", help="JSON {version, checksums} after every swap")
    parser.add_argument("--enable_fault_injection", action="store_true", help="honour fault_corrupt_tensor")
    parser.add_argument(
        "--corrupt_tensor_at",
        default="",
        help="test-only fault hook: VERSION=TENSOR[,VERSION=TENSOR] corrupts that tensor in flight "
        "(needs --enable_fault_injection)",
    )
    parser.add_argument(
        "--bucket_delay_s", type=float, default=0.0, help="test-only: sleep after each bucket"
    )
    args = parser.parse_args(list(argv))
    pairs = [p.split("=", 1) for p in args.corrupt_tensor_at.split(",") if p]
    if pairs and not args.enable_fault_injection:
        parser.error("--corrupt_tensor_at needs --enable_fault_injection")
    args.corrupt_tensor_at = {int(v): name for v, name in pairs}
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(StandinReceiver(args).serve())


if __name__ == "__main__":
    sys.exit(main())
