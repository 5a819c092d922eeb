from parity.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_STATE_RECEIVING: _ClassVar[VersionState]
    VERSION_STATE_COMMITTED: _ClassVar[VersionState]
    VERSION_STATE_DISTRIBUTED: _ClassVar[VersionState]
    VERSION_STATE_FAILED: _ClassVar[VersionState]
    VERSION_STATE_SUPERSEDED: _ClassVar[VersionState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_UPDATING: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
    WORKER_STATE_DROPPED: _ClassVar[WorkerState]

class VersionEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_EVENT_KIND_UNSPECIFIED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_PUBLISHED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_COMMITTED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_WORKER_UPDATED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_WORKER_FAILED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_DISTRIBUTED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_FAILED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_SUPERSEDED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_WORKER_JOINED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_WORKER_DROPPED: _ClassVar[VersionEventKind]
    VERSION_EVENT_KIND_EPOCH_STARTED: _ClassVar[VersionEventKind]
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_RECEIVING: VersionState
VERSION_STATE_COMMITTED: VersionState
VERSION_STATE_DISTRIBUTED: VersionState
VERSION_STATE_FAILED: VersionState
VERSION_STATE_SUPERSEDED: VersionState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_UPDATING: WorkerState
WORKER_STATE_FAILED: WorkerState
WORKER_STATE_DROPPED: WorkerState
VERSION_EVENT_KIND_UNSPECIFIED: VersionEventKind
VERSION_EVENT_KIND_PUBLISHED: VersionEventKind
VERSION_EVENT_KIND_COMMITTED: VersionEventKind
VERSION_EVENT_KIND_WORKER_UPDATED: VersionEventKind
VERSION_EVENT_KIND_WORKER_FAILED: VersionEventKind
VERSION_EVENT_KIND_DISTRIBUTED: VersionEventKind
VERSION_EVENT_KIND_FAILED: VersionEventKind
VERSION_EVENT_KIND_SUPERSEDED: VersionEventKind
VERSION_EVENT_KIND_WORKER_JOINED: VersionEventKind
VERSION_EVENT_KIND_WORKER_DROPPED: VersionEventKind
VERSION_EVENT_KIND_EPOCH_STARTED: VersionEventKind

class OfferIpcBufferRequest(_message.Message):
    __slots__ = ("version", "handle")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    version: int
    handle: _common_pb2.CudaIpcHandle
    def __init__(self, version: _Optional[int] = ..., handle: _Optional[_Union[_common_pb2.CudaIpcHandle, _Mapping]] = ...) -> None: ...

class OfferIpcBufferResponse(_message.Message):
    __slots__ = ("ipc_workers",)
    IPC_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ipc_workers: int
    def __init__(self, ipc_workers: _Optional[int] = ...) -> None: ...

class PublishVersionRequest(_message.Message):
    __slots__ = ("version", "model", "tensors", "checksum_algorithm", "bucket_bytes", "device_uuid", "publisher_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    model: str
    tensors: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorMeta]
    checksum_algorithm: _common_pb2.ChecksumAlgorithm
    bucket_bytes: int
    device_uuid: str
    publisher_id: str
    def __init__(self, version: _Optional[int] = ..., model: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[_common_pb2.TensorMeta, _Mapping]]] = ..., checksum_algorithm: _Optional[_Union[_common_pb2.ChecksumAlgorithm, str]] = ..., bucket_bytes: _Optional[int] = ..., device_uuid: _Optional[str] = ..., publisher_id: _Optional[str] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("plan", "ipc_workers")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    IPC_WORKERS_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.TransferPlan
    ipc_workers: int
    def __init__(self, plan: _Optional[_Union[_common_pb2.TransferPlan, _Mapping]] = ..., ipc_workers: _Optional[int] = ...) -> None: ...

