"""Request validation for the rollout service: every bad input becomes a gRPC status naming the field.

`parity.errors.RequestError(code, field, message)` is raised by the checks and turned into
`context.abort(code, "field: message")` by the servicer, so a bad request never reaches the engine
and never takes the service down. Wire conventions (proto3 zero values): `n = 0` means 1, `top_p = 0` means 1 (off),
`top_k = 0` means off, `seed = 0` means unseeded, `temperature = 0` means greedy (and then n must
be 1, as in vLLM), an UNSPECIFIED update mode means the configured one, an UNSPECIFIED checksum
algorithm means WSUM64. An enum value this server does not know is refused, never read as the
default.

An update plan is checked against the checkpoint's tensors (`checkpoint_shapes`, read before any
engine loads): every name known, with the model's shape, listed once. A whole version
(`base_version` 0) must list every tensor the trainer publishes (`full_version_names`): both engines
load only what they receive (the reference engine with strict=False, vLLM's reload_weights only the
modules that got tensors), so a partial one would serve a mix of versions under one number. A delta
(`base_version` > 0) lists only the tensors that changed.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import Message

from parity.errors import RequestError, invalid, quote
from parity.v1 import common_pb2
from parity.weights.rendezvous import rendezvous_problem
from rollout.engine import GenerationSpec

# vLLM's SamplingParams accepts temperatures in [0, 2]; both engines answer the same range.
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**63 - 1  # torch generators take a signed 64-bit seed
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # vLLM's default cap (max_logprobs)
PLAN_DTYPES = ("float32", "bfloat16", "float16")
_CHECKSUM_ALGORITHMS = (common_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED, common_pb2.CHECKSUM_ALGORITHM_WSUM64)


def check_unknown_fields(message: Message, path: str = "") -> None:
    """Reject fields this server does not know (a newer client, or a typo in a hand-built message)."""
    unknown = unknown_fields.UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        where = path or message.DESCRIPTOR.name
        raise invalid(where, f"unknown field number(s) {numbers} in {message.DESCRIPTOR.full_name}")
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if descriptor.is_repeated:
            for item in value:
                check_unknown_fields(item, name)
        else:
            check_unknown_fields(value, name)


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_n: int
    max_tokens: int
    vocab_size: int
    max_prompt_bytes: int = 1024 * 1024


def generation_spec(request, prompt_token_ids: list[int] | None, limits: Limits) -> GenerationSpec:
    """Validate a GenerateRequest whose prompt was already tokenised into `prompt_token_ids`."""
    check_unknown_fields(request)
    prompt = list(prompt_token_ids if prompt_token_ids is not None else request.prompt_token_ids)
    if not prompt:
        raise invalid("prompt_text", "empty prompt (set prompt_text or prompt_token_ids)")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise invalid(
            "prompt_token_ids", f"token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
        )
    if len(prompt) >= limits.max_model_len:
        raise invalid(
            "prompt_text" if request.prompt_text else "prompt_token_ids",
            f"prompt has {len(prompt)} tokens; the model's context (max_model_len) is {limits.max_model_len}",
        )
    s = request.sampling
    temperature = float(s.temperature)
    if not math.isfinite(temperature) or not 0 <= temperature <= MAX_TEMPERATURE:
        raise invalid(
            "sampling.temperature", f"must be in [0, {MAX_TEMPERATURE:g}]; 0 is greedy (got {s.temperature})"
        )
    top_p = float(s.top_p)
    if not math.isfinite(top_p) or top_p < 0 or top_p > 1:
        raise invalid("sampling.top_p", f"must be in (0, 1]; 0 means 1 (got {s.top_p})")
    if not 0 <= s.top_k <= limits.vocab_size:
        raise invalid(
            "sampling.top_k", f"must be in [0, vocab size {limits.vocab_size}]; 0 disables it (got {s.top_k})"
        )
    if s.seed > MAX_SEED:
        raise invalid("sampling.seed", f"must be <= {MAX_SEED}; 0 means unseeded (got {s.seed})")
    if s.max_tokens <= 0:
        raise invalid("sampling.max_tokens", f"must be > 0 (got {s.max_tokens})")
    if s.max_tokens > limits.max_tokens:
        raise invalid("sampling.max_tokens", f"must be <= {limits.max_tokens} (got {s.max_tokens})")
    if len(prompt) + s.max_tokens > limits.max_model_len:
        raise invalid(
            "sampling.max_tokens",
            f"prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) exceeds max_model_len "
            f"{limits.max_model_len}",
        )
    if s.n < 0:
        raise invalid("sampling.n", f"must be > 0; 0 means 1 (got {s.n})")
    n = s.n or 1
    if n > limits.max_n:
        raise invalid("sampling.n", f"must be <= max_n={limits.max_n} (got {n})")
    if temperature < 1e-5 and n > 1:
        raise invalid("sampling.n", f"greedy sampling (temperature 0) needs n = 1 (got {n})")
    if any(not stop for stop in s.stop):
        raise invalid("sampling.stop", "stop strings must be non-empty")
    if len(s.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in s.stop):
        raise invalid(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters"
        )
    if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid(
            "sampling.top_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]; 0 returns none (got {s.top_logprobs})",
        )
    return GenerationSpec(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        n=n,
        max_tokens=int(s.max_tokens),
        temperature=temperature,
        top_k=int(s.top_k),
        top_p=top_p if top_p > 0 else 1.0,
        seed=int(s.seed) if s.seed else None,
        stop=tuple(s.stop),
        ignore_eos=bool(s.ignore_eos),
        top_logprobs=int(s.top_logprobs),
    )


def check_prompt_fields(request, max_prompt_bytes: int) -> None:
    """Exactly one of prompt_text / prompt_token_ids; sizes checked before anything is tokenised."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(
            "request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters ({len(request.request_id)})"
        )
    if len(request.prompt_text) > max_prompt_bytes or len(request.prompt_text.encode()) > max_prompt_bytes:
        raise invalid(
            "prompt_text",
            f"{len(request.prompt_text.encode())} bytes; the limit is rollout.max_prompt_bytes={max_prompt_bytes}",
        )
    if request.prompt_text and request.prompt_token_ids:
        raise invalid("prompt_text", "set prompt_text or prompt_token_ids, not both")
    if not request.prompt_text and not request.prompt_token_ids:
        raise invalid("prompt_text", "empty prompt (set prompt_text or prompt_token_ids)")
    if request.use_chat_template and not request.prompt_text:
        raise invalid("use_chat_template", "needs prompt_text")


