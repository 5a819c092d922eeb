"""The RolloutService servicer around one engine (vLLM or reference); services/rollout/server.py
starts it (`parity serve rollout`).

Invariants:
  - Generate calls go straight to the engine, concurrently; the engine batches them. Only weight
    updates are serialised (one at a time, inside the engine).
  - Health is NOT_SERVING, and Generate answers UNAVAILABLE, until the engine is loaded and, when a
    broadcast service is configured, until the served version has caught up with the latest
    version the broadcast service reported at registration. From SIGTERM on, every RPC answers
    UNAVAILABLE while in-flight ones get `shutdown_grace_s` to finish.
  - PauseGeneration, ResumeGeneration and UpdateWeights are token-protected (GrpcServer).
  - Handlers raise; the error boundary in GrpcServer answers (parity.errors.status_for): a bad field
    is INVALID_ARGUMENT naming it, vLLM's own validation too, a dead engine UNAVAILABLE.
  - Nothing CPU-heavy runs on the event loop: prompts are tokenised on one worker thread, at most
    `max_tokenize_pending` at a time, after their size was checked (`max_prompt_bytes`).
  - With the actor on, health is also NOT_SERVING while Redis is unreachable (the actor's queue waits
    it out, parity.rollout_queue) and while a crashed actor loop waits to restart (capped backoff;
    `parity_rollout_actor_restarts_total`). Generate RPCs are still answered meanwhile.
  - A dead engine (vLLM's engine-core process exited: `RolloutEngine.dead`, polled every 0.5 s) is a
    recoverable fault: requests in flight on it answer UNAVAILABLE, the service turns NOT_SERVING
    (new requests UNAVAILABLE `engine: restarting`), builds a fresh engine (version 0) and requires
    the version it served before the death. With a broadcast service it registers again as a
    worker at version 0, so the trainer's catch-up sends it the current version; without one it
    waits for an UpdateWeights to that version. Then SERVING again. Counted in
    `parity_rollout_engine_restarts_total` and GetStatus `engine_restarts_total`; a failed restart
    is retried with capped backoff, and so is a first start whose engine core was killed while it
    started (not one the engine refused: a bad checkpoint fails at once). Recovery has a budget:
    after `engine_restart_attempts` failures in a row (deaths and failed restarts; an engine that
    served 10 x the backoff cap starts a fresh count) the service logs one line naming the engine
    and the last cause, stops and exits 1 (services/rollout/server.py), NOT_SERVING until it is
    gone.
  - Generate/GenerateStream RPCs are admitted up to `max_inflight_requests` and
    `max_inflight_tokens` (rollout.admission); the rest get RESOURCE_EXHAUSTED with a retry hint.
  - Every parity-relevant engine setting is logged at startup and returned by GetStatus.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from parity import tracing
from parity.config import ParityConfig
from parity.config.rollout import RolloutConfig
from parity.errors import RequestError, overloaded
from parity.server import GrpcServer
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from parity.versions import compress_versions
from rollout import metrics
from rollout.admission import Admission
from rollout.engine import FINISH_REASONS, CompletionResult, EngineDeadError, GenerationSpec, RolloutEngine
from rollout.validation import (
    Limits,
    check_prompt_fields,
    check_unknown_fields,
    check_update_mode,
    check_update_request,
    checkpoint_shapes,
    full_version_names,
    generation_spec,
)

log = logging.getLogger("parity.rollout")

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
PROTECTED_METHODS = tuple(
    f"/{SERVICE_NAME}/{name}" for name in ("UpdateWeights", "PauseGeneration", "ResumeGeneration")
)
_OUTCOME = {
    "applied": rollout_pb2.UPDATE_OUTCOME_APPLIED,
    "failed": rollout_pb2.UPDATE_OUTCOME_FAILED,
    "already_current": rollout_pb2.UPDATE_OUTCOME_ALREADY_CURRENT,
}
_MODES = {common_pb2.UPDATE_MODE_KEEP: "keep", common_pb2.UPDATE_MODE_RECOMPUTE: "recompute"}


def build_engine(config: RolloutConfig, model_dir: Path, seed: int) -> RolloutEngine:
    if config.engine == "reference":
        from rollout.reference_engine import ReferenceEngine

        return ReferenceEngine(config, model_dir, seed)
    from rollout.vllm_engine import VllmEngine

    return VllmEngine(config, model_dir, seed)


def completion_proto(result: CompletionResult) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        token_ids=result.token_ids,
        logprobs=result.logprobs,
        token_weight_versions=result.token_weight_versions,
        token_context_versions=result.token_context_versions,
        text=result.text,
        finish_reason=FINISH_REASONS[result.finish_reason],
        weight_version_spans=[
            common_pb2.WeightVersionSpan(version=v, start=s, end=e)
            for v, s, e in compress_versions(result.token_weight_versions)
        ],
        index=result.index,
        top_logprobs=[
            rollout_pb2.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[lp for _, lp in top])
            for top in result.top_logprobs
        ],
    )


ENGINE_RESTART_START_S = 1.0
ENGINE_RESTART_CAP_S = 30.0


def restart_backoff_s(retry: int, start_s: float, cap_s: float) -> float:
    """Seconds to wait before the `retry`-th start of an engine in a row (1 = the first retry):
    doubling from `start_s`, capped at `cap_s`. A first start and a restart after death share it."""
    return min(cap_s, start_s * 2 ** (retry - 1))


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """The gRPC face of one engine; also the state the actor and the membership loop share."""

    def __init__(self, run_config: ParityConfig, engine: RolloutEngine, model_dir: Path) -> None:
        self.run_config = run_config
        self.config = config = run_config.rollout
        self.engine = engine
        self.model_dir = model_dir
        self.shapes = checkpoint_shapes(model_dir)
        self.full_version = full_version_names(self.shapes, model_dir)  # what a whole version lists
        self.rate = metrics.TokenRate()
        self.shutting_down = False
        self.required_version = 0  # latest version the broadcast service reported at registration
        self.registered = not config.broadcast_address
        self.paused = False
        self.paused_seconds_total = 0.0
        self.updates_applied = 0
        self.updates_failed = 0
        self.server: GrpcServer | None = None
        self._serving = False
        self.admission = Admission(config.max_inflight_requests, config.effective_max_inflight_tokens)
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._tokenize_pending = 0
        self.actor_failed = False
        self.engine_down = False  # from an engine death until its replacement has started
        self.engine_restarts = 0
        self.membership = None  # MembershipClient when a broadcast service is configured
        self._recovery: asyncio.Task | None = None
        self._engine_failures = 0  # deaths and failed restarts in a row (the recovery budget)
        self._engine_started_at = time.monotonic()
        self.engine_gave_up = ""  # the one-line error once the recovery budget is used up
        # called with that line (services/rollout/server.py stops the service, which exits 1)
        self.on_give_up: Callable[[str], None] | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        return Limits(
            max_model_len=self.engine.max_model_len,
            max_n=self.config.max_n,
            max_tokens=self.config.effective_max_tokens,
            vocab_size=self.engine.vocab_size,
            max_prompt_bytes=self.config.max_prompt_bytes,
        )

    @property
    def caught_up(self) -> bool:
        """Ready to generate: an engine that runs, at the version the service must serve."""
        return (
            not self.engine_down
            and not self.engine.dead()  # dead, and the tick has not noticed yet
            and self.registered
            and self.engine.weight_version >= self.required_version
        )

    @property
    def actor_healthy(self) -> bool:
        """No actor, or an actor whose loop runs and whose Redis answers."""
        if not self.config.actor:
            return True
        from parity.rollout_queue import redis_connected

        return not self.actor_failed and redis_connected() is not False

    async def refresh_serving(self) -> None:
        """SERVING once caught up with a healthy actor (and never again after shutdown began)."""
        serving = self.caught_up and self.actor_healthy and not self.shutting_down
        if serving != self._serving and self.server is not None:
            self._serving = serving
            await self.server.set_serving(serving)
            log.info(
                "health: %s (weight_version %d%s)",
                "SERVING" if serving else "NOT_SERVING",
                self.engine.weight_version,
                ", engine restarting"
                if self.engine_down
                else ("" if self.actor_healthy else ", actor down or redis unreachable"),
            )

    def check_up(self, stopping_too: bool = True) -> None:
        """UNAVAILABLE while the engine restarts, and (`stopping_too`) once the service stops."""
        if stopping_too and self.shutting_down:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "service", "shutting down")
        if self.engine_down:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine", "restarting after the engine died")

    def check_available(self) -> None:
        self.check_up()
        if self.engine.dead():
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "engine", "restarting after the engine died")
        if not self.caught_up:
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                "weight_version",
                f"serving version {self.engine.weight_version}, catching up to {self.required_version}"
                if self.registered
                else "not yet registered with the broadcast service",
            )

    def settings(self) -> rollout_pb2.EngineSettings:
        c = self.config
        return rollout_pb2.EngineSettings(
            engine=c.engine,
            model=self.run_config.model.name,
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED
            if c.logprobs_mode == "processed"
            else common_pb2.LOGPROBS_MODE_RAW,
            head_dtype=c.effective_head_dtype,
            model_dtype=c.dtype,
            prefix_caching=c.prefix_caching,
            reset_prefix_cache_on_update=c.reset_prefix_cache_on_update,
            async_scheduling=c.async_scheduling,
            generation_config=c.generation_config,
            update_mode=common_pb2.UPDATE_MODE_KEEP
            if c.update_mode == "keep"
            else common_pb2.UPDATE_MODE_RECOMPUTE,
            max_model_len=self.engine.max_model_len,
            max_n=c.max_n,
            max_tokens_limit=c.effective_max_tokens,
            top_p_impl=self.engine.top_p_impl,
        )

    # -- generation ----------------------------------------------------------------------------
    async def tokenize(self, text: str, use_chat_template: bool) -> list[int]:
        """The engine's tokenizer on the tokenizer thread; RESOURCE_EXHAUSTED past the pending bound."""
        if self._tokenize_pending >= self.config.max_tokenize_pending:
            raise overloaded(
                "prompt_text",
                f"{self._tokenize_pending} prompts waiting to be tokenised "
                f"(rollout.max_tokenize_pending={self.config.max_tokenize_pending})",
                retry_after_s=0.5,
            )
        self._tokenize_pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._tokenizer_thread, self.engine.encode, text, use_chat_template
            )
        finally:
            self._tokenize_pending -= 1

    async def spec_for(self, request: rollout_pb2.GenerateRequest) -> GenerationSpec:
        self.check_available()
        self.admission.precheck()  # a refusal costs no tokenising
        check_unknown_fields(request)
        check_prompt_fields(request, self.config.max_prompt_bytes)
        ids = (
            await self.tokenize(request.prompt_text, request.use_chat_template)
            if request.prompt_text
            else None
        )
        return generation_spec(request, ids, self.limits)

    @staticmethod
    def cost_tokens(spec: GenerationSpec) -> int:
        """What admission charges a request: the most KV its sequences can hold."""
        return spec.n * (len(spec.prompt_token_ids) + spec.max_tokens)

    async def run_group(self, spec: GenerationSpec, stream: bool = False):
        """Yield completions as they finish, recording tokens and a `generate` span."""
        attrs = {
            "parity.weight_version": self.engine.weight_version,
            "parity.group_id": spec.request_id,
            "prompt_tokens": len(spec.prompt_token_ids),
            "n": spec.n,
        }
        with tracing.span("generate", attrs) as span:
            generated = 0
            async for result in self.engine.generate(spec, stream):
                generated += len(result.token_ids)
                self.rate.add(len(result.token_ids))
                yield result
            span.set_attribute("completion_tokens", generated)

    async def Generate(self, request, context):
        spec = await self.spec_for(request)
        with self.admission.admit(self.cost_tokens(spec)):
            results = [r async for r in self.run_group(spec)]
        results.sort(key=lambda r: r.index)
        return rollout_pb2.GenerateResponse(
            prompt_token_ids=spec.prompt_token_ids,
            completions=[completion_proto(r) for r in results],
            request_id=spec.request_id,
            logprobs_mode=self.settings().logprobs_mode,
        )

    async def GenerateStream(self, request, context):
        check_unknown_fields(request)
        spec = await self.spec_for(request.request)
        with self.admission.admit(self.cost_tokens(spec)):
            async for result in self.run_group(spec, stream=True):
                yield rollout_pb2.GenerateStreamResponse(
                    prompt_token_ids=spec.prompt_token_ids,
                    completion=completion_proto(result),
                    request_id=spec.request_id,
                )

    async def GetStatus(self, request, context):
        return rollout_pb2.RolloutServiceGetStatusResponse(
            settings=self.settings(),
            weight_version=self.engine.weight_version,
            paused=self.paused,
            num_running_requests=self.engine.num_running(),
            generated_tokens_total=self.rate.total,
            paused_seconds_total=self.paused_seconds_total,
            updates_applied_total=self.updates_applied,
            updates_failed_total=self.updates_failed,
            engine_restarts_total=self.engine_restarts,
        )

    # -- weights and pausing ------------------------------------------------------------------
    async def UpdateWeights(self, request, context):
        try:
            self.check_up()
            check_update_request(request, self.shapes, self.config.enable_fault_injection, self.full_version)
            version = int(request.plan.version)
            if version < self.engine.weight_version:
                raise RequestError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "plan.version",
                    f"{version} is older than the served version {self.engine.weight_version}",
                )
        except RequestError as exc:
            await context.abort(exc.code, exc.details)
        if version == self.engine.weight_version:
            return rollout_pb2.UpdateWeightsResponse(
                outcome=rollout_pb2.UPDATE_OUTCOME_ALREADY_CURRENT, weight_version=version
            )
        mode = _MODES.get(request.update_mode, self.config.update_mode)
        with tracing.span("swap", {"parity.weight_version": version, "update_mode": mode}) as span:
            result = await self.engine.update_weights(
                request.plan, mode, request.fault_corrupt_tensor, keep_paused=self.paused
            )
            span.set_attribute("outcome", result.outcome)
            # the stages, in the trace as in the log (NaN: a stage that did not run)
            for stage in ("transfer_s", "verify_s", "prepare_s", "swap_s", "paused_s"):
                value = getattr(result, stage)
                span.set_attribute(stage, float("nan") if value is None else float(value))
            if result.outcome == "failed":
                tracing.fail(result.error)
        self.paused_seconds_total += result.paused_s
        metrics.PAUSE_SECONDS.inc(result.paused_s)
        metrics.UPDATES.labels(result.outcome).inc()
        if result.outcome == "applied":
            self.updates_applied += 1
            metrics.WEIGHT_VERSION.set(result.weight_version)
            log.info(
                "weights v%d applied (%s): transfer %.2fs verify %.2fs %sswap %.2fs paused %.2fs",
                version,
                mode,
                result.transfer_s,
                result.verify_s,
                "" if result.prepare_s is None else f"prepared {result.prepare_s:.2f}s (generating), ",
                result.swap_s,
                result.paused_s,
            )
        else:
            self.updates_failed += 1
            log.warning(
                "weights v%d FAILED, still serving v%d: %s", version, result.weight_version, result.error
            )
        await self.refresh_serving()
        return rollout_pb2.UpdateWeightsResponse(
            outcome=_OUTCOME[result.outcome],
            weight_version=result.weight_version,
            error=result.error,
            checksums=result.checksums,
            transfer_seconds=result.transfer_s,
            verify_seconds=result.verify_s,
            swap_seconds=result.swap_s,
            paused_seconds=result.paused_s,
            prepare_seconds=result.prepare_s,
        )

    async def PauseGeneration(self, request, context):
        check_unknown_fields(request)
        self.check_up()
        check_update_mode(request.mode, "mode")  # UNSPECIFIED: the configured mode
        if not self.paused:
            await self.engine.pause(_MODES.get(request.mode, self.config.update_mode))
            self.paused = True
            self._paused_at = time.monotonic()
        return rollout_pb2.PauseGenerationResponse()

    async def ResumeGeneration(self, request, context):
        check_unknown_fields(request)
        # also while stopping: a client's pause must not hold in-flight requests through the grace period
        self.check_up(stopping_too=False)
        if self.paused:
            await self.engine.resume()
            self.paused = False
            elapsed = time.monotonic() - self._paused_at
            self.paused_seconds_total += elapsed
            metrics.PAUSE_SECONDS.inc(elapsed)
        return rollout_pb2.ResumeGenerationResponse()

    # -- engine death ------------------------------------------------------------------------------
    def watch_engine(self) -> None:
        """Start the recovery of a dead engine (called every tick; one recovery at a time)."""
        if (
            self.engine.dead()
            and not self.shutting_down
            and not self.engine_gave_up
            and (self._recovery is None or self._recovery.done())
        ):
            self._recovery = asyncio.create_task(self.recover_engine())

    async def start_engine(
        self, start_s: float = ENGINE_RESTART_START_S, cap_s: float = ENGINE_RESTART_CAP_S
    ) -> None:
        """The engine's first start. An engine that died while it started (EngineDeadError: vLLM's
        engine-core process was killed, rollout.vllm_engine.killed_while_starting) is started again
        after the same capped backoff as a restart, up to `engine_restart_attempts` failures in a row;
        then, or on any other failure (a bad checkpoint, settings the engine refuses: retrying cannot
        help), it raises and the service exits 1."""
        attempts = self.config.engine_restart_attempts
        failures = 0
        while True:
            try:
                await self.engine.start()
                break
            except EngineDeadError as exc:
                failures += 1
                if self.shutting_down:
                    raise
                if failures >= attempts:
                    raise RuntimeError(
                        f"rollout engine: gave up after {failures} failed starts in a row "
                        f"(restart budget {attempts}); last cause: {exc}"
                    ) from exc
                delay_s = restart_backoff_s(failures, start_s, cap_s)
                log.error(
                    "engine start failed (%s); starting it again in %.1fs (failure %d of %d in a row)",
                    exc,
                    delay_s,
                    failures,
                    attempts,
                )
                self.engine_restarts += 1
                metrics.ENGINE_RESTARTS.inc()
                await asyncio.sleep(delay_s)
        self._engine_started_at = time.monotonic()

    def _engine_failed(self, cause: str) -> bool:
        """Count one failure against the budget; True (after reporting it) once it is used up."""
        attempts = self.config.engine_restart_attempts
        self._engine_failures += 1
        if self._engine_failures < attempts:
            return False
        self.engine_gave_up = (
            f"rollout engine: gave up after {self._engine_failures} failures in a row "
            f"(restart budget {attempts}); last cause: {cause}"
        )
        if self.on_give_up is not None:
            self.on_give_up(self.engine_gave_up)
        else:
            log.error("%s", self.engine_gave_up)
        return True

    async def recover_engine(
        self, start_s: float = ENGINE_RESTART_START_S, cap_s: float = ENGINE_RESTART_CAP_S
    ) -> str:
        """NOT_SERVING, a fresh engine, then serving again at the version served before (module
        docstring). Returns "" once recovered (or shutting down), or the one-line error when the
        budget is used up (the engine stays down: NOT_SERVING until the service stops)."""
        lost_version = self.engine.weight_version
        self.engine_down = True
        self.required_version = max(self.required_version, lost_version)
        self.engine_restarts += 1
        metrics.ENGINE_RESTARTS.inc()
        await self.refresh_serving()
        if time.monotonic() - self._engine_started_at > 10 * cap_s:
            self._engine_failures = 0  # it served a long while: a fresh fault
        if self._engine_failed(f"the engine died while serving v{lost_version}"):
            return self.engine_gave_up
        log.error(
            "engine died while serving v%d (requests in flight on it answer UNAVAILABLE); restarting it "
            "(failure %d of %d in a row)",
            lost_version,
            self._engine_failures,
            self.config.engine_restart_attempts,
        )
        restarted = False
        while not restarted and not self.shutting_down:
            if self._engine_failures > 1:  # not the first failure in a row: back off first
                await asyncio.sleep(restart_backoff_s(self._engine_failures - 1, start_s, cap_s))
                if self.shutting_down:
                    break
            started = time.monotonic()
            try:
                await self.engine.restart()
                restarted = True
            except Exception as exc:
                if self.shutting_down:
                    break  # the service stopped it while it started: not a failure
                if self._engine_failed(f"restart failed: {type(exc).__name__}: {exc}"):
                    return self.engine_gave_up
                log.error(
                    "engine restart failed (%r); retrying in %.1fs (failure %d of %d in a row)",
                    exc,
                    restart_backoff_s(self._engine_failures - 1, start_s, cap_s),
                    self._engine_failures,
                    self.config.engine_restart_attempts,
                )
        if not restarted:
            return ""  # shutting down
        self._engine_started_at = time.monotonic()
        if self.paused:  # a client's PauseGeneration does not survive the engine it paused
            log.warning("the engine restarted unpaused; the client's PauseGeneration is void")
            self.paused = False
        metrics.WEIGHT_VERSION.set(self.engine.weight_version)
        self.engine_down = False
        log.info(
            "engine restarted in %.1fs at v%d; serving again once at v%d",
            time.monotonic() - started,
            self.engine.weight_version,
            self.required_version,
        )
        if self.membership is not None:
            # Registered again at version 0: the broadcast service's record of the old engine's
            # version is void, and the trainer's catch-up brings this worker to the latest version.
            self.registered = False
            await self.membership.register()
        await self.refresh_serving()
        return ""
