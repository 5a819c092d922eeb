"""The one error boundary (parity.server.ErrorBoundaryInterceptor) on a real aio server, in process.

Handlers here raise each kind of exception the services can raise; the test checks the code and
details a real client sees. Class names stand in for vLLM's exceptions: the boundary matches them by
name along the MRO, so this is the same path a real VLLMValidationError or EngineDeadError takes.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from parity.config import ServiceConfig
from parity.errors import invalid, overloaded
from parity.server import GrpcServer
from parity.v1 import trainer_pb2


class VLLMClientError(Exception):
    pass


class VLLMValidationError(VLLMClientError):  # same name and base name as vLLM's
    pass


class EngineDeadError(Exception):
    pass


RAISES = {
    "Invalid": invalid("sampling.n", "must be > 0"),
    "Overloaded": overloaded("in_flight_requests", "3 in flight (max 3)", retry_after_s=0.25),
    "Vllm": VLLMValidationError("temperature must be in [0, 2], got 2.5."),
    "Dead": EngineDeadError("EngineCore encountered an issue."),
    "Bug": KeyError("oops"),
}


async def _serve_and_call(calls: list[tuple[str, bytes]]) -> list[tuple[grpc.StatusCode, str, tuple]]:
    def behavior(exc: Exception):
        async def handler(request: trainer_pb2.StopRequest, context):
            assert isinstance(request, trainer_pb2.StopRequest)
            raise exc

        return grpc.unary_unary_rpc_method_handler(
            handler,
            request_deserializer=trainer_pb2.StopRequest.FromString,
            response_serializer=trainer_pb2.StopResponse.SerializeToString,
        )

    async def stream(request: trainer_pb2.StopRequest, context):
        yield trainer_pb2.StopResponse(step=1)
        raise RAISES["Invalid"]

    handlers = {name: behavior(exc) for name, exc in RAISES.items()}
    handlers["Stream"] = grpc.unary_stream_rpc_method_handler(
        stream,
        request_deserializer=trainer_pb2.StopRequest.FromString,
        response_serializer=trainer_pb2.StopResponse.SerializeToString,
    )
    server = GrpcServer(ServiceConfig(), ["test.Boundary"])
    server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Boundary", handlers),))
    port = await server.start()
    answers = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
            for name, payload in calls:
                path = f"/test.Boundary/{name}"
                call = chan.unary_stream(path) if name == "Stream" else chan.unary_unary(path)
                try:
                    if name == "Stream":
                        async for _ in call(payload, timeout=10):
                            pass
                    else:
                        await call(payload, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    answers.append((exc.code(), exc.details(), tuple(exc.trailing_metadata() or ())))
    finally:
        await server.stop(0.5)
    return answers


def test_each_exception_maps_to_its_code(caplog: pytest.LogCaptureFixture) -> None:
    calls = [(name, b"") for name in [*RAISES, "Stream"]] + [("Invalid", b"\xff\xff\xff\xff\x0f")]
    with caplog.at_level(logging.ERROR, logger="parity.server"):
        answers = asyncio.run(_serve_and_call(calls))
    codes = [code for code, _, _ in answers]
    assert codes == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.INVALID_ARGUMENT,  # raised mid-stream, after one message
        grpc.StatusCode.INVALID_ARGUMENT,  # bytes that do not decode
    ]
    details = [text for _, text, _ in answers]
    assert details[0] == "sampling.n: must be > 0"
    assert details[1].startswith("in_flight_requests: 3 in flight (max 3); retry after 0.25s")
    assert ("retry-after-ms", "250") in [tuple(m) for m in answers[1][2]]
    assert details[2].startswith("sampling: VLLMValidationError: temperature must be in [0, 2]")
    assert details[3].startswith("engine: EngineDeadError")
    assert details[6].startswith("request: cannot decode the /test.Boundary/Invalid request (5 bytes)")
    # A bug: INTERNAL with a trace id, and the same id in the log with the traceback.
    trace_id = details[4].removeprefix("internal error (trace id ").removesuffix(")")
    assert len(trace_id) == 32 and "oops" not in details[4]
    logged = [r for r in caplog.records if trace_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None
