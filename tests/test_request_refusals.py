"""Request checks that need no running service: bounded error details, the UpdateWeights plan
check against the checkpoint, the CUDA IPC handle check, the registry's version range, the
membership's NOT_FOUND and the rollout servicer's pause/resume checks.

The same refusals over real gRPC are in tests/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import grpc
import pytest

from parity.errors import MAX_DETAILS_BYTES, RequestError, invalid, quote
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import common_pb2, rollout_pb2

SECRET = "s" * 32


# -- bounded details ------------------------------------------------------------------------------
def test_a_quoted_huge_value_leaves_the_details_short_and_the_field_first() -> None:
    refusal = invalid("address", f"expected HOST:PORT (got {quote('x' * 20_000)})")
    assert refusal.details.startswith("address: expected HOST:PORT (got 'xxx")
    assert "(20000 characters)" in refusal.details
    assert len(refusal.details.encode()) <= MAX_DETAILS_BYTES


def test_details_are_bounded_even_when_a_message_quotes_without_quote() -> None:
    refusal = RequestError(grpc.StatusCode.NOT_FOUND, "worker_id", "é" * 20_000)
    assert refusal.details.startswith("worker_id: éé")
    assert len(refusal.details.encode()) <= MAX_DETAILS_BYTES
    assert refusal.details.endswith("[cut: 20011 characters]")


def test_the_error_boundary_bounds_what_a_handler_aborts_with_itself() -> None:
    """A handler that passes a huge details string to `context.abort` (no RequestError) still
    reaches a real client as its own code, the field first (parity.server's boundary bounds it)."""
    from parity.config import ServiceConfig
    from parity.server import GrpcServer

    async def handler(request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"worker_id: {'n' * 20_000!r} is not registered")
        return b""

    async def scenario() -> grpc.aio.AioRpcError:
        server = GrpcServer(ServiceConfig(), ["test.Bounded"])
        server.server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "test.Bounded", {"Abort": grpc.unary_unary_rpc_method_handler(handler)}
                ),
            )
        )
        port = await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await chan.unary_unary("/test.Bounded/Abort")(b"", timeout=10)
            return caught.value
        finally:
            await server.server.stop(0)

    refusal = asyncio.run(scenario())
    assert refusal.code() == grpc.StatusCode.NOT_FOUND, refusal.details()
    assert refusal.details().startswith("worker_id: 'nnn")
    assert len(refusal.details().encode()) <= MAX_DETAILS_BYTES


# -- UpdateWeights: the plan against the checkpoint ----------------------------------------------
MODEL = {"embed.weight": (8, 4), "layers.0.w": (4, 4), "norm.weight": (4,)}


def _plan(names, base_version: int = 0, **fields) -> common_pb2.TransferPlan:
    return common_pb2.TransferPlan(
        version=7,
        base_version=base_version,
        tensors=[common_pb2.TensorMeta(name=n, shape=list(MODEL[n]), dtype="float32") for n in names],
        bucket_bytes=4096,
        checksum_algorithm=fields.pop("checksum_algorithm", common_pb2.CHECKSUM_ALGORITHM_WSUM64),
        rendezvous=common_pb2.Rendezvous(
            host="127.0.0.1",
            port=1234,
            rank=1,
            world_size=2,
            backend="gloo",
            group_name="g",
            timeout_s=30,
            secret=SECRET,
        ),
        **fields,
    )


def _check(plan: common_pb2.TransferPlan, full_version=None, **request_fields) -> None:
    from rollout.validation import check_update_request

    request = rollout_pb2.UpdateWeightsRequest(plan=plan, **request_fields)
    check_update_request(request, MODEL, False, full_version)


def _refusal(plan: common_pb2.TransferPlan, full_version=None, **request_fields) -> RequestError:
    with pytest.raises(RequestError) as caught:
        _check(plan, full_version, **request_fields)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


def test_a_whole_version_listing_only_some_tensors_is_refused_naming_the_missing() -> None:
    refusal = _refusal(_plan(["norm.weight"]))
    assert refusal.details.startswith(
        "plan.tensors: missing 2 of the model's 3 tensors: embed.weight, layers.0.w"
    )


