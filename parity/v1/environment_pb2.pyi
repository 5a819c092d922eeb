from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordSplit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_SPLIT_UNSPECIFIED: _ClassVar[RecordSplit]
    RECORD_SPLIT_TRAIN: _ClassVar[RecordSplit]
    RECORD_SPLIT_EVAL: _ClassVar[RecordSplit]
RECORD_SPLIT_UNSPECIFIED: RecordSplit
RECORD_SPLIT_TRAIN: RecordSplit
RECORD_SPLIT_EVAL: RecordSplit

class ResetRequest(_message.Message):
    __slots__ = ("episode_id", "record")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    record: _struct_pb2.Struct
    def __init__(self, episode_id: _Optional[str] = ..., record: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observation",)
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    observation: str
    def __init__(self, observation: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "step_index", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    step_index: int
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., step_index: _Optional[int] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRecordsRequest(_message.Message):
    __slots__ = ("split", "seed", "offset", "limit")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    split: RecordSplit
    seed: int
    offset: int
    limit: int
    def __init__(self, split: _Optional[_Union[RecordSplit, str]] = ..., seed: _Optional[int] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListRecordsResponse(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    def __init__(self, records: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ...) -> None: ...
