"""The `rollout` section: the rollout service and its actor loop (`PARITY_ROLLOUT_*`, `--rollout.*`).

Defaults are the correctness defaults: processed logprobs, an fp32 head, prefix caching off, async
scheduling off, `generation_config="vllm"`, the prefix cache reset at every weight update. Every one
of them can be changed, and every one is reported by `GetStatus` and logged at startup, so that a
run that departs from them says so.

Rollout dtype defaults to float32: on CPU there is no bf16 speed-up worth the mismatch (the CPU
kernels for bf16 matmul are not faster than fp32 on the machines we run on, and fp32 rollouts match
the trainer far more closely: docs/benchmarks.md, "Summary"). On GPU choose bfloat16 with the fp32
head.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from parity.config.base import ServiceConfig, check_address

EngineName = Literal["vllm", "reference"]
DtypeName = Literal["float32", "bfloat16"]
LogprobsModeName = Literal["processed", "raw"]
HeadDtypeName = Literal["float32", "model"]
ToolParserName = Literal["none", "hermes", "llama3_json"]  # rollout/tool_calls.py
GenerationConfigName = Literal["vllm", "auto"]
UpdateModeName = Literal["keep", "recompute"]
CpuTopPName = Literal["bounded", "sort"]


class RolloutConfig(ServiceConfig):
    """The rollout service: `parity serve rollout --field value` (its own fields need no prefix)."""

    # Engine and parity-relevant settings.
    engine: EngineName = Field("vllm", description="vllm (AsyncLLM, fast) or reference (HF, exact, slow).")
    device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="The reference engine's device (cuda: the current GPU; on the trainer's GPU, weight "
        "updates come by CUDA IPC). vLLM runs on the platform its wheel was built for.",
    )
    dtype: DtypeName = Field(
        "float32",
        description="Rollout weights/activations dtype. float32 by default: on CPU bf16 is not faster "
        "and raises the train-inference mismatch (k3) by orders of magnitude (docs/benchmarks.md).",
    )
    logprobs_mode: LogprobsModeName = Field(
        "processed", description="processed: after temperature/top-k/top-p (what was sampled); raw: logits."
    )
    head_dtype: HeadDtypeName = Field(
        "float32", description="lm_head/logits dtype: float32 (hf_overrides head_dtype) or the model dtype."
    )
    prefix_caching: bool = Field(False, description="vLLM automatic prefix caching.")
    reset_prefix_cache_on_update: bool = Field(
        True, description="Reset the prefix cache at every weight update (guard against stale KV)."
    )
    async_scheduling: bool = Field(False, description="vLLM async scheduling (forced off on CPU by vLLM).")
    generation_config: GenerationConfigName = Field(
        "vllm", description="vllm: ignore the model's generation_config.json defaults; auto: use them."
    )
    update_mode: UpdateModeName = Field(
        "keep", description="keep: running sequences continue under new weights; recompute: KV recomputed."
    )
    cpu_top_p: CpuTopPName = Field(
        "bounded",
        description="vLLM on CPU only: bounded masks top-k/top-p from a bounded topk with the same kept "
        "tokens (rollout/cpu_top_p.py; faster decoding than the sort, docs/benchmarks.md); sort keeps vLLM's "
        "full-vocab sort.",
    )
    max_model_len: int = Field(512, gt=0, description="Context length (prompt + completion) in tokens.")
    max_n: int = Field(16, gt=0, description="Largest allowed group size n per request.")
    max_tokens_limit: int = Field(
        0, ge=0, description="Largest allowed max_tokens; 0 means max_model_len - 1."
    )
    kv_cache_gib: int = Field(
        1,
        ge=1,
        description="KV cache size on CPU in whole GiB (VLLM_CPU_KVCACHE_SPACE, which vLLM reads as an "
        "integer).",
    )
    enforce_eager: bool = Field(True, description="Skip graph capture/compilation (fast startup on CPU).")
    reference_threads: int = Field(
        1,
        ge=1,
        description="torch intra-op threads of the reference engine; 1 avoids OpenMP oversubscription "
        "(far slower steps) on shared CPUs.",
    )
    max_num_seqs: int = Field(64, gt=0, description="Most sequences the engine batches at once.")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="vLLM's fraction of GPU memory (weights, activations and KV cache) on CUDA; lower it "
        "when the trainer shares the GPU. Ignored on CPU (the KV cache is kv_cache_gib there).",
    )
    vllm_cpu_executor: Literal["uni", "mp"] = Field(
        "uni",
        description="vLLM on CPU only: 'uni' runs the model inside vLLM's engine-core process, with the "
        "OpenMP threads and cores vLLM gives its worker (one process and one import of vLLM fewer per "
        "engine, nothing waiting on a worker); 'mp' is vLLM-cpu's own layout, a separate worker process "
        "that the engine core waits on (see engine_core_nap_us). On GPU vLLM picks its executor.",
    )
    engine_core_nap_us: int = Field(
        20,
        ge=0,
        le=10_000,
        description="CPU with vllm_cpu_executor 'mp' only: vLLM's engine-core process waits for each step "
        "of its worker in naps of this many microseconds instead of spinning on a core "
        "(rollout/cpu_engine_wait.py); 0 keeps vLLM's spin. The spin starves the serving process on "
        "hosts with few cores.",
    )
    prepared_swap: bool = Field(
        True,
        description="vLLM on CPU only: build a verified version's kernel form (vLLM's weight processing, "
        "the prepacked GEMMs) on a shadow of the model while generating, so that the update's pause only "
        "copies and rebinds (rollout/prepared_swap.py); false reloads in place during the pause.",
    )
    stream_interval: int = Field(
        1,
        ge=1,
        description="vLLM hands this service a request's new tokens every this many tokens (and always "
        "its first token and its end) instead of after every step: less per-step Python work on the "
        "serving event loop. Results are identical.",
    )

    # Admission: what one Generate/GenerateStream RPC may ask for, and how much may be in flight.
    max_prompt_bytes: int = Field(
        1024 * 1024,
        gt=0,
        description="Largest prompt_text in UTF-8 bytes; a larger one gets INVALID_ARGUMENT before it is "
        "tokenised (tokenising costs CPU time that grows with the prompt's length).",
    )
    max_tokenize_pending: int = Field(
        64,
        ge=1,
        description="Prompts tokenised or waiting to be (on one worker thread, off the event loop); more "
        "get RESOURCE_EXHAUSTED. With max_prompt_bytes this bounds the text held for tokenising.",
    )
    max_inflight_requests: int = Field(
        64,
        ge=1,
        description="Generate/GenerateStream RPCs admitted at once; more get RESOURCE_EXHAUSTED with a "
        "retry hint. The actor's own groups are not counted (they are bounded by rollout.concurrency).",
    )
    max_inflight_tokens: int = Field(
        0,
        ge=0,
        description="Token budget of admitted RPCs, each counted as n * (prompt + max_tokens); more get "
        "RESOURCE_EXHAUSTED. 0 means max_num_seqs * max_model_len.",
    )

    # Weight updates and membership.
    broadcast_address: str = Field("", description="HOST:PORT of the weight-broadcast service; empty = none.")
    worker_id: str = Field("", description="Id registered with the broadcast service; default host:port.")
    worker_index: int = Field(
        0,
        ge=0,
        description="This service's index among the run's rollout services; the engine seed is "
        "run.seed + worker_index, so workers sample differently.",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="Seconds between heartbeats (if the broadcast service does not say)."
    )
    enable_fault_injection: bool = Field(
        False, description="Allow UpdateWeightsRequest.fault_corrupt_tensor and rollout.fault (tests only)."
    )
    fault: str = Field(
        "",
        description="Tests only: '<class>@<version>' injects a parity fault (any class of parity/faults.py) "
        "into the reference engine (and the episode loop) from that weight version on; needs "
        "enable_fault_injection and engine reference. one_worker_not_updated acts on worker_index 1 only.",
    )
    shutdown_grace_s: float = Field(5.0, ge=0, description="Seconds in-flight RPCs get at shutdown.")
    engine_restart_attempts: int = Field(
        8,
        ge=1,
        description="Engine failures in a row (deaths of the engine-core process, the first start's "
        "included; failed restarts) before "
        "the rollout service gives up and exits 1; an engine that served 5 minutes starts a fresh count.",
    )

    # Actor loop (runs inside the service process when --actor true).
    actor: bool = Field(False, description="Run the actor loop (generate, score, publish) in this process.")
    concurrency: int = Field(8, ge=1, le=256, description="Groups the actor generates concurrently.")
    max_groups: int = Field(0, ge=0, description="Stop the actor after this many groups (0 = no limit).")
    actor_restart_attempts: int = Field(
        8, ge=1, description="Actor-loop crashes in a row before the rollout service gives up and exits 1."
    )
    skip_zero_variance: bool = Field(
        True,
        description="Dynamic sampling: do not publish a group whose rewards are all equal (no GRPO signal); "
        "after 4 * groups_per_step such drops in a row the next group is published anyway.",
    )

    # The OpenAI-compatible endpoint for agent harnesses (services/rollout/openai_api.py).
    openai_port: int = Field(
        -1,
        ge=-1,
        le=65535,
        description="HTTP port of the OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions, "
        "/v1/sessions/{id}/finish) on `host`; -1 disables it, 0 picks a free port (written next to "
        "port_file as <name>.openai.port).",
    )
    openai_max_request_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest HTTP request body the OpenAI endpoint reads; a larger one gets 413.",
    )
    openai_max_sessions: int = Field(
        1024, ge=1, description="OpenAI endpoint: open episode sessions at most; more get 429."
    )
    openai_session_ttl_s: float = Field(
        3600.0,
        gt=0,
        description="OpenAI endpoint: an unfinished session idle this long is dropped (counted).",
    )
    openai_tool_parser: ToolParserName = Field(
        "hermes",
        description="OpenAI endpoint: how tool calls are read from a reply when the call offers tools "
        "(hermes: <tool_call>{name, arguments}</tool_call>, as Qwen2.5/Qwen3/Hermes/SmolLM3 templates "
        "write them; llama3_json: the whole reply is {name, parameters}, as Llama 3.1/3.2 write them; "
        "none: the reply stays text). The sampled tokens are kept either way.",
    )
    openai_group_timeout_s: float = Field(
        600.0,
        gt=0,
        description="OpenAI endpoint: a group whose group_size episodes have not all finished this long "
        "after its first is dropped, never published (counted).",
    )

    @field_validator("broadcast_address")
    @classmethod
    def _address(cls, value: str) -> str:
        return check_address(value)

    @model_validator(mode="after")
    def _fault(self) -> RolloutConfig:
        if not self.fault:
            return self
        from parity.faults import parse_fault

        if not self.enable_fault_injection:
            raise ValueError("fault: needs fault injection enabled (rollout.enable_fault_injection true)")
        spec = parse_fault(self.fault, source="fault")
        if self.engine != "reference":
            raise ValueError(
                f"fault: {spec.fault.name!r} is injected by the live reference engine only: set rollout.engine "
                "reference (parity check --faults runs every class in-process)"
            )
        return self

    @model_validator(mode="after")
    def _limits(self) -> RolloutConfig:
        if self.max_tokens_limit >= self.max_model_len:
            raise ValueError(f"max_tokens_limit: must be < max_model_len={self.max_model_len}")
        if self.engine == "reference" and self.prefix_caching:
            raise ValueError("prefix_caching: the reference engine has no prefix cache")
        if self.engine != "reference" and self.device != "cpu":
            raise ValueError("device: only the reference engine takes a device; vLLM uses its platform's")
        return self

    @property
    def effective_max_tokens(self) -> int:
        return self.max_tokens_limit or self.max_model_len - 1

    @property
    def effective_max_inflight_tokens(self) -> int:
        return self.max_inflight_tokens or self.max_num_seqs * self.max_model_len

    @property
    def effective_head_dtype(self) -> str:
        """The dtype the engine's lm_head computes the logits in."""
        return "float32" if self.head_dtype == "float32" else self.dtype

    def parity_settings(self, model: str) -> dict[str, object]:
        """The settings that decide train-inference parity, for the startup log."""
        return {
            "engine": self.engine,
            "model": model,
            "model_dtype": self.dtype,
            "head_dtype": self.effective_head_dtype,
            "logprobs_mode": self.logprobs_mode,
            "prefix_caching": self.prefix_caching,
            "reset_prefix_cache_on_update": self.reset_prefix_cache_on_update,
            "async_scheduling": self.async_scheduling,
            "generation_config": self.generation_config,
            "update_mode": self.update_mode,
            "cpu_top_p": self.cpu_top_p,
            "max_model_len": self.max_model_len,
        }