def test_a_delta_lists_only_what_changed_and_is_accepted() -> None:
    _check(_plan(["norm.weight"], base_version=6))
    _check(_plan(list(MODEL)))  # a whole version lists every tensor


def test_a_whole_version_need_not_list_a_tied_head() -> None:
    shapes = {**MODEL, "lm_head.weight": (8, 4)}
    from rollout.validation import check_update_request

    request = rollout_pb2.UpdateWeightsRequest(plan=_plan(list(MODEL)))
    check_update_request(request, shapes, False, frozenset(MODEL))  # the trainer sends tied weights once
    with pytest.raises(RequestError, match=r"missing 1 of the model's 4 tensors: lm_head\.weight"):
        check_update_request(request, shapes, False)  # no full_version: every checkpoint name


def test_the_tiny_models_whole_version_is_its_parameters(tiny_model: Path) -> None:
    """The names a whole version must list are the names the trainer publishes: the model's
    parameters, the tied head once (trainer/loop.py full_weights, named_parameters order)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.validation import checkpoint_shapes, full_version_names

    shapes = checkpoint_shapes(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert full_version_names(shapes, tiny_model) == {name for name, _ in model.named_parameters()}
    assert "lm_head.weight" in shapes  # accepted when sent, not required


def test_a_tensor_listed_twice_is_refused() -> None:
    for base_version in (0, 6):
        names = [*MODEL, "layers.0.w"] if base_version == 0 else ["norm.weight", "norm.weight"]
        refusal = _refusal(_plan(names, base_version=base_version))
        assert refusal.field.startswith("plan.tensors[") and refusal.field.endswith("].name")
        assert "duplicate" in refusal.details


def test_an_unknown_checksum_algorithm_is_refused() -> None:
    refusal = _refusal(_plan(list(MODEL), checksum_algorithm=99))
    assert refusal.details.startswith("plan.checksum_algorithm: unknown ChecksumAlgorithm 99")
    _check(_plan(list(MODEL), checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED))  # WSUM64


@pytest.mark.parametrize("mode", [3, 99, -1])
def test_an_unknown_update_mode_is_refused(mode: int) -> None:
    refusal = _refusal(_plan(list(MODEL)), update_mode=mode)
    assert refusal.details.startswith(f"update_mode: unknown UpdateMode {mode}")
    _check(_plan(list(MODEL)), update_mode=common_pb2.UPDATE_MODE_RECOMPUTE)


# -- CUDA IPC handles -----------------------------------------------------------------------------
def _handle(**fields) -> common_pb2.CudaIpcHandle:
    handle = common_pb2.CudaIpcHandle(
        nbytes=4096, storage_handle=b"\x01" * 64, storage_size_bytes=8192, tensor_offset=1024,
        ref_counter_handle=b"\x02" * 16, device_uuid="GPU-0", timeout_s=60.0,
    )  # fmt: skip
    for name, value in fields.items():
        setattr(handle, name, value)
    return handle


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": 1e30}, "timeout_s"),
        ({"tensor_offset": -1}, "tensor_offset"),
        ({"storage_offset_bytes": -1}, "storage_offset_bytes"),
        ({"ref_counter_offset": -5}, "ref_counter_offset"),
        ({"device_index": -1}, "device_index"),
        ({"storage_size_bytes": 0}, "storage_size_bytes"),
        ({"tensor_offset": 8192}, "storage_size_bytes"),  # the buffer would end past its storage
        ({"storage_size_bytes": -(2**63)}, "storage_size_bytes"),
    ],
)
def test_a_handle_no_mapping_may_be_made_with_is_refused_naming_the_field(fields: dict, field: str) -> None:
    from parity.weights.cuda_ipc import handle_problem

    assert handle_problem(_handle()) is None
    assert handle_problem(_handle(timeout_s=0.0)) is None  # 0: the receiver's default
    problem = handle_problem(_handle(**fields))
    assert problem is not None and problem[0] == field, problem
    plan = common_pb2.TransferPlan(version=1, bucket_bytes=4096, cuda_ipc=_handle(**fields))
    plan.tensors.add(name="norm.weight", shape=[4], dtype="float32")
    with pytest.raises(RequestError) as caught:  # the rollout's check of an IPC plan
        _check(plan)
    assert caught.value.details.startswith(f"plan.cuda_ipc.{field}: ")


# -- the broadcast registry and membership --------------------------------------------------------
def _publish(version: int) -> pb.PublishVersionRequest:
    return pb.PublishVersionRequest(
        version=version,
        model="toy",
        tensors=[common_pb2.TensorMeta(name="w", shape=[4], dtype="float32")],
        checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
    )


def test_a_version_without_an_int64_successor_is_refused_and_a_resumed_numbering_is_not() -> None:
    from broadcast.events import EventLog
    from broadcast.registry import MAX_VERSION, VersionRegistry

    registry = VersionRegistry(EventLog())
    for version in (2**63 - 1, MAX_VERSION + 1):
        with pytest.raises(RequestError) as caught:
            registry.validate(_publish(version))
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details.startswith("version: must be in [1, ")
    registry.validate(_publish(500))  # a resumed trainer's next version, to a fresh service
    registry.commit(registry.begin(_publish(500), 4096, epoch=1), 0.0)
    registry.validate(_publish(501))


def test_heartbeat_of_an_unknown_worker_is_not_found() -> None:
    from broadcast.membership import Membership

    members = Membership(max_workers=4, heartbeat_timeout_s=10, exclude_s=1)
    with pytest.raises(RequestError) as caught:
        members.heartbeat(pb.HeartbeatRequest(worker_id="w" * 20_000))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.details.startswith("worker_id: 'www")
    assert len(caught.value.details.encode()) <= MAX_DETAILS_BYTES


# -- the rollout servicer's pause and resume -----------------------------------------------------
class _PausableEngine:
    """Records pause/resume calls; nothing else of an engine is used by these RPCs."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def pause(self, mode: str) -> None:
        self.calls.append(f"pause:{mode}")

    async def resume(self) -> None:
        self.calls.append("resume")


