from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerServiceGetStatusResponse(_message.Message):
    __slots__ = ("weight_version", "step", "last_metrics", "rollouts_trained_total", "dropped_stale_total", "duplicates_skipped_total", "objective", "run_dir", "stopping", "finished")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_TRAINED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_SKIPPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    step: int
    last_metrics: _containers.ScalarMap[str, float]
    rollouts_trained_total: int
    dropped_stale_total: int
    duplicates_skipped_total: int
    objective: str
    run_dir: str
    stopping: bool
    finished: bool
    def __init__(self, weight_version: _Optional[int] = ..., step: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., rollouts_trained_total: _Optional[int] = ..., dropped_stale_total: _Optional[int] = ..., duplicates_skipped_total: _Optional[int] = ..., objective: _Optional[str] = ..., run_dir: _Optional[str] = ..., stopping: _Optional[bool] = ..., finished: _Optional[bool] = ...) -> None: ...

class RequestCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestCheckpointResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
