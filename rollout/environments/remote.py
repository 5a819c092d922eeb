"""`env:grpc:HOST:PORT`: episodes played by a `parity.v1.EnvironmentService`
(protos/parity/v1/environment.proto), in any language.

Invariants:
  - Every RPC attempt has a deadline of `step_timeout_s`. UNAVAILABLE, DEADLINE_EXCEEDED and
    RESOURCE_EXHAUSTED are retried `retries` times with exponential backoff (`backoff_s`, doubling);
    any other status, and a message over gRPC's size limit, fails at once (parity/grpc_retry.py).
    The whole call (attempts and backoff) is bounded too, so an
    episode never waits longer than `call_deadline_s`.
  - Retries are safe because calls are idempotent by id: Reset by episode_id, Step by
    (episode_id, step_index), Close by episode_id. A retried Step carries the same step_index.
  - A failure raises `EnvironmentFailed` naming the address, the episode, the call and the status:
    reason "timeout" for DEADLINE_EXCEEDED, "error" for any other status; a reply with a non-finite
    reward is "malformed" and an observation over the limit "oversized" (checked in base.py).
  - Auth: the RewardService client sends no token; this client sends `authorization: Bearer <token>`
    on every call when PARITY_AUTH_TOKEN is set (or `auth_token` is given), so a server shared
    beyond loopback can refuse strangers. Nothing else is sent from the environment.
  - Episode calls use a grpc.aio channel made on first use in the calling event loop (replaced when
    the loop changes), so the actor's loop never blocks on the network. Records (ListRecords) are
    read through a blocking channel, one page of `page_size` records per call.
  - Records travel as google.protobuf.Struct: numbers arrive as doubles, and whole ones are given
    back as ints, so a record reads the same on both sides of the wire.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import grpc

from parity.grpc_retry import retryable
from parity.server import CHANNEL_OPTIONS, channel
from rollout.environments.base import (
    DEFAULT_MAX_OBSERVATION_CHARS,
    DEFAULT_STEP_TIMEOUT_S,
    AsyncEpisodeEnv,
    EnvironmentFailed,
    EnvironmentSource,
    StepResult,
)

AUTH_TOKEN_ENV = "PARITY_AUTH_TOKEN"
T = TypeVar("T")


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def to_struct(record: Mapping[str, Any]):
    from google.protobuf import struct_pb2

    struct = struct_pb2.Struct()
    struct.update(json.loads(json.dumps(dict(record), default=str)))
    return struct


def _whole_numbers_as_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _whole_numbers_as_int(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole_numbers_as_int(v) for v in value]
    return value


def from_struct(struct) -> dict:
    from google.protobuf import json_format

    return _whole_numbers_as_int(json_format.MessageToDict(struct))


class EnvironmentClient:
    """The connection to one EnvironmentService, shared by every episode of a source."""

    def __init__(
        self,
        address: str,
        *,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        retries: int = 2,
        backoff_s: float = 0.2,
        auth_token: str | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries: must be >= 0, got {retries}")
        self.address, self.step_timeout_s, self.retries, self.backoff_s = (
            address,
            step_timeout_s,
            retries,
            backoff_s,
        )
        self.name = f"grpc:{address}"
        self.metadata = auth_metadata(
            os.environ.get(AUTH_TOKEN_ENV, "") if auth_token is None else auth_token
        )
        self._aio: tuple[asyncio.AbstractEventLoop, grpc.aio.Channel] | None = None
        self._blocking: grpc.Channel | None = None

    @property
    def call_deadline_s(self) -> float:
        """The longest one call may take: every attempt's deadline plus the backoff between them."""
        backoff = sum(self.backoff_s * 2**i for i in range(self.retries))
        return self.step_timeout_s * (self.retries + 1) + backoff + 1.0

    def aio_stub(self):
        from parity.v1 import environment_pb2_grpc

        loop = asyncio.get_running_loop()
        if self._aio is None or self._aio[0] is not loop:  # aio channels belong to one loop
            self._aio = (loop, channel(self.address))
        return environment_pb2_grpc.EnvironmentServiceStub(self._aio[1])

    def blocking_stub(self):
        from parity.v1 import environment_pb2_grpc

        if self._blocking is None:
            self._blocking = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return environment_pb2_grpc.EnvironmentServiceStub(self._blocking)

    def _failed(self, exc: grpc.RpcError, call: str, attempt: int, episode_id: str) -> EnvironmentFailed:
        code = exc.code()
        reason = "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "error"
        where = f"environment {self.name}" + (f", episode {episode_id}" if episode_id else "")
        return EnvironmentFailed(
            reason, f"{where}: {call}: {code.name}: {exc.details()} (attempt {attempt + 1})"
        )

    async def call(self, call: str, rpc: Callable[[], Awaitable[T]], episode_id: str = "") -> T:
        """`rpc()` (one attempt) retried as the module docstring says."""
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await rpc()
            except grpc.aio.AioRpcError as exc:
                if retryable(exc) and attempt < self.retries:
                    await asyncio.sleep(delay)
                    delay *= 2
                    continue
                raise self._failed(exc, call, attempt, episode_id) from None
        raise AssertionError("unreachable")

    def call_blocking(self, call: str, rpc: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return rpc()
            except grpc.RpcError as exc:
                if retryable(exc) and attempt < self.retries:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise self._failed(exc, call, attempt, "") from None  # type: ignore[arg-type]
        raise AssertionError("unreachable")

    def list_records(self, split: str, seed: int, offset: int, limit: int) -> list[dict]:
        """One page of records (`split` is "train" or "eval")."""
        from parity.v1 import environment_pb2

        request = environment_pb2.ListRecordsRequest(
            split=environment_pb2.RECORD_SPLIT_TRAIN
            if split == "train"
            else environment_pb2.RECORD_SPLIT_EVAL,
            seed=seed,
            offset=offset,
            limit=limit,
        )
        stub = self.blocking_stub()
        reply = self.call_blocking(
            f"ListRecords({split}, offset {offset})",
            lambda: stub.ListRecords(request, timeout=self.step_timeout_s, metadata=self.metadata),
        )
        if len(reply.records) > limit:
            raise EnvironmentFailed(
                "malformed",
                f"environment {self.name}: ListRecords: {len(reply.records)} records for limit {limit}",
            )
        return [from_struct(r) for r in reply.records]

    async def close(self) -> None:
        if self._aio is not None and self._aio[0] is asyncio.get_running_loop():
            await self._aio[1].close()
        self._aio = None
        if self._blocking is not None:
            self._blocking.close()
            self._blocking = None


class RemoteEnv(AsyncEpisodeEnv):
    """One episode played over gRPC (module docstring)."""

    def __init__(
        self,
        client: EnvironmentClient,
        episode_id: str,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
    ) -> None:
        super().__init__(client.name, episode_id, client.step_timeout_s, max_observation_chars)
        self.client = client

    @property
    def call_deadline_s(self) -> float:
        return self.client.call_deadline_s

    async def _reset(self, record: Mapping[str, Any]) -> str:
        from parity.v1 import environment_pb2

        request = environment_pb2.ResetRequest(episode_id=self.episode_id, record=to_struct(record))
        stub = self.client.aio_stub()
        reply = await self.client.call(
            "reset",
            lambda: stub.Reset(request, timeout=self.step_timeout_s, metadata=self.client.metadata),
            self.episode_id,
        )
        return reply.observation

    async def _step(self, action: str, step_index: int) -> StepResult:
        from parity.v1 import environment_pb2

        request = environment_pb2.StepRequest(
            episode_id=self.episode_id, step_index=step_index, action=action
        )
        stub = self.client.aio_stub()
        reply = await self.client.call(
            f"step {step_index}",
            lambda: stub.Step(request, timeout=self.step_timeout_s, metadata=self.client.metadata),
            self.episode_id,
        )
        return StepResult(observation=reply.observation, reward=reply.reward, done=reply.done)

    async def _close(self) -> None:
        from parity.v1 import environment_pb2

        request = environment_pb2.CloseRequest(episode_id=self.episode_id)
        stub = self.client.aio_stub()
        await self.client.call(
            "close",
            lambda: stub.Close(request, timeout=self.step_timeout_s, metadata=self.client.metadata),
            self.episode_id,
        )


class RemoteSource(EnvironmentSource):
    """`env:grpc:HOST:PORT`: episodes and records from an EnvironmentService."""

    def __init__(
        self,
        address: str,
        *,
        seed: int = 0,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        max_observation_chars: int = DEFAULT_MAX_OBSERVATION_CHARS,
        retries: int = 2,
        backoff_s: float = 0.2,
        page_size: int = 256,
        auth_token: str | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.client = EnvironmentClient(
            address,
            step_timeout_s=step_timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            auth_token=auth_token,
        )
        super().__init__(self.client.name, seed)
        self.max_observation_chars, self.page_size = max_observation_chars, page_size

    def new_episode(self, episode_id: str) -> RemoteEnv:
        return RemoteEnv(self.client, episode_id, self.max_observation_chars)

    def _train_records(self, seed: int) -> Iterator[dict]:
        offset = 0
        while True:
            page = self.client.list_records("train", seed, offset, self.page_size)
            if not page:
                if offset == 0:
                    raise EnvironmentFailed(
                        "malformed", f"environment {self.name}: ListRecords: no training records"
                    )
                offset = 0  # a finite stream: read it again
                continue
            yield from page
            offset += len(page)

    def _eval_records(self, n: int) -> list[dict]:
        return self.client.list_records("eval", 0, 0, n)

    async def close(self) -> None:
        await self.client.close()