def _servicer(tiny_model: Path):
    from parity.config import ParityConfig
    from services.rollout.service import RolloutServicer

    return RolloutServicer(ParityConfig(), _PausableEngine(), tiny_model)  # type: ignore[arg-type]


def _with_unknown_field(message) -> object:
    raw = message.SerializeToString() + b"\xf8\x06\x01"  # field 111, varint 1
    return type(message).FromString(raw)


def test_pause_refuses_an_unknown_mode_and_pauses_nothing(tiny_model: Path) -> None:
    servicer = _servicer(tiny_model)
    with pytest.raises(RequestError) as caught:
        asyncio.run(servicer.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode=42), None))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details.startswith("mode: unknown UpdateMode 42")
    assert servicer.engine.calls == [] and not servicer.paused
    asyncio.run(servicer.PauseGeneration(rollout_pb2.PauseGenerationRequest(), None))
    assert servicer.engine.calls == [f"pause:{servicer.config.update_mode}"] and servicer.paused


@pytest.mark.parametrize("method", ["PauseGeneration", "ResumeGeneration"])
def test_pause_and_resume_make_the_same_checks(tiny_model: Path, method: str) -> None:
    """Unknown fields are INVALID_ARGUMENT and a dead engine UNAVAILABLE for both RPCs; a stopping
    service refuses a pause."""
    request = getattr(rollout_pb2, f"{method}Request")()
    servicer = _servicer(tiny_model)
    servicer.paused, servicer._paused_at = True, 0.0  # a resume would act
    with pytest.raises(RequestError) as caught:
        asyncio.run(getattr(servicer, method)(_with_unknown_field(request), None))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "unknown field" in caught.value.details
    if method == "PauseGeneration":
        servicer.shutting_down = True
        with pytest.raises(RequestError) as caught:
            asyncio.run(getattr(servicer, method)(request, None))
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert caught.value.details == "service: shutting down"
    servicer.shutting_down, servicer.engine_down = False, True
    with pytest.raises(RequestError) as caught:
        asyncio.run(getattr(servicer, method)(request, None))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.field == "engine"
    assert servicer.engine.calls == [] and servicer.paused


