from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("prompt_id", "prompt", "completion", "answer", "metadata")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt: str
    completion: str
    answer: str
    metadata: _struct_pb2.Struct
    def __init__(self, prompt_id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., answer: _Optional[str] = ..., metadata: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "task", "items")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    task: str
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, request_id: _Optional[str] = ..., task: _Optional[str] = ..., items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, scores: _Optional[_Iterable[float]] = ...) -> None: ...