class AwaitCatchUpRequest(_message.Message):
    __slots__ = ("have_version", "timeout_s")
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    have_version: int
    timeout_s: float
    def __init__(self, have_version: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class AwaitCatchUpResponse(_message.Message):
    __slots__ = ("plan", "ipc_workers")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    IPC_WORKERS_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.TransferPlan
    ipc_workers: int
    def __init__(self, plan: _Optional[_Union[_common_pb2.TransferPlan, _Mapping]] = ..., ipc_workers: _Optional[int] = ...) -> None: ...

class WaitVersionRequest(_message.Message):
    __slots__ = ("version", "state", "timeout_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: VersionState
    timeout_s: float
    def __init__(self, version: _Optional[int] = ..., state: _Optional[_Union[VersionState, str]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitVersionResponse(_message.Message):
    __slots__ = ("version", "reached")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REACHED_FIELD_NUMBER: _ClassVar[int]
    version: VersionInfo
    reached: bool
    def __init__(self, version: _Optional[_Union[VersionInfo, _Mapping]] = ..., reached: _Optional[bool] = ...) -> None: ...

class VersionInfo(_message.Message):
    __slots__ = ("version", "model", "state", "total_bytes", "num_tensors", "receive_seconds", "published_at_unix", "error")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    version: int
    model: str
    state: VersionState
    total_bytes: int
    num_tensors: int
    receive_seconds: float
    published_at_unix: float
    error: str
    def __init__(self, version: _Optional[int] = ..., model: _Optional[str] = ..., state: _Optional[_Union[VersionState, str]] = ..., total_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., receive_seconds: _Optional[float] = ..., published_at_unix: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "weight_version", "state", "last_error", "last_heartbeat_unix", "updates_applied", "updates_failed", "last_update_seconds", "last_paused_seconds", "last_attempted_version", "verified", "epoch", "device_uuid")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FAILED_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ATTEMPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    weight_version: int
    state: WorkerState
    last_error: str
    last_heartbeat_unix: float
    updates_applied: int
    updates_failed: int
    last_update_seconds: float
    last_paused_seconds: float
    last_attempted_version: int
    verified: bool
    epoch: int
    device_uuid: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., last_error: _Optional[str] = ..., last_heartbeat_unix: _Optional[float] = ..., updates_applied: _Optional[int] = ..., updates_failed: _Optional[int] = ..., last_update_seconds: _Optional[float] = ..., last_paused_seconds: _Optional[float] = ..., last_attempted_version: _Optional[int] = ..., verified: _Optional[bool] = ..., epoch: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "weight_version", "device_uuid", "receive_capacity_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    weight_version: int
    device_uuid: str
    receive_capacity_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ..., device_uuid: _Optional[str] = ..., receive_capacity_bytes: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("latest_version", "heartbeat_interval_s")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    heartbeat_interval_s: float
    def __init__(self, latest_version: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "weight_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    weight_version: int
    def __init__(self, worker_id: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("latest_version",)
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    def __init__(self, latest_version: _Optional[int] = ...) -> None: ...

class UnregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class UnregisterWorkerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightBroadcastServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightBroadcastServiceGetStatusResponse(_message.Message):
    __slots__ = ("latest_version", "versions", "workers", "backend", "updates_failed_total", "epoch", "epoch_members")
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    latest_version: int
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    backend: str
    updates_failed_total: int
    epoch: int
    epoch_members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, latest_version: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., backend: _Optional[str] = ..., updates_failed_total: _Optional[int] = ..., epoch: _Optional[int] = ..., epoch_members: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("after_version", "kinds", "after_seq", "replay_only")
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ONLY_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    kinds: _containers.RepeatedScalarFieldContainer[VersionEventKind]
    after_seq: int
    replay_only: bool
    def __init__(self, after_version: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[VersionEventKind, str]]] = ..., after_seq: _Optional[int] = ..., replay_only: _Optional[bool] = ...) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("kind", "version", "worker_id", "error", "at_unix", "seq")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: VersionEventKind
    version: int
    worker_id: str
    error: str
    at_unix: float
    seq: int
    def __init__(self, kind: _Optional[_Union[VersionEventKind, str]] = ..., version: _Optional[int] = ..., worker_id: _Optional[str] = ..., error: _Optional[str] = ..., at_unix: _Optional[float] = ..., seq: _Optional[int] = ...) -> None: ...

class WatchVersionsResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: VersionEvent
    def __init__(self, event: _Optional[_Union[VersionEvent, _Mapping]] = ...) -> None: ...
