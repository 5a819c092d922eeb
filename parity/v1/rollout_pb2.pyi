from parity.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_OUTCOME_UNSPECIFIED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_APPLIED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_FAILED: _ClassVar[UpdateOutcome]
    UPDATE_OUTCOME_ALREADY_CURRENT: _ClassVar[UpdateOutcome]
UPDATE_OUTCOME_UNSPECIFIED: UpdateOutcome
UPDATE_OUTCOME_APPLIED: UpdateOutcome
UPDATE_OUTCOME_FAILED: UpdateOutcome
UPDATE_OUTCOME_ALREADY_CURRENT: UpdateOutcome

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_text", "prompt_token_ids", "sampling", "use_chat_template")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USE_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_text: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    use_chat_template: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., use_chat_template: _Optional[bool] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "token_weight_versions", "text", "finish_reason", "weight_version_spans", "index", "token_context_versions", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CONTEXT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_weight_versions: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    weight_version_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.WeightVersionSpan]
    index: int
    token_context_versions: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., token_weight_versions: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., weight_version_spans: _Optional[_Iterable[_Union[_common_pb2.WeightVersionSpan, _Mapping]]] = ..., index: _Optional[int] = ..., token_context_versions: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_token_ids", "completions", "request_id", "logprobs_mode")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    request_id: str
    logprobs_mode: _common_pb2.LogprobsMode
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., request_id: _Optional[str] = ..., logprobs_mode: _Optional[_Union[_common_pb2.LogprobsMode, str]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("prompt_token_ids", "completion", "request_id")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion: Completion
    request_id: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class RolloutServiceGetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineSettings(_message.Message):
    __slots__ = ("engine", "model", "logprobs_mode", "head_dtype", "model_dtype", "prefix_caching", "reset_prefix_cache_on_update", "async_scheduling", "generation_config", "update_mode", "max_model_len", "max_n", "max_tokens_limit", "top_p_impl")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_MODE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_ON_UPDATE_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOP_P_IMPL_FIELD_NUMBER: _ClassVar[int]
    engine: str
    model: str
    logprobs_mode: _common_pb2.LogprobsMode
    head_dtype: str
    model_dtype: str
    prefix_caching: bool
    reset_prefix_cache_on_update: bool
    async_scheduling: bool
    generation_config: str
    update_mode: _common_pb2.UpdateMode
    max_model_len: int
    max_n: int
    max_tokens_limit: int
    top_p_impl: str
    def __init__(self, engine: _Optional[str] = ..., model: _Optional[str] = ..., logprobs_mode: _Optional[_Union[_common_pb2.LogprobsMode, str]] = ..., head_dtype: _Optional[str] = ..., model_dtype: _Optional[str] = ..., prefix_caching: _Optional[bool] = ..., reset_prefix_cache_on_update: _Optional[bool] = ..., async_scheduling: _Optional[bool] = ..., generation_config: _Optional[str] = ..., update_mode: _Optional[_Union[_common_pb2.UpdateMode, str]] = ..., max_model_len: _Optional[int] = ..., max_n: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., top_p_impl: _Optional[str] = ...) -> None: ...

class RolloutServiceGetStatusResponse(_message.Message):
    __slots__ = ("settings", "weight_version", "paused", "num_running_requests", "generated_tokens_total", "paused_seconds_total", "updates_applied_total", "updates_failed_total", "engine_restarts_total")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FAILED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RESTARTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    settings: EngineSettings
    weight_version: int
    paused: bool
    num_running_requests: int
    generated_tokens_total: int
    paused_seconds_total: float
    updates_applied_total: int
    updates_failed_total: int
    engine_restarts_total: int
    def __init__(self, settings: _Optional[_Union[EngineSettings, _Mapping]] = ..., weight_version: _Optional[int] = ..., paused: _Optional[bool] = ..., num_running_requests: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., paused_seconds_total: _Optional[float] = ..., updates_applied_total: _Optional[int] = ..., updates_failed_total: _Optional[int] = ..., engine_restarts_total: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("plan", "update_mode", "fault_corrupt_tensor")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    FAULT_CORRUPT_TENSOR_FIELD_NUMBER: _ClassVar[int]
    plan: _common_pb2.TransferPlan
    update_mode: _common_pb2.UpdateMode
    fault_corrupt_tensor: str
    def __init__(self, plan: _Optional[_Union[_common_pb2.TransferPlan, _Mapping]] = ..., update_mode: _Optional[_Union[_common_pb2.UpdateMode, str]] = ..., fault_corrupt_tensor: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("outcome", "weight_version", "error", "checksums", "transfer_seconds", "verify_seconds", "swap_seconds", "paused_seconds", "prepare_seconds")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    outcome: UpdateOutcome
    weight_version: int
    error: str
    checksums: _containers.RepeatedScalarFieldContainer[int]
    transfer_seconds: float
    verify_seconds: float
    swap_seconds: float
    paused_seconds: float
    prepare_seconds: float
    def __init__(self, outcome: _Optional[_Union[UpdateOutcome, str]] = ..., weight_version: _Optional[int] = ..., error: _Optional[str] = ..., checksums: _Optional[_Iterable[int]] = ..., transfer_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ..., paused_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: _common_pb2.UpdateMode
    def __init__(self, mode: _Optional[_Union[_common_pb2.UpdateMode, str]] = ...) -> None: ...

class PauseGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeGenerationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
