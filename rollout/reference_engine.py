"""The reference rollout engine: HF transformers with exactly the trainer's numerics. Slow, exact.

It is the baseline A/B runs compare vLLM against. Every token is sampled from
`parity.sampling.processed_logprobs(logits, transform)` (temperature -> top-k -> top-p,
renormalised, float32), the same function the trainer replays, so processed logprobs here are by
construction the trainer's. Logits come from the lm_head in float32 when `head_dtype=float32`.
It runs on `rollout.device` (cpu or cuda); sampling draws from a CPU generator either way, so a
seed gives the same tokens on both when the logits agree.

Invariants:
  - One forward step at a time holds the model lock; a weight update takes the same lock, so a
    step sees either the old or the new weights, never a mix, and records the version it saw.
  - keep mode: a running group continues with its cached KV under the new weights (as vLLM does).
    recompute mode: a running group re-runs prefill over prompt + generated tokens after the swap.
  - The n completions of a group are one batch [n, L]; requests are not batched with each other.
  - Generation runs on the engine's own generation threads; the pause's wait for the model lock runs
    on a thread of its own, and so does the staging of an update (a pause never waits for a
    transfer). A request waiting out a pause holds its thread, so on a shared pool the pause could
    queue behind the very requests it had stopped: UpdateWeights hung with 24 requests in flight on
    the default executor's 6 threads. A pause cancelled while it waits (a deadline) hands the lock
    back as soon as its thread takes it.
  - Tests only (`rollout.fault`): a parity fault of parity/faults.py acts on requests whose step runs
    at a weight version where it is active, at the site it lives in a real engine: the prompt it
    conditions on, the penalties and transform it samples with, the logprobs and tags it reports, the
    head's precision, the prefill's or first token's weights (the copy of the weights held before the
    last update is kept only while stale_prefix_kv or async_first_token is set), and what an update
    leaves it with (`_swap`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from parity.config.rollout import RolloutConfig
from parity.faults import (
    PENALTY_FAULTS,
    STALE_MODEL_FAULTS,
    conditioned_prompt,
    corrupt_update,
    double_rope_theta,
    engine_transform,
    parse_fault,
    penalised,
    reported,
)
from parity.head_logits import float32_logits
from parity.models import quiet_loading
from parity.sampling import SamplingTransform, processed_logprobs
from parity.weights.receiver import StagedWeights, receive_and_verify
from rollout.engine import CompletionResult, GenerationSpec, RolloutEngine
from rollout.vllm_engine import encode_prompt

log = logging.getLogger(__name__)


class ReferenceEngine(RolloutEngine):
    """`RolloutEngine` on HF transformers + parity.sampling."""

    name = "reference"

    def __init__(self, config: RolloutConfig, model_dir: Path, seed: int = 0) -> None:
        super().__init__(config, model_dir, seed)
        self.top_p_impl = "reference"  # parity.sampling's transform, as the trainer replays it
        self.max_model_len = config.max_model_len
        self.model = None
        self._model_lock = threading.Lock()
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._recompute_epoch = 0
        self._staged: StagedWeights | None = None  # verified, waiting for _swap
        self._eos_ids: set[int] = set()
        self.device = "cpu"
        # Tests only (rollout.fault, validated with enable_fault_injection): a parity fault from a version on.
        self._fault = parse_fault(config.fault, "rollout.fault") if config.fault else None
        self._previous_update: dict | None = None  # what the last update asked for (stale_weights)
        self._stale_model = None  # the weights held before the last update (STALE_MODEL_FAULTS only)
        self._first_head = None  # the head of the first load (untied_head only)
        self._rope_doubled = False  # rope_theta, once the fault is on
        self._generation_threads = ThreadPoolExecutor(thread_name_prefix="reference-generate")
        self._pause_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-pause")
        self._stage_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference-stage")

    def _fault_at(self, version: int) -> str:
        """The injected fault's name when it is active at `version`, else ""."""
        return self._fault.fault.name if self._fault is not None and self._fault.active(version) else ""

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.config.reference_threads)
        if self.config.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("rollout.device: cuda requested but torch sees no CUDA device")
            # float32 matmuls in full float32, as the trainer computes them (TF32 keeps 10 bits).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
            self.device = f"cuda:{torch.cuda.current_device()}"
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        dtype = torch.float32 if self.config.dtype == "float32" else torch.bfloat16
        with quiet_loading():
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype)
        self.model = model.eval().to(self.device)
        self.vocab_size = int(self.model.config.vocab_size)
        eos = self.model.config.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self._eos_ids.add(int(self.tokenizer.eos_token_id))
        torch.manual_seed(self.seed)
        if self._fault is not None and self._fault.fault.name == "untied_head":
            self._first_head = self.model.lm_head.weight.detach().clone()
        if self._fault_at(self.weight_version) == "rope_theta":
            double_rope_theta(self.model)
            self._rope_doubled = True

    def encode(self, text: str, use_chat_template: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, use_chat_template)

    def _logits(self, input_ids, cache, fault: str = "", prompt_len: int = 0):
        """Last-position logits [n, V] in the head dtype, and the updated KV cache. `fault` (active
        at this step's version) may change where a prefill's weights come from or the head's
        precision; `prompt_len` is the length of the prompt at the start of `input_ids`."""
        import torch

        prefill = cache is None
        stale = self._stale_model
        with torch.no_grad():
            if prefill and fault == "stale_prefix_kv" and stale is not None and prompt_len > 1:
                # The prompt's KV (all but its last token) from a prefix cache filled at v-1.
                cache = stale.model(input_ids=input_ids[:, : prompt_len - 1], use_cache=True).past_key_values
                input_ids = input_ids[:, prompt_len - 1 :]
            out = self.model.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
            hidden_nd = out.last_hidden_state[:, -1, :]
            head = self.model.lm_head
            if (
                prefill
                and fault == "async_first_token"
                and stale is not None
                and input_ids.shape[1] == prompt_len
            ):
                # The first token is sampled (and scored) at the weights before the update.
                hidden_nd, head = stale.model(input_ids=input_ids).last_hidden_state[:, -1, :], stale.lm_head
            if fault == "bf16_lm_head":
                logits = (hidden_nd.bfloat16() @ head.weight.bfloat16().T).float()
            elif self.config.head_dtype == "float32":
                logits = float32_logits(hidden_nd, head.weight)  # as vLLM's fp32 head: exact products
            else:
                logits = head(hidden_nd)
        return logits, out.past_key_values

    def _generate_sync(self, spec: GenerationSpec, emit) -> None:
        import torch

        transform = SamplingTransform(spec.temperature, spec.top_k, spec.top_p)
        generator = torch.Generator()
        generator.manual_seed(spec.seed if spec.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        n = spec.n
        conditioned: list[int] = []  # the prompt the engine conditions on, fixed at the first step
        prompt = None
        generated: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        versions: list[list[int]] = [[] for _ in range(n)]
        tops: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]
        finished: list[str | None] = [None] * n
        sampled: list[torch.Tensor] = []
        cache = None
        epoch = -1
        for _ in range(spec.max_tokens):
            self._unpaused.wait()
            with self._model_lock:
                version = self.weight_version
                fault = self._fault_at(version)
                if prompt is None:  # a prompt fault changes what it conditions on, not what is recorded
                    conditioned = conditioned_prompt(fault, spec.prompt_token_ids)
                    prompt = torch.tensor([conditioned] * n, dtype=torch.long, device=self.device)
                    next_input = prompt
                if epoch != self._recompute_epoch and cache is not None:
                    cache = None  # recompute mode: re-run prefill under the new weights
                    next_input = torch.cat([prompt, torch.stack(sampled, dim=1)], dim=1)
                epoch = self._recompute_epoch
                logits_nv, cache = self._logits(next_input, cache, fault, len(conditioned))
            if fault in PENALTY_FAULTS:  # the engine's penalty, on each row's logits before the transform
                logits_nv = torch.cat(
                    [penalised(fault, logits_nv[i : i + 1], conditioned, generated[i]) for i in range(n)]
                )
            applied = engine_transform(fault, transform)  # the requested transform unless a replay fault
            if self.config.logprobs_mode == "processed" and fault != "raw_logprobs":
                logprobs_nv = processed_logprobs(logits_nv, applied)
            else:
                logprobs_nv = logits_nv.float().log_softmax(dim=-1)
            sampling_nv = processed_logprobs(logits_nv, applied)
            if transform.greedy:
                tokens_n = sampling_nv.argmax(dim=-1)
            else:
                probs_nv = sampling_nv.exp().cpu()  # the CPU generator: the same draws on any device
                tokens_n = torch.multinomial(probs_nv, 1, generator=generator).squeeze(-1).to(self.device)
            chosen_n = logprobs_nv.gather(-1, tokens_n.unsqueeze(-1)).squeeze(-1).cpu()
            tokens_n_host = tokens_n.cpu()
            top_n = top_rows(logprobs_nv, spec.top_logprobs) if spec.top_logprobs else None
            for i in range(n):
                if finished[i] is not None:
                    continue
                tok = int(tokens_n_host[i])
                generated[i].append(tok)
                logprobs[i].append(float(chosen_n[i]))
                versions[i].append(version)
                if top_n is not None:
                    tops[i].append(top_n[i])
                text = self.tokenizer.decode(generated[i], skip_special_tokens=True)
                if (tok in self._eos_ids and not spec.ignore_eos) or any(s and s in text for s in spec.stop):
                    finished[i] = "stop"
                elif len(generated[i]) >= spec.max_tokens:
                    finished[i] = "length"
                if finished[i] is not None:
                    reported, tags = self._reported(logprobs[i], versions[i])
                    emit(
                        CompletionResult(
                            i, generated[i], reported, tags, text, finished[i], top_logprobs=tops[i]
                        )
                    )
            if all(f is not None for f in finished):
                return
            # Finished rows keep sampling so the batch stays rectangular; those tokens are discarded.
            sampled.append(tokens_n)
            next_input = tokens_n.unsqueeze(-1)

    def _reported(self, logprobs: list[float], versions: list[int]) -> tuple[list[float], list[int]]:
        """The logprobs and version tags the engine reports (a reporting fault changes them)."""
        return reported(self._fault_at(versions[-1]) if versions else "", logprobs, versions)

    async def generate(self, spec: GenerationSpec, stream: bool = False) -> AsyncIterator[CompletionResult]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(result: CompletionResult) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, result)

        def run() -> None:
            try:
                self._generate_sync(spec, emit)
            except BaseException as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        self._running += 1
        try:
            await self.admitted()
            worker = loop.run_in_executor(self._generation_threads, run)
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                item.token_context_versions = self.context_versions(item.token_weight_versions)
                yield item
            await worker
        finally:
            self._running -= 1

    async def _pause(self, mode: Literal["keep", "recompute"]) -> None:
        self._unpaused.clear()
        acquired = asyncio.get_running_loop().run_in_executor(self._pause_thread, self._model_lock.acquire)
        try:
            await asyncio.shield(acquired)  # waits out the running step
        except asyncio.CancelledError:
            # The thread still takes the lock once the step ends: hand it back then, or every later
            # step and swap would wait for it forever.
            acquired.add_done_callback(lambda _: self._model_lock.release())
            raise
        try:
            if mode == "recompute":
                self._recompute_epoch += 1
        finally:
            self._model_lock.release()

    async def _resume(self) -> None:
        self._unpaused.set()

    async def _stage(self, plan, fault_corrupt_tensor: str) -> dict:
        staged = await asyncio.get_running_loop().run_in_executor(
            self._stage_thread, receive_and_verify, plan, self.device, fault_corrupt_tensor
        )
        report = staged.report()
        if not staged.error:
            params = self.model.state_dict()
            for name, tensor in staged.named():
                if name not in params or tuple(params[name].shape) != tuple(tensor.shape):
                    report["error"] = f"tensor {name!r} does not match the model's parameters"
                    break
        self._staged = None if report["error"] else staged
        return report

    async def _discard_staged(self) -> None:
        self._staged = None

    async def _swap(self, version: int) -> tuple[str, float]:
        import torch

        staged, self._staged = self._staged, None
        assert staged is not None, "_swap without a verified _stage"
        start = time.perf_counter()
        with self._model_lock:
            named = dict(staged.named())
            load = named
            fault = self._fault_at(version)
            if fault == "one_worker_not_updated":  # the second worker (rollout1) keeps serving v-1
                fault = "stale_weights" if self.config.worker_index == 1 else ""
            if self._fault is not None and self._fault.fault.name in STALE_MODEL_FAULTS:
                if self._stale_model is None:
                    self._stale_model = copy.deepcopy(self.model)
                else:
                    self._stale_model.load_state_dict(self.model.state_dict())
            if fault:
                current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                load = corrupt_update(fault, named, current, self._previous_update)
            self.model.load_state_dict(load, strict=False)
            if fault == "untied_head":  # the head keeps its first load's weights, the embeddings update
                self.model.lm_head.weight = torch.nn.Parameter(self._first_head.clone())
            if fault == "rope_theta" and not self._rope_doubled:
                double_rope_theta(self.model)
                self._rope_doubled = True
            self._previous_update = named if self._fault is not None else None
            self.weight_version = version
        return "", time.perf_counter() - start

    async def device_uuid(self) -> str:
        if not self.device.startswith("cuda"):
            return ""
        from parity.weights.devices import cuda_device_uuid

        return cuda_device_uuid(self.device)

    async def shutdown(self) -> None:
        self._unpaused.set()
        # Requests already queued still run to their end (the service drains them first).
        self._generation_threads.shutdown(wait=False)
        self._pause_thread.shutdown(wait=False)
        self._stage_thread.shutdown(wait=False)


def top_rows(logprobs_nv, k: int) -> list[list[tuple[int, float]]]:
    """Per row, the `k` most likely tokens and their logprobs, most likely first; tokens the sampling
    transform excluded (logprob -inf) are left out."""
    values, ids = logprobs_nv.float().topk(min(k, logprobs_nv.shape[-1]), dim=-1)
    return [
        [(int(t), float(v)) for t, v in zip(row_ids, row_values, strict=True) if math.isfinite(v)]
        for row_ids, row_values in zip(ids.cpu().tolist(), values.cpu().tolist(), strict=True)
    ]
