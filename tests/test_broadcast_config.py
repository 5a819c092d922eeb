"""Broadcast service configuration and registry rules that need no processes."""

from __future__ import annotations

import grpc
import pytest

from broadcast.events import EventLog
from broadcast.membership import Membership
from broadcast.registry import VersionRegistry, reached
from parity.config import ConfigError, load
from parity.errors import RequestError
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import common_pb2
from parity.weights import checksum
from services.broadcast import server


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
    assert (config.transfer_timeout_s, config.backend, config.host) == (7.5, "nccl", "127.0.0.1")


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
    first = registry.begin(_request(1), 4096, epoch=1)
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
    second = registry.begin(_request(2), 4096, epoch=1)
    registry.fail(second, "trainer died")
    registry.validate(_request(2))
    assert registry.latest_committed == 1 and registry.head == 1
    assert reached(pb.VERSION_STATE_DISTRIBUTED, pb.VERSION_STATE_COMMITTED)
    assert not reached(pb.VERSION_STATE_FAILED, pb.VERSION_STATE_COMMITTED)


def test_a_failed_first_publish_registers_nothing_so_the_next_valid_one_succeeds() -> None:
    registry = VersionRegistry(EventLog())
    bogus = _request(1, shape=(8, 1 << 30))  # 32 GiB: no worker can receive it
    registry.validate(bogus)
    registry.fail(registry.begin(bogus, 4096, epoch=1), "plan: 34359738368 bytes do not fit in cpu memory")
    assert registry.schema == [] and registry.model == "" and registry.head == 0
    registry.validate(_request(1))  # the real model, same number: accepted
    registry.commit(registry.begin(_request(1), 4096, epoch=2), 0.1)
    assert registry.schema == [("w", (4, 4), "float32")] and registry.latest_committed == 1


def test_heartbeats_prove_liveness_only_and_membership_changes_start_a_new_epoch() -> None:
    members = Membership(max_workers=4, heartbeat_timeout_s=5.0, exclude_s=30.0)
    members.register(pb.RegisterWorkerRequest(worker_id="a", address="127.0.0.1:1", weight_version=3))
    first, new = members.current_epoch()
    assert new and first.members == ("a",) and len(first.secret) == 32
    assert members.current_epoch() == (first, False)  # reused while nothing changes
    members.heartbeat(pb.HeartbeatRequest(worker_id="a", weight_version=10**15))
    worker = members.live["a"]
    assert (worker.weight_version, worker.verified, worker.claimed_version) == (0, False, 3)
    members.register(pb.RegisterWorkerRequest(worker_id="b", address="127.0.0.1:2", weight_version=0))
    second, new = members.current_epoch()
    assert new and second.members == ("a", "b") and second.number == first.number + 1
    assert second.group_name != first.group_name and second.secret != first.secret
    members.exclude("b", "never joined")
    third, new = members.current_epoch()
    assert new and third.members == ("a",)


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), 1e30])
def test_update_weights_with_a_nonfinite_or_huge_rendezvous_timeout_is_invalid_argument(
    timeout_s: float,
) -> None:
    from parity.v1 import rollout_pb2
    from rollout.validation import check_update_request

    meta = checksum.describe([("w", __import__("torch").zeros(4, 4))])[0]
    plan = common_pb2.TransferPlan(
        version=1,
        tensors=[meta],
        bucket_bytes=4096,
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
        rendezvous=common_pb2.Rendezvous(
            host="127.0.0.1", port=1234, rank=1, world_size=2, backend="gloo", group_name="g",
            timeout_s=timeout_s, secret="s" * 32,
        ),
    )  # fmt: skip
    with pytest.raises(RequestError) as caught:
        check_update_request(rollout_pb2.UpdateWeightsRequest(plan=plan), {"w": (4, 4)}, False)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "plan.rendezvous.timeout_s" in caught.value.details
