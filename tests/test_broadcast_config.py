"""Broadcast service configuration and registry rules that need no processes."""

from __future__ import annotations

import grpc
import pytest

from parity import checksum
from parity.config import ConfigError, load
from parity.errors import RequestError
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import common_pb2
from services.broadcast import server
from services.broadcast.events import EventLog
from services.broadcast.registry import VersionRegistry, reached


def test_non_loopback_bind_without_token_is_refused_at_startup(capsys: pytest.CaptureFixture[str]) -> None:
    assert server.main(["--host", "0.0.0.0"]) == 2
    assert "broadcast.auth_token: required" in capsys.readouterr().err


def test_config_errors_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^broadcast\.backend:"):
        load(["--backend", "mpi"], home="broadcast", environ={})
    with pytest.raises(ConfigError, match=r"^broadcast\.heartbeat_timeout_s:"):
        load(["--heartbeat_interval_s", "5", "--heartbeat_timeout_s", "2"], home="broadcast", environ={})
    environ = {"PARITY_BROADCAST_TRANSFER_TIMEOUT_S": "7.5"}
    config = load(["--backend", "nccl"], home="broadcast", environ=environ).config.broadcast
    assert (config.transfer_timeout_s, config.device, config.host) == (7.5, "cuda", "127.0.0.1")


def _request(version: int, shape=(4, 4), dtype: str = "float32") -> pb.PublishVersionRequest:
    import torch

    meta = checksum.describe([("w", torch.zeros(4, 4))])[0]
    meta.ClearField("shape")
    meta.shape.extend(shape)
    meta.dtype = dtype
    return pb.PublishVersionRequest(
        version=version, model="m", tensors=[meta], checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64
    )


def test_registry_is_monotonic_and_schema_bound() -> None:
    registry = VersionRegistry(EventLog())
    with pytest.raises(RequestError) as bad:
        registry.validate(_request(0))
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "version" in bad.value.details
    registry.validate(_request(1))
    first = registry.begin(_request(1), 4096, "cpu")
    registry.commit(first, 0.1)
    for request, code, field in [
        (_request(1), grpc.StatusCode.FAILED_PRECONDITION, "backwards"),
        (_request(3), grpc.StatusCode.FAILED_PRECONDITION, "must be 2"),
        (_request(2, shape=(4, 5)), grpc.StatusCode.INVALID_ARGUMENT, "shape"),
        (_request(2, dtype="bfloat16"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ]:
        with pytest.raises(RequestError) as caught:
            registry.validate(request)
        assert caught.value.code == code and field in caught.value.details
    # a failed version may be published again under the same number
    second = registry.begin(_request(2), 4096, "cpu")
    registry.fail(second, "trainer died")
    registry.validate(_request(2))
    assert registry.latest_committed == 1 and registry.head == 1
    assert reached(pb.VERSION_STATE_DISTRIBUTED, pb.VERSION_STATE_COMMITTED)
    assert not reached(pb.VERSION_STATE_FAILED, pb.VERSION_STATE_COMMITTED)
