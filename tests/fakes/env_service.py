"""A small Python EnvironmentService (grpc.aio) serving any Python `Environment` class, run in a
background thread with its own event loop, for the `env:grpc:HOST:PORT` tests.

It keeps the protocol's idempotency rules (a repeated Reset restarts the episode; a repeated Step
index answers its first reply) and can inject faults: `drop_replies` loses the first reply of the
listed step indexes (UNAVAILABLE after the step was applied, as when a connection drops), `hang_s`
delays every Step, `token` requires `authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import grpc

from parity.v1 import environment_pb2, environment_pb2_grpc
from rollout.environments.remote import from_struct, to_struct


class PythonEnvironmentService(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, environment: type, token: str = "") -> None:
        self.environment, self.token = environment, token
        self.episodes: dict[str, tuple[Any, list[environment_pb2.StepResponse]]] = {}
        self.drop_replies: set[int] = set()
        self.hang_s = 0.0
        self.steps_applied = 0
        self.calls: list[tuple[str, str, int]] = []  # (method, episode_id, step_index)
        self.metadata: list[dict[str, str]] = []
        self.closed: list[str] = []

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.metadata.append(metadata)
        if self.token and metadata.get("authorization") != f"Bearer {self.token}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: needs 'Bearer <token>'")

    async def Reset(self, request, context):
        await self._check(context)
        self.calls.append(("Reset", request.episode_id, 0))
        env = self.environment()
        observation = env.reset(from_struct(request.record))
        self.episodes[request.episode_id] = (env, [])
        return environment_pb2.ResetResponse(observation=observation)

    async def Step(self, request, context):
        await self._check(context)
        self.calls.append(("Step", request.episode_id, request.step_index))
        if self.hang_s:
            await asyncio.sleep(self.hang_s)
        if request.episode_id not in self.episodes:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"episode_id: unknown {request.episode_id}")
        env, replies = self.episodes[request.episode_id]
        if request.step_index < len(replies):
            return replies[request.step_index]
        observation, reward, done = env.step(request.action)
        self.steps_applied += 1
        replies.append(environment_pb2.StepResponse(observation=observation, reward=reward, done=done))
        if request.step_index in self.drop_replies:
            self.drop_replies.discard(request.step_index)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped (injected)")
        return replies[-1]

    async def Close(self, request, context):
        await self._check(context)
        self.closed.append(request.episode_id)
        self.episodes.pop(request.episode_id, None)
        return environment_pb2.CloseResponse()

    async def ListRecords(self, request, context):
        await self._check(context)
        self.calls.append(("ListRecords", "", request.offset))
        if request.split == environment_pb2.RECORD_SPLIT_TRAIN:
            stream = self.environment.train_records(request.seed)
            records = list(itertools.islice(stream, request.offset, request.offset + request.limit))
        else:
            records = self.environment.eval_records(request.offset + request.limit)[request.offset :]
        return environment_pb2.ListRecordsResponse(records=[to_struct(r) for r in records])


class ServerThread:
    """`with ServerThread(servicer) as address:` serves on 127.0.0.1, port chosen by the OS."""

    def __init__(self, servicer: environment_pb2_grpc.EnvironmentServiceServicer) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="env-service", daemon=True)
        self._server: grpc.aio.Server | None = None

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(self.servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def __enter__(self) -> str:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return f"127.0.0.1:{port}"

    def __exit__(self, *exc_info: object) -> None:
        assert self._server is not None
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def serving(environment: type, token: str = "") -> Iterator[tuple[str, PythonEnvironmentService]]:
    """`with serving(Env) as (address, servicer):` a server for `Env` on 127.0.0.1."""
    servicer = PythonEnvironmentService(environment, token)
    with ServerThread(servicer) as address:
        yield address, servicer