def check_update_mode(mode: int, field: str) -> None:
    """An UpdateMode the service knows (UNSPECIFIED: the configured mode)."""
    if mode not in common_pb2.UpdateMode.values():
        raise invalid(
            field, f"unknown UpdateMode {mode}; use UPDATE_MODE_KEEP, UPDATE_MODE_RECOMPUTE or leave it unset"
        )


def check_update_request(
    request,
    checkpoint_shapes: dict[str, tuple[int, ...]],
    fault_injection: bool,
    full_version: frozenset[str] | None = None,
) -> None:
    """Validate an UpdateWeightsRequest before joining any group. `full_version`: the tensors a
    whole version must list (`full_version_names`; None: every name in `checkpoint_shapes`)."""
    check_unknown_fields(request)
    check_update_mode(request.update_mode, "update_mode")
    if request.fault_corrupt_tensor and not fault_injection:  # refused whatever the plan
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "fault_corrupt_tensor",
            "fault injection is disabled (start the service with --enable_fault_injection true)",
        )
    if not request.HasField("plan"):
        raise invalid("plan", "required")
    plan = request.plan
    if plan.version <= 0:
        raise invalid(
            "plan.version", f"must be > 0; version 0 is the initial checkpoint (got {plan.version})"
        )
    if not plan.tensors:
        raise invalid("plan.tensors", "empty")
    if not 0 <= plan.base_version < plan.version:
        raise invalid(
            "plan.base_version",
            f"must be 0 (whole version) or in [1, {plan.version}) (got {plan.base_version})",
        )
    if plan.full_bytes < 0:
        raise invalid("plan.full_bytes", f"must be >= 0 (got {plan.full_bytes})")
    if plan.bucket_bytes <= 0:
        raise invalid("plan.bucket_bytes", f"must be > 0 (got {plan.bucket_bytes})")
    if plan.checksum_algorithm not in _CHECKSUM_ALGORITHMS:
        raise invalid(
            "plan.checksum_algorithm",
            f"unknown ChecksumAlgorithm {plan.checksum_algorithm}; must be CHECKSUM_ALGORITHM_WSUM64",
        )
    if plan.HasField("cuda_ipc"):  # a worker on the trainer's GPU: no group to join
        check_ipc_handle(plan)
    else:
        rdv = plan.rendezvous
        if rdv.backend not in ("gloo", "nccl"):
            raise invalid("plan.rendezvous.backend", f"must be gloo or nccl (got {quote(rdv.backend)})")
        if rdv.world_size < 2 or not 1 <= rdv.rank < rdv.world_size:
            raise invalid("plan.rendezvous.rank", f"receiver rank must be in [1, {rdv.world_size})")
        problem = rendezvous_problem(rdv)  # finite, bounded timeout_s; the group's secret; a port
        if problem is not None:
            raise invalid(f"plan.rendezvous.{problem[0]}", problem[1])
    check_plan_tensors(plan, checkpoint_shapes, full_version)