def test_a_resume_goes_through_while_the_service_stops(tiny_model: Path) -> None:
    """A client's pause must not hold the requests in flight through the stop's grace period."""
    servicer = _servicer(tiny_model)
    servicer.paused, servicer._paused_at, servicer.shutting_down = True, 0.0, True
    asyncio.run(servicer.ResumeGeneration(rollout_pb2.ResumeGenerationRequest(), None))
    assert servicer.engine.calls == ["resume"] and not servicer.paused


# -- the rollout's membership client and NOT_FOUND -----------------------------------------------
@pytest.mark.slow
def test_a_worker_the_service_does_not_know_registers_again(start_services) -> None:
    """The broadcast service answers a heartbeat of an unregistered worker NOT_FOUND; the rollout's
    membership client (parity.weights.membership_client) registers again on it."""
    from parity.server import bearer, channel
    from parity.v1 import broadcast_pb2_grpc
    from parity.weights.membership_client import MembershipClient

    token = "refusals-token"
    service = start_services(
        "broadcast", "--heartbeat_interval_s", "0.2", "--auth_token", token, timeout_s=240
    )

    async def scenario() -> list[int]:
        registered: list[int] = []
        client = MembershipClient(
            service.address, "w-dropped", "127.0.0.1:1", token, 0.2, lambda: 0, registered.append
        )
        task = asyncio.create_task(client.run())
        try:
            async with channel(service.address) as chan:
                stub = broadcast_pb2_grpc.WeightBroadcastServiceStub(chan)
                for _ in range(100):
                    if registered:
                        break
                    await asyncio.sleep(0.05)
                await stub.UnregisterWorker(
                    pb.UnregisterWorkerRequest(worker_id="w-dropped"), metadata=bearer(token), timeout=5
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:  # what the client's next beat meets
                    await stub.Heartbeat(pb.HeartbeatRequest(worker_id="w-dropped"), metadata=bearer(token))
                assert caught.value.code() == grpc.StatusCode.NOT_FOUND
                for _ in range(100):
                    if len(registered) >= 2:
                        break
                    await asyncio.sleep(0.05)
                status = await stub.GetStatus(pb.WeightBroadcastServiceGetStatusRequest(), timeout=5)
                assert [w.worker_id for w in status.workers if w.state == pb.WORKER_STATE_SERVING] == [
                    "w-dropped"
                ]
        finally:
            task.cancel()
            await client.unregister()
        return registered

    assert len(asyncio.run(scenario())) >= 2


def test_a_registration_refused_for_its_token_is_an_error_naming_it_not_a_retry_forever(
    start_services, tiny_model: Path
) -> None:
    """A wrong token stays wrong: the membership client raises, naming rollout.auth_token (the
    rollout service then stops with that line), instead of retrying every 5 s for good."""
    from parity.weights.membership_client import MembershipClient, MembershipRefused

    service = start_services("broadcast", "--auth_token", "the-right-token", timeout_s=240)

    async def register(token: str, worker_id: str) -> str:
        client = MembershipClient(
            service.address, worker_id, "127.0.0.1:1", token, 1.0, lambda: 0, lambda _v: None
        )
        try:
            await asyncio.wait_for(client.register(), timeout=30)
            return "registered"
        except MembershipRefused as exc:
            return str(exc)
        finally:
            await client.unregister()

    refused = asyncio.run(register("a-wrong-token", "w-wrong"))
    assert refused.startswith("rollout.auth_token: the broadcast service at") and "UNAUTHENTICATED" in refused
    assert asyncio.run(register("the-right-token", "w-right")) == "registered"

    # the rollout service itself: it stops (exit 1) with that line rather than never serving
    rollout = start_services(
        "rollout", "--engine", "reference", "--model", str(tiny_model), "--max_model_len", "128",
        "--broadcast_address", service.address, "--auth_token", "a-wrong-token", wait=False,
    )  # fmt: skip
    assert rollout.proc.wait(600) == 1, rollout.log_tail()
    assert "rollout.auth_token: the broadcast service at" in rollout.log_path.read_text()
