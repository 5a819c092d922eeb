from parity.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TurnRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_ROLE_UNSPECIFIED: _ClassVar[TurnRole]
    TURN_ROLE_MODEL: _ClassVar[TurnRole]
    TURN_ROLE_ENVIRONMENT: _ClassVar[TurnRole]

class EpisodeEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_END_UNSPECIFIED: _ClassVar[EpisodeEnd]
    EPISODE_END_DONE: _ClassVar[EpisodeEnd]
    EPISODE_END_MAX_TURNS: _ClassVar[EpisodeEnd]
    EPISODE_END_CONTEXT_LENGTH: _ClassVar[EpisodeEnd]
    EPISODE_END_ENVIRONMENT_ERROR: _ClassVar[EpisodeEnd]
TURN_ROLE_UNSPECIFIED: TurnRole
TURN_ROLE_MODEL: TurnRole
TURN_ROLE_ENVIRONMENT: TurnRole
EPISODE_END_UNSPECIFIED: EpisodeEnd
EPISODE_END_DONE: EpisodeEnd
EPISODE_END_MAX_TURNS: EpisodeEnd
EPISODE_END_CONTEXT_LENGTH: EpisodeEnd
EPISODE_END_ENVIRONMENT_ERROR: EpisodeEnd

class RolloutGroup(_message.Message):
    __slots__ = ("group_id", "task", "prompt_id", "prompt_token_ids", "prompt_text", "sampling", "samples", "min_weight_version", "max_weight_version", "worker_id", "created_at_unix", "logprobs_mode")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task: str
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    sampling: _common_pb2.SamplingParams
    samples: _containers.RepeatedCompositeFieldContainer[RolloutSample]
    min_weight_version: int
    max_weight_version: int
    worker_id: str
    created_at_unix: float
    logprobs_mode: _common_pb2.LogprobsMode
    def __init__(self, group_id: _Optional[str] = ..., task: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[RolloutSample, _Mapping]]] = ..., min_weight_version: _Optional[int] = ..., max_weight_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., created_at_unix: _Optional[float] = ..., logprobs_mode: _Optional[_Union[_common_pb2.LogprobsMode, str]] = ...) -> None: ...

class RolloutSample(_message.Message):
    __slots__ = ("rollout_id", "token_ids", "logprobs", "token_weight_versions", "text", "reward", "finish_reason", "token_context_versions", "loss_mask", "turns", "episode_end", "episode_error", "token_mismatches", "retokenization_drift")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CONTEXT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_END_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ERROR_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    RETOKENIZATION_DRIFT_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_weight_versions: _containers.RepeatedScalarFieldContainer[int]
    text: str
    reward: float
    finish_reason: _common_pb2.FinishReason
    token_context_versions: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[bool]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    episode_end: EpisodeEnd
    episode_error: str
    token_mismatches: int
    retokenization_drift: int
    def __init__(self, rollout_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_weight_versions: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., token_context_versions: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[bool]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., episode_end: _Optional[_Union[EpisodeEnd, str]] = ..., episode_error: _Optional[str] = ..., token_mismatches: _Optional[int] = ..., retokenization_drift: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("role", "start", "end", "reward", "finish_reason")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    role: TurnRole
    start: int
    end: int
    reward: float
    finish_reason: _common_pb2.FinishReason
    def __init__(self, role: _Optional[_Union[TurnRole, str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...