def check_plan_tensors(
    plan, checkpoint_shapes: dict[str, tuple[int, ...]], full_version: frozenset[str] | None = None
) -> None:
    """Every tensor of `plan` is one of the model's, with its shape, listed once; a whole version
    (base_version 0) lists every name of `full_version` (None: of `checkpoint_shapes`)."""
    seen: set[str] = set()
    for i, meta in enumerate(plan.tensors):
        expected = checkpoint_shapes.get(meta.name)
        if expected is None:
            raise invalid("plan.tensors", f"unknown tensor {quote(meta.name)} for this model")
        if meta.name in seen:
            raise invalid(
                f"plan.tensors[{i}].name", f"duplicate {quote(meta.name)}: each tensor is listed once"
            )
        seen.add(meta.name)
        if tuple(meta.shape) != expected:
            raise invalid(
                "plan.tensors",
                f"tensor {meta.name!r} has shape {list(meta.shape)}, model has {list(expected)}",
            )
        if meta.dtype not in PLAN_DTYPES:
            raise invalid("plan.tensors", f"tensor {meta.name!r} has unsupported dtype {quote(meta.dtype)}")
    if plan.base_version:
        return  # a delta: only the tensors that changed since base_version
    required = full_version if full_version is not None else frozenset(checkpoint_shapes)
    missing = sorted(required - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise invalid(
            "plan.tensors",
            f"missing {len(missing)} of the model's {len(required)} tensors: {shown} (a whole version, "
            "base_version 0, lists every tensor; a delta sets base_version)",
        )


def check_ipc_handle(plan) -> None:
    """A CUDA IPC plan: no rendezvous, and a handle with what mapping it needs."""
    from parity.weights.cuda_ipc import handle_problem

    if plan.HasField("rendezvous"):
        raise invalid("plan.rendezvous", "must be unset when plan.cuda_ipc is set (one path per update)")
    problem = handle_problem(plan.cuda_ipc)
    if problem is not None:
        raise invalid(f"plan.cuda_ipc.{problem[0]}", problem[1])


def checkpoint_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes in the model's safetensors (plus lm_head.weight when tied)."""
    from pathlib import Path

    from safetensors import safe_open

    model_dir = Path(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if _tied(model_dir) and "model.embed_tokens.weight" in shapes:
        shapes.setdefault("lm_head.weight", shapes["model.embed_tokens.weight"])
    return shapes


def full_version_names(checkpoint_shapes: dict[str, tuple[int, ...]], model_dir) -> frozenset[str]:
    """The tensors a whole version must list: the checkpoint's, less a tied lm_head.weight (the
    trainer publishes its parameters with tied weights once, as vLLM loads them)."""
    tied = _tied(model_dir)
    return frozenset(name for name in checkpoint_shapes if not (tied and name == "lm_head.weight"))


def _tied(model_dir) -> bool:
    import json
    from pathlib import Path

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings"))
