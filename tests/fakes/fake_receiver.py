"""A stand-in rollout worker: the receiving half of the update protocol, without an engine.

It implements only `RolloutService.UpdateWeights` (other RPCs answer UNIMPLEMENTED) plus the
membership side of a rollout service, with the rollout service's own `MembershipClient`
(RegisterWorker at startup, heartbeats, NOT_SERVING until it holds a version >= the latest). The
tests and bench/weight_sync.py use it where a real vLLM rollout service would cost a minute to
start; the real one is `rollout/`.

    python -m tests.fakes.fake_receiver --broadcast_address 127.0.0.1:PORT --worker_id w0 \\
        [--state_file F] [--enable_fault_injection] [--bucket_delay_s 0.2] [--port_file F]

Invariants (the same as the real worker's):
- Updates are serialised; received bytes go to a spare buffer, never into the served weights; the
  epoch's data group is held between versions (parity.weights.receiver, as the real worker does).
- Only if every tensor's shape, dtype and WSUM64 match the plan are the new tensors swapped in;
  otherwise the old weights and version stay and the answer is FAILED naming the tensors.
- After each swap `--state_file` holds {"version", "checksums", "path", "device"} of the weights it
  serves (for tests); path says how the version came ("group", or "cuda_ipc" on the trainer's GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
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
        self.names: list[str] = []  # of self.weights
        self.served_buffer = None  # the packed buffer self.weights view
        self.spare_buffer = None  # a buffer nobody serves from: received into next time
        self.latest_seen = 0
        self.last_path = ""  # how the served version came: "group" or "cuda_ipc"
        self.lock = asyncio.Lock()
        self.server = None  # GrpcServer, set in serve()

    def _write_state(self) -> None:
        if not self.args.state_file:
            return
        from parity.weights.checksum import tensor_checksum

        path = Path(self.args.state_file)
        tmp = path.with_suffix(".tmp")
        state = {
            "version": self.version,
            "checksums": [str(tensor_checksum(t)) for t in self.weights],
            "path": self.last_path,
            "device": str(self.weights[0].device) if self.weights else "",
        }
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    def _receive(self, plan, corrupt: str):
        """Blocking: receive and verify through the rollout workers' own receiver (its process-wide
        epoch group, streaming checksums, memory check), into the spare buffer when it fits."""
        from parity.weights.receiver import receive_and_verify

        delay = self.args.bucket_delay_s
        return receive_and_verify(
            plan,
            self.args.device,
            corrupt,
            out=self.spare_buffer,
            on_bucket=(lambda _end: time.sleep(delay)) if delay else None,
            ahead=2 if delay else 0,  # a slow link: the wire waits for the receiver
        )

    async def UpdateWeights(self, request, context: grpc.aio.ServicerContext):
        from parity.v1 import rollout_pb2

        plan = request.plan
        if not plan.tensors or plan.HasField("rendezvous") == plan.HasField("cuda_ipc"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "plan: tensors and one of rendezvous or cuda_ipc are required",
            )
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
        if self.args.never_join:  # chaos: registered, but never comes to the data group
            await asyncio.sleep(float(plan.rendezvous.timeout_s or plan.cuda_ipc.timeout_s) + 1)
            return rollout_pb2.UpdateWeightsResponse(
                outcome=rollout_pb2.UPDATE_OUTCOME_FAILED, weight_version=self.version, error="never joined"
            )
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
            # receive + verify while "generating", as the real worker does; pause only for the swap
            staged = await asyncio.to_thread(self._receive, plan, corrupt)
            if staged.error:
                if staged.buffer is not None:
                    self.spare_buffer = staged.buffer
                return rollout_pb2.UpdateWeightsResponse(
                    outcome=rollout_pb2.UPDATE_OUTCOME_FAILED,
                    weight_version=self.version,
                    error=f"{staged.error}; kept version {self.version}",
                    checksums=staged.checksums,
                    transfer_seconds=staged.transfer_s,
                )
            if plan.base_version and plan.base_version != self.version:
                return rollout_pb2.UpdateWeightsResponse(
                    outcome=rollout_pb2.UPDATE_OUTCOME_FAILED,
                    weight_version=self.version,
                    error=f"plan.base_version: a delta against v{plan.base_version}, but this stand-in "
                    f"serves v{self.version}; nothing applied",
                    checksums=staged.checksums,
                )
            self.last_path = "cuda_ipc" if plan.HasField("cuda_ipc") else "group"
            paused_at = time.monotonic()  # pause(keep): a real engine stops scheduling here
            if plan.base_version:  # a delta: the changed tensors are copied over the served ones
                index = {name: i for i, name in enumerate(self.names)}
                for name, tensor in staged.named():
                    self.weights[index[name]].copy_(tensor)
                self.version = plan.version
            else:  # the swap: reference assignments; the buffer served until now becomes the spare
                self.spare_buffer, self.served_buffer = self.served_buffer, staged.buffer
                self.weights, self.version = staged.tensors, plan.version
                self.names = list(staged.names)
            paused_s = time.monotonic() - paused_at  # resume
            self._write_state()
        if self.version >= self.latest_seen:
            await self.server.set_serving(True)
        log.info("now serving v%d (transfer %.2fs, paused %.4fs)", self.version, staged.transfer_s, paused_s)
        return rollout_pb2.UpdateWeightsResponse(
            outcome=rollout_pb2.UPDATE_OUTCOME_APPLIED,
            weight_version=self.version,
            checksums=staged.checksums,
            transfer_seconds=staged.transfer_s,
            verify_seconds=staged.verify_s,
            paused_seconds=paused_s,
        )

    async def caught_up_to(self, latest_version: int) -> None:
        """Registered: serve only once holding the broadcast service's latest version."""
        self.latest_seen = latest_version
        await self.server.set_serving(self.version >= self.latest_seen)

    def device_uuid(self) -> str:
        """The GPU it receives on, registered so that a trainer on the same GPU hands it versions by
        CUDA IPC; "" on CPU."""
        if self.args.device == "cpu" or self.args.hide_device:
            return ""
        from parity.weights.devices import cuda_device_uuid

        return cuda_device_uuid(self.args.device)

    async def serve(self) -> int:
        from parity.config import ServiceConfig
        from parity.server import GrpcServer, install_shutdown_handlers
        from parity.v1 import rollout_pb2_grpc
        from parity.weights.membership_client import MembershipClient

        # Loaded before registering, as a real rollout worker has torch loaded (by vLLM) long before
        # it registers: a first UpdateWeights that paid the import would miss a short rendezvous
        # deadline on a loaded box (the trainer waited transfer_timeout_s=4 for this rank).
        for module in ("torch", "torch.distributed", "parity.weights.receiver"):
            importlib.import_module(module)

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
            device_uuid=self.device_uuid(),
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
    parser.add_argument("--device", default="cpu", help="receive onto this device (cuda: registers its GPU)")
    parser.add_argument(
        "--hide_device",
        action="store_true",
        help="register no GPU even with --device cuda (a same-GPU baseline over the gloo group)",
    )
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
    parser.add_argument(
        "--never_join", action="store_true", help="chaos: register and heartbeat, never join a data group"
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
