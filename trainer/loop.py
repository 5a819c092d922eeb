"""The training loop: one run's model, optimizer, queue, publisher, history and checkpoints.

One iteration, each stage a function with typed inputs and outputs (and a span and a timing,
`time/<stage>_s` in metrics.jsonl):

    batch    = consumer.collect(groups_per_step)               # XREADGROUP/XAUTOCLAIM; dedupe; max_lag
    prepared = prepare(batch)                                  # pure: advantages, trainable/frozen
    stats    = forward_backward(prepared)                      # fp32 head, each rollout's transform
    result   = optimizer_step()                                # the update is applied ...
    own      = score_own_version(prepared, history)            # stale tokens at their own weights
    metrics  = step_metrics(batch, prepared, stats, result, own)   # pure
    commit(batch, metrics)                                     # ... and only then acknowledged;
                                                               # counters, telemetry, the gate
    every publish_every steps: publish(version + 1)            # version += 1 only if it succeeded
    every checkpoint_every steps / on request / at the end: checkpoint, then set replay floor

Steps with a non-finite gradient: trainer/nonfinite.py. Crash safety and resuming: trainer/recovery.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity import tracing
from parity.config import ParityConfig
from parity.rollout_queue import MIN_ID, RolloutQueue
from trainer import step as stages
from trainer.build import build_models
from trainer.checkpoint import CheckpointStore, TrainerState, atomic_write_text
from trainer.consumer import Batch, RolloutConsumer
from trainer.device import reset_peak_memory, synchronize
from trainer.head_watch import HeadWatch
from trainer.mismatch_gate import GATED_METRIC, MismatchGate, running_threshold
from trainer.mismatch_locate import MISMATCH_REPORT, locate
from trainer.nonfinite import record_skipped_step
from trainer.own_version import score_own_version
from trainer.precision import compute_precision
from trainer.prepare import PreparedBatch, ScoredSequence, prepare, trainable_counts
from trainer.recovery import PUBLISHED_VERSION_FILE, bound_dedupe, plan_resume, read_published_version
from trainer.stats import StepStats
from trainer.step_metrics import (
    SpeedInputs,
    episode_metrics,
    flops_per_token,
    own_version_metrics,
    speed_metrics,
    step_metrics,
    step_samples,
    version_tag_metrics,
)
from trainer.telemetry import Telemetry
from trainer.weight_history import WeightHistory, full_weights

if TYPE_CHECKING:
    import torch

    from parity.weights.sender import Publisher

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stage(name: str, timings: dict[str, float], device=None) -> Iterator[None]:
    """One named stage of a step: a child span of train_step, a torch.profiler range of the same
    name (bench/op_profile.py) and `time/<name>_s` in the metrics. On a GPU (`device`) the stage
    ends when its kernels have: the optimizer's, queued without a sync, would otherwise count in
    the next stage."""
    from torch.profiler import record_function

    start = time.perf_counter()
    with tracing.span(f"train_step.{name}"), record_function(f"train_step.{name}"):
        yield
        if device is not None:
            synchronize(device)
    timings[f"time/{name}_s"] = time.perf_counter() - start


class Trainer:
    """Owns the model, optimizer, queue consumer, publisher and checkpoints of one run."""

    def __init__(self, run_config: ParityConfig) -> None:
        self.config = config = run_config.trainer
        self.schedule = run_config.run  # seed, steps, groups_per_step, max_lag, publish_every, stream
        check = run_config.check
        threshold, source = running_threshold(run_config)
        self.gate = MismatchGate(threshold, check.gate_steps, check.on_mismatch, source)
        expect_float32_head = run_config.rollout.effective_head_dtype == "float32"
        self.head_watch = HeadWatch(expect_float32_head, check.on_mismatch)
        self.model_name = run_config.model.name
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state = TrainerState()
        self.last_metrics: dict[str, Any] = {}
        self.stop_event = threading.Event()
        self.checkpoint_requested = threading.Event()
        self.lock = threading.Lock()
        self.ready = False
        self.finished = False
        self._unpublished_steps = 0
        self._nonfinite_in_a_row = 0  # consecutive steps skipped for a non-finite gradient
        self._step_traceparents: list[str] = []  # train_step spans since the last publish
        # rank 0 of a multi-rank service announces every full-weight gather (trainer/multirank.py)
        self.announce_gather: Callable[[], None] | None = None
        self._checkpointed: tuple[int, int] | None = None
        self.in_step = False  # between taking a batch and finishing its publish

    # ---- setup -----------------------------------------------------------------------------------
    def setup_model(self) -> None:
        """Device, model (sharded when world_size > 1), optimizer, scheduler, frozen copies and the
        weight history; no queue, no publisher."""
        cfg = self.config
        built = build_models(cfg, self.schedule.seed, self.model_name)
        self.device, self.rank, self.world_size = built.device, built.rank, built.world_size
        self.distributed, self.model_dir = built.distributed, built.model_dir
        self.model, self.scorer, self.optimizer, self.scheduler = (
            built.model,
            built.scorer,
            built.optimizer,
            built.scheduler,
        )
        self.ref_model, self.old_model = built.ref_model, built.old_model
        self.flops_per_token = flops_per_token(self.model)
        # Past versions' weights: the frozen copy scores stale tokens under up to max_lag older
        # versions, and the gate's localisation replays one version back (even in sync mode, where
        # max_lag is 0); the sender's catch-up needs only the newest.
        keep = max(self.schedule.max_lag + 1, 2) if self.old_model is not None else 1
        self.history = WeightHistory(keep=keep)
        self._history_wanted = self.old_model is not None or bool(cfg.broadcast_address)

    def setup(self) -> None:
        cfg, schedule = self.config, self.schedule
        self.setup_model()
        log.info(
            "running mismatch gate: %s above %g (%s) for %d measured step(s) -> %s",
            GATED_METRIC,
            self.gate.threshold,
            self.gate.source,
            self.gate.steps,
            self.gate.action,
        )
        self.store = CheckpointStore(
            self.run_dir, keep=cfg.keep_checkpoints, model_source=str(self.model_dir)
        )
        self.telemetry = Telemetry(self.run_dir)
        restored = self.store.load(self.model, self.optimizer, scheduler=self.scheduler)
        self.state = restored or TrainerState()
        if restored is not None:  # on disk already: a trainer started on a finished run writes none
            self._checkpointed = (self.state.step, self.state.weight_version)
        self.telemetry.resume(self.state.step)
        self.applied_ids = set(self.state.applied_rollout_ids)
        # rollout id -> stream entry id it was trained from (insertion order = training order).
        entries = self.state.applied_rollout_entries or [MIN_ID] * len(self.state.applied_rollout_ids)
        self.applied_entries = dict(zip(self.state.applied_rollout_ids, entries, strict=True))
        self.queue = RolloutQueue(schedule.redis_url, schedule.stream, cfg.consumer_group, cfg.stream_maxlen)
        self.queue.rewind(self.state.replay_floor)
        self.queue.set_replay_floor(self.state.replay_floor)
        self.consumer = RolloutConsumer(
            self.queue,
            cfg.consumer_name,
            self.applied_ids,
            cfg.claim_idle_ms,
            cfg.read_block_ms,
            lost_versions=self.state.lost_versions,
        )
        self.publisher = self._make_publisher()
        broadcast_latest = self.publisher.latest_version()
        file_published = read_published_version(self.run_dir)
        # The stream witnesses versions only for a run that has recorded something (a checkpoint,
        # a published version): a new run directory trains whatever rollouts it is given.
        resuming = restored is not None or file_published > 0
        plan = plan_resume(
            self.state.weight_version,
            self.state.published_version,
            file_published,
            broadcast_latest,
            bool(cfg.broadcast_address),
            self.queue.latest_version(self.state.replay_floor) if resuming else 0,
        )
        self.state.published_version = plan.published
        if plan.lost:
            self.state.lost_versions.append(list(plan.lost))
        if plan.republish and schedule.mode == "sync":
            # Rollouts the re-published version could not train (lost or, renumbered, too stale)
            # leave the stream and their prompts are drawn again: what an uninterrupted run trains.
            redrawn = self.queue.redraw_unusable(
                self.state.replay_floor,
                self.state.lost_versions,
                plan.published + 1 - schedule.max_lag,
                {rollout_id.rsplit("/", 1)[0] for rollout_id in self.applied_ids},
            )
            if redrawn:
                log.warning(
                    "sync resume: rollouts the restored weights cannot train were removed from the "
                    "stream; their prompts are drawn again (first draw per worker %s)",
                    redrawn,
                )
        log.info(
            "trainer ready: step %d, version %d (highest published %d), floor %s, %d rollouts applied%s",
            self.state.step,
            self.state.weight_version,
            plan.published,
            self.state.replay_floor,
            len(self.applied_ids),
            " (restored)" if restored else "",
        )
        if plan.republish:
            log.warning(
                "resuming at version %d (highest published %d, broadcast holds %d): re-publishing the "
                "restored weights; rollouts of versions %s are dropped",
                self.state.weight_version,
                plan.published,
                broadcast_latest,
                self.state.lost_versions or "none",
            )
            self._publish()
        elif self._history_wanted:  # stale tokens of the current version are scored under it
            named = self.full_weights()
            self._record_history(self.state.weight_version, named)
            # workers behind (a rollout service restarted too) need it before the first step can
            # have rollouts: this process has not published it, so catch-ups start from here
            self.publisher.serve_catch_up(self.state.weight_version, named)
        self.ready = True

    def _make_publisher(self) -> Publisher:
        from parity.weights.sender import Publisher

        cfg = self.config
        return Publisher(
            cfg.broadcast_address,
            self.model_name,
            auth_token=cfg.auth_token,
            bucket_bytes=cfg.bucket_bytes,
            wait_committed_s=cfg.wait_committed_s,
            snapshots=self.history.ordered,  # catch-up reads the history: no second host copy
        )

    # ---- control (called from gRPC threads) ------------------------------------------------------
    def request_stop(self) -> None:
        self.stop_event.set()

    def request_checkpoint(self) -> None:
        self.checkpoint_requested.set()

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {
                "step": self.state.step,
                "weight_version": self.state.weight_version,
                "last_metrics": dict(self.last_metrics),
                "rollouts_trained_total": self.state.rollouts_trained_total,
                "dropped_stale_total": self.state.dropped_stale_total,
                "duplicates_skipped_total": self.state.duplicates_skipped_total,
            }

    # ---- main loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Train until `steps` are done or a stop is requested; then publish + checkpoint."""
        cfg, schedule = self.config, self.schedule
        while self.state.step < schedule.steps and not self.stop_event.is_set():
            batch = self.consumer.collect(
                schedule.groups_per_step,
                self.state.weight_version,
                schedule.max_lag,
                self.stop_event.is_set,
                on_wait=self._checkpoint_if_requested,
            )
            if batch is None:
                break
            self.in_step = True
            self.train_step(batch)
            if self.state.step % schedule.publish_every == 0:
                self._publish()
            self.in_step = False
            due = cfg.checkpoint_every > 0 and self.state.step % cfg.checkpoint_every == 0
            if due or self.checkpoint_requested.is_set():
                self.checkpoint()
        if self._unpublished_steps:
            self._publish()
        if self._checkpointed != (self.state.step, self.state.weight_version):
            self.checkpoint()
        self.finished = True

    def train_step(self, batch: Batch) -> dict[str, Any]:
        """One optimizer step on `batch`, as named stages; acks its entries; records metrics."""
        start = time.perf_counter()
        timings: dict[str, float] = {}
        version = self.state.weight_version
        attrs = {tracing.ATTR_WEIGHT_VERSION: version, tracing.ATTR_STEP: self.state.step + 1}
        with tracing.span("train_step", attrs, links_from=batch.traceparents) as span:
            self._step_traceparents.append(tracing.current_traceparent())
            reset_peak_memory(self.device)
            with stage("prepare", timings):
                prepared = prepare(batch, self.config)
                counts = trainable_counts(prepared.sequences)
            with stage("forward_backward", timings, self.device):
                stats = self.forward_backward(prepared.sequences, counts)
            with stage("optimizer_step", timings, self.device):
                result = self.optimizer_step(counts[0])
            with stage("score_own_version", timings, self.device):
                own = score_own_version(
                    self.old_model,
                    self.history,
                    prepared.sequences,
                    version,
                    self.config.own_version_groups,
                    self.device,
                )
            step_time_s = time.perf_counter() - start
            with stage("step_metrics", timings):
                metrics = step_metrics(batch, prepared, stats, result, self.state, step_time_s)
                metrics.update(speed_metrics(stats, self._speed, step_time_s))
                metrics.update(own_version_metrics(stats, own))
                metrics.update(episode_metrics(batch))
                metrics.update(version_tag_metrics(batch))
                metrics.update(self.head_watch.observe(batch.groups))
            metrics.update(timings)
            metrics["backlog"] = self.queue.backlog()  # stream entries this trainer has not acked
            span.set_attribute(tracing.ATTR_TOKENS, prepared.num_tokens)
            span.set_attribute("parity.groups", len(batch.groups))
            span.set_attribute(tracing.ATTR_LAG, metrics["lag_max"])
            span.set_attribute("parity.lag_mean", metrics["lag_mean"])
            span.set_attribute("parity.mismatch_k3", metrics["mismatch_k3"])
        self._commit(batch, prepared, metrics, result)
        return metrics

    def _commit(
        self, batch: Batch, prepared: PreparedBatch, metrics: dict[str, Any], result: stages.OptimizerResult
    ) -> None:
        """Ack the batch, count it, record the step (telemetry, samples), then let the gate judge."""
        self.queue.ack(batch.all_entry_ids())
        if self.config.checkpoint_every == 0:
            self._release_consumed()
        self._unpublished_steps += int(result.stepped)
        # A non-finite gradient skipped the optimizer step: the batch is dropped, not trained.
        nonfinite = metrics["trainable_tokens"] > 0 and not math.isfinite(result.grad_norm)
        trained_ids, skipped_ids = ([], batch.rollout_ids()) if nonfinite else (batch.rollout_ids(), [])
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if nonfinite else 0
        with self.lock:
            self.state.step += 1
            self.state.skipped_nonfinite_steps_total += int(nonfinite)
            self.state.rollouts_skipped_nonfinite_total += len(skipped_ids)
            metrics["skipped_nonfinite"] = int(nonfinite)
            metrics["skipped_nonfinite_steps_total"] = self.state.skipped_nonfinite_steps_total
            metrics["rollouts_skipped_nonfinite"] = len(skipped_ids)
            self.applied_ids.update(trained_ids)
            for group, entry_id in zip(batch.groups, batch.entry_ids, strict=True):
                for sample in group.samples if trained_ids else ():
                    self.applied_entries[sample.rollout_id] = entry_id
            self.state.rollouts_trained_total += len(trained_ids)
            self.state.dropped_stale_total += batch.dropped_stale
            self.state.dropped_future_version_total += batch.dropped_future_version
            self.state.duplicates_skipped_total += batch.duplicates
            self.state.zero_variance_groups_total += prepared.zero_variance_groups
            self.state.malformed_total += batch.malformed
            self.last_metrics = metrics
        self.telemetry.record(
            metrics,
            trained_ids,
            {
                "rollouts_trained": len(trained_ids),
                "dropped_stale": batch.dropped_stale,
                "duplicates_skipped": batch.duplicates,
            },
            samples=step_samples(batch, metrics["weight_version"], metrics["step"]),
        )
        log.info(
            "step %d v%d: reward %.3f, loss %.4f, k3(own version) %.2e, lag %.2f, %d tok in %.2fs (%.0f tok/s)",
            metrics["step"],
            metrics["weight_version"],
            metrics["reward_mean"],
            metrics["loss"],
            metrics.get("mismatch_k3_own_version", math.nan),
            metrics["lag_mean"],
            metrics["num_tokens"],
            metrics["step_time_s"],
            metrics["tokens_per_s"],
        )
        if nonfinite:
            record_skipped_step(
                self.run_dir,
                metrics["step"],
                skipped_ids,
                result.grad_norm,
                self._nonfinite_in_a_row,
                self.config.max_nonfinite_steps,
            )
        # After the step is recorded: with on_mismatch=stop this raises MismatchGateError, which ends
        # the run with the gate's message (the step's rollouts are trained and accounted for).
        self.gate.observe(metrics["step"], metrics, explain=lambda: self.locate_mismatch(batch))
        self.head_watch.judge(metrics["step"])  # the engine's logits: float32 as expected?

    def locate_mismatch(self, batch: Batch) -> str:
        """Where the step's mismatch lives and its likely fault classes (trainer/mismatch_locate.py),
        written to mismatch_report.json and .png in the run directory; a one-paragraph summary."""
        # Rank 0 (the only rank that gates) holds a whole frozen copy for own-version rescoring and
        # the full weights of every held version (gathered when they were published): it replays
        # alone, with no collective. Sharded (old_logprobs recompute on several ranks), it cannot.
        if self.old_model is None or (self.world_size > 1 and self.config.old_logprobs == "recompute"):
            return (
                "not run (it replays on the trainer's whole frozen copy: own_version_groups > 0, "
                "and on several ranks old_logprobs other than recompute)"
            )
        # The other ranks wait in a collective meanwhile: keep well inside its timeout.
        budget_s = min(60.0, self.config.dist_timeout_s / 4) if self.world_size > 1 else 60.0
        report = locate(
            self.old_model.lm,
            self.history,
            batch.groups,
            budget_s=budget_s,
            tokenizer_dir=self.model_dir,
            precision=self.old_model.precision,
        )
        if report is None:
            return "not run (the history holds none of the step's weight versions)"
        paths = report.write(self.run_dir / MISMATCH_REPORT)
        return f"{report.summary()} Report: {', '.join(str(p) for p in paths)}"

    # ---- the model-facing stages (the multi-rank trainer overrides forward_backward) -------------
    @property
    def models(self) -> stages.StepModels:
        return stages.StepModels(self.scorer, self.ref_model, self.old_model, self.device, self.distributed)

    def forward_backward(
        self, sequences: list[ScoredSequence], counts: tuple[int, int] | None = None
    ) -> StepStats:
        """Gradients of `sequences` (this rank's share); `counts` = (trainable tokens, trainable
        sequences) of the whole batch over all ranks, the loss normaliser (this share's when None)."""
        self.optimizer.zero_grad(set_to_none=True)
        return stages.forward_backward(
            self.models,
            self.config,
            self.history,
            sequences,
            self.state.weight_version,
            counts or trainable_counts(sequences),
        )

    def optimizer_step(self, trainable_tokens: int) -> stages.OptimizerResult:
        return stages.optimizer_step(
            self.model, self.optimizer, self.scheduler, self.config.grad_clip, trainable_tokens
        )

    def update(
        self, sequences: list[ScoredSequence], counts: tuple[int, int] | None = None
    ) -> tuple[StepStats, stages.OptimizerResult]:
        """forward_backward then optimizer_step, without the queue (tests and benches)."""
        counts = counts or trainable_counts(sequences)
        stats = self.forward_backward(sequences, counts)
        return stats, self.optimizer_step(counts[0])

    def full_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every (name, full tensor): gathered from the shards (a collective) when there are several."""
        return full_weights(self.model, self.config.bucket_bytes, self.announce_gather)

    @property
    def _speed(self) -> SpeedInputs:
        return SpeedInputs(
            self.device,
            compute_precision(self.config.precision, self.config.dtype),
            self.flops_per_token,
            self.world_size,
            self.ref_model is not None,
        )

    # ---- publish / checkpoint --------------------------------------------------------------------
    def _publish(self) -> None:
        """Publish the current weights as the next version; a failed transfer is retried with
        backoff (`trainer.publish_attempts`), then PublishError ends the run. The full weights are
        gathered once and recorded in the history (one host copy) before they are sent, so that
        the sender's catch-up can serve the version as soon as it is committed."""
        named = self.full_weights()
        planned = self.state.published_version + 1
        self._record_history(planned, named)
        result = self.publisher.publish_retrying(
            lambda: named,
            planned,
            self.config.publish_attempts,
            self.config.publish_backoff_s,
            links_from=self._step_traceparents,
        )
        version = result.version
        if version != planned:  # a retry took a higher number: the same weights under it
            self._record_history(version, named)
        self._step_traceparents = []
        atomic_write_text(self.run_dir / PUBLISHED_VERSION_FILE, str(version))
        with self.lock:
            self.state.published_version = version
            self.state.weight_version = version
            self.last_metrics["publish_s"] = result.seconds
        self._unpublished_steps = 0
        self.telemetry.set_gauge("weight_version", version)
        self.telemetry.set_gauge("publish_s", result.seconds)

    def _record_history(self, version: int, named) -> None:
        if self._history_wanted:
            self.history.record(version, named)

    def _checkpoint_if_requested(self) -> None:
        if self.checkpoint_requested.is_set():
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Save everything; then raise the stream's replay floor to what the checkpoint covers."""
        self.checkpoint_requested.clear()
        floor = self.queue.consumed_floor()
        with self.lock:
            self.state.replay_floor = floor
            self._bound_dedupe(floor)
        path = self.store.save(self.model, self.optimizer, self.state, self.scheduler)
        self.queue.set_replay_floor(floor)
        self._checkpointed = (self.state.step, self.state.weight_version)
        log.info(
            "checkpoint %s (step %d, version %d, floor %s)",
            path.name,
            self.state.step,
            self.state.weight_version,
            floor,
        )
        return path

    def _release_consumed(self) -> None:
        """Without periodic checkpoints (`checkpoint_every 0`) a restart begins again from the
        initial weights, where entries of later versions are dropped as lost: nothing acknowledged
        is worth keeping for a replay. The replay floor follows what is consumed, step by step, so
        the stream is trimmed at `stream_maxlen` (with the floor left at the start it grew for the
        whole run), and the dedupe memory is bounded as at a checkpoint."""
        floor = self.queue.consumed_floor()
        with self.lock:
            self._bound_dedupe(floor)
        self.queue.set_replay_floor(floor)

    def _bound_dedupe(self, floor: str) -> None:
        self.applied_entries = bound_dedupe(self.applied_entries, floor, self.config.dedupe_window)
        self.applied_ids.intersection_update(self.applied_entries)  # the consumer shares this set
        self.state.applied_rollout_ids = list(self.applied_entries)
        self.state.applied_rollout_entries = list(self.applied_entries.values())

    def await_workers(self) -> int:
        """After the last step: keep serving catch-ups until `await_workers` rollout workers hold the
        final version, or its timeout passes (logged). A resumed trainer can train its last steps
        from rollouts already in the stream while the rollout services are still loading; only this
        process can send them the final weights. Returns how many held it."""
        cfg, version = self.config, self.state.weight_version
        if not cfg.broadcast_address:  # local mode: no workers to wait for
            return 0
        start = time.monotonic()
        held = self.publisher.wait_workers_at(
            version, cfg.await_workers, cfg.await_workers_timeout_s, self.stop_event.is_set
        )
        took = time.monotonic() - start
        if held < cfg.await_workers:
            log.warning(
                "%d of %d rollout workers hold the final version %d after %.0fs; exiting without the rest",
                held,
                cfg.await_workers,
                version,
                took,
            )
        else:
            log.info("%d rollout worker(s) hold the final version %d (waited %.1fs)", held, version, took)
        return held

    def serve_finished(self) -> None:
        """`trainer.after_last_step serve`: after the last step, wait for a stop while the publisher's
        catch-up thread goes on sending the final version to rollout workers that restart."""
        self.stop_event.wait()

    def close(self) -> None:
        self.publisher.close()
        self.queue.close()
