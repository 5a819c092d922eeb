"""`grpc:HOST:PORT`: a reward computed by a `parity.v1.RewardService` (protos/parity/v1/reward.proto).

Invariants:
  - One Score call per batch (a GRPO group, or an eval batch), with a deadline of `timeout_s`.
  - UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are retried `retries` times with
    exponential backoff (`backoff_s`, doubling); any other status, and a message over gRPC's size
    limit, fails at once (parity/grpc_retry.py). A reply without
    exactly one score per item fails. Failures raise `RewardFailed` naming the address and status.
  - The channel is a grpc.aio channel made on first use in the calling event loop (replaced when the loop changes), so
    the actor's loop never blocks on the network.
  - Metadata travels as a google.protobuf.Struct (JSON types); nothing is pickled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import grpc

from parity.grpc_retry import retryable
from parity.server import channel
from rollout.rewards.scorer import RewardFailed
from rollout.tasks import Prompt


class RemoteReward:
    """A RewardService client; `await score(prompt, completions, task, request_id)`."""

    def __init__(self, address: str, timeout_s: float, retries: int, backoff_s: float = 0.2) -> None:
        self.address, self.timeout_s, self.retries, self.backoff_s = address, timeout_s, retries, backoff_s
        self.name = f"grpc:{address}"
        self._channel: tuple[asyncio.AbstractEventLoop, grpc.aio.Channel] | None = None

    def _stub(self):
        from parity.v1 import reward_pb2_grpc

        loop = asyncio.get_running_loop()
        if self._channel is None or self._channel[0] is not loop:  # aio channels belong to one loop
            self._channel = (loop, channel(self.address))
        return reward_pb2_grpc.RewardServiceStub(self._channel[1])

    def request(self, prompt: Prompt, completions: Sequence[str], task: str, request_id: str):
        from google.protobuf import struct_pb2

        from parity.v1 import reward_pb2

        metadata = struct_pb2.Struct()
        metadata.update(json.loads(json.dumps(dict(prompt.metadata), default=str)))
        items = [
            reward_pb2.ScoreItem(
                prompt_id=prompt.prompt_id,
                prompt=prompt.text,
                completion=c,
                answer=prompt.answer,
                metadata=metadata,
            )
            for c in completions
        ]
        return reward_pb2.ScoreRequest(request_id=request_id, task=task, items=items)

    async def score(
        self, prompt: Prompt, completions: Sequence[str], task: str, request_id: str
    ) -> list[float]:
        request = self.request(prompt, completions, task, request_id)
        stub = self._stub()
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                reply = await stub.Score(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if retryable(exc) and attempt < self.retries:
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                kind = "timeout" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "error"
                raise RewardFailed(
                    kind, f"{self.name}: {exc.code().name}: {exc.details()} (attempt {attempt + 1})"
                ) from None
            if len(reply.scores) != len(completions):
                raise RewardFailed(
                    "error", f"{self.name}: {len(reply.scores)} scores for {len(completions)} completions"
                )
            return [float(s) for s in reply.scores]
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._channel is not None and self._channel[0] is asyncio.get_running_loop():
            await self._channel[1].close()
        self._channel = None
