"""The training loop: consume -> score -> objective -> step -> ack -> metrics -> publish -> checkpoint.

One iteration, and why in this order:

    batch   = consumer.collect(groups_per_step)          # XREADGROUP/XAUTOCLAIM; dedupe; max_lag
    loss    = Σ_microbatches objective(policy(batch))    # fp32 head, each rollout's transform
    optimizer.step()                                     # the update is applied ...
    queue.ack(batch entries)                             # ... and only then acknowledged
    telemetry.record(metrics, trained rollout ids)
    every publish_every steps: publish(version + 1)      # version += 1 only if it succeeded
    every checkpoint_every steps / on request / at the end: checkpoint, then set replay floor

A step whose gradient norm is not finite takes no optimizer step. Its rollouts are acknowledged but
dropped, not trained: they go to skipped_rollouts.jsonl (never to trained_rollouts.jsonl or the
dedupe set) and are counted (skipped_nonfinite, skipped_nonfinite_steps_total,
rollouts_skipped_nonfinite in metrics.jsonl). They are not re-trained, because the same batch would
most likely give the same gradient again. `max_nonfinite_steps` such steps in a row stop the run
(NonFiniteStepsError, exit 1).

Crash safety: a checkpoint holds the weights, optimizer, version, the rollout ids in those weights
and the stream *replay floor* (every entry below it is reflected in them). On restart the group is
rewound to the floor: entries acknowledged after the checkpoint are delivered again, and those
already in the checkpoint are recognised by rollout id and skipped. Versions continue above the
highest version ever published (checkpoint, local record, broadcast's latest); if that is above the
checkpoint's version, or the broadcast service holds less than it (a restarted service, as after
`parity run --resume`), the restored weights are re-published at once as the next number, so that
rollout workers stop sampling from weights the trainer no longer has and catch up to the
checkpoint's weights before they generate. The versions between the checkpoint's and the highest
published are *lost*: rollouts sampled from them are dropped and counted (dropped_future_version).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity import mismatch, tracing
from parity.config import ParityConfig
from parity.rollout_queue import MIN_ID, RolloutQueue
from parity.sampling import SamplingTransform
from trainer import fsdp, objectives, offpolicy
from trainer import precision as numerics
from trainer.checkpoint import CheckpointStore, TrainerState, atomic_write_text
from trainer.consumer import Batch, RolloutConsumer, token_context_versions, token_versions
from trainer.device import peak_flops, peak_memory_bytes, reset_peak_memory, resolve_device, to_device
from trainer.flat_params import flatten_parameters
from trainer.freeze import freeze_parameters
from trainer.mismatch_gate import MismatchGate
from trainer.policy import (
    SequenceInput,
    load_model,
    scorer_for,
    token_budget_batches,
    token_logprobs,
)
from trainer.publisher import Publisher
from trainer.telemetry import Telemetry

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PUBLISHED_VERSION_FILE = "published_version"
SKIPPED_ROLLOUTS_FILE = "skipped_rollouts.jsonl"  # rollouts of steps skipped for a non-finite gradient
SAMPLES_PER_STEP = 4  # completions per step written to samples.jsonl (run trackers show them)


class NonFiniteStepsError(RuntimeError):
    """`trainer.max_nonfinite_steps` steps in a row had a non-finite gradient: training stops."""


@dataclass
class ScoredSequence:
    """One rollout prepared for the step."""

    inputs: SequenceInput
    rollout_logprobs: list[float]
    versions: list[int]
    advantage: float
    trainable: bool
    contexts: list[int] = field(default_factory=list)  # per token, the oldest KV version it attended to
    group_index: int = 0


@dataclass
class StepTotals:
    """What one step's micro-batches gather for its metrics: running sums, and per-token tensors
    (CPU, one per micro-batch, in sequence order; `cat` joins them)."""

    trainable_tokens: int
    trainable_seqs: int
    loss: float = 0.0
    # Per micro-batch counts of trainable tokens the trainer's mask excludes (zero loss).
    nonfinite_counts: list[torch.Tensor] = field(default_factory=list)
    # Tokens through the policy's forward+backward and through forward-only passes (for MFU).
    train_forward_tokens: int = 0
    eval_forward_tokens: int = 0
    trainer_logprobs: list[torch.Tensor] = field(default_factory=list)
    rollout_logprobs: list[torch.Tensor] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)
    clean: list[bool] = field(default_factory=list)  # per token: its context is its own version
    entropy: list[torch.Tensor] = field(default_factory=list)
    clip: list[torch.Tensor] = field(default_factory=list)  # per token (per sequence for GSPO)
    kl_new_old: list[torch.Tensor] = field(default_factory=list)
    is_weights: list[torch.Tensor] = field(default_factory=list)
    is_corrected: list[torch.Tensor] = field(default_factory=list)
    kl_ref: list[torch.Tensor] = field(default_factory=list)
    # Trainer vs rollout logprobs at each token's own version (only with old_logprobs=recompute).
    at_version_trainer_logprobs: list[torch.Tensor] = field(default_factory=list)
    at_version_rollout_logprobs: list[torch.Tensor] = field(default_factory=list)

    @staticmethod
    def cat(chunks: list[torch.Tensor]) -> torch.Tensor:
        """One host tensor (the chunks may live on the device: one copy per metric per step)."""
        import torch

        return torch.cat(chunks).cpu() if chunks else torch.zeros(0)


class Trainer:
    """Owns the model, optimizer, queue consumer, publisher and checkpoints of one run."""

    def __init__(self, run_config: ParityConfig) -> None:
        self.config = config = run_config.trainer
        self.schedule = run_config.run  # seed, steps, groups_per_step, max_lag, publish_every, stream
        check = run_config.check
        self.gate = MismatchGate(check.threshold, check.gate_steps, check.on_mismatch)
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
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._checkpointed: tuple[int, int] | None = None
        self.in_step = False  # between taking a batch and finishing its publish

    # ---- setup -----------------------------------------------------------------------------------
    def setup_model(self) -> None:
        """Device, model (sharded when world_size > 1), optimizer, scheduler; no queue, no publisher."""
        import torch

        from parity import models
        from trainer import fsdp

        cfg, schedule = self.config, self.schedule
        torch.manual_seed(schedule.seed)
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        numerics.disable_tf32()
        self.device = resolve_device(cfg.device)
        self.rank, self.world_size = fsdp.world()
        self.distributed = self.world_size > 1
        if self.distributed:
            fsdp.init_process_group(self.device, cfg.dist_timeout_s)
        self.model_dir = models.resolve(self.model_name)
        self.model = load_model(self.model_dir, cfg.dtype, self.device, packing=cfg.packing)
        freeze_parameters(self.model, cfg.freeze)
        if cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.distributed:  # publishing then sends the parameters with no packing copy
            flatten_parameters(self.model)
        self.scorer = scorer_for(self.model, cfg.precision)
        if self.distributed:
            fsdp.shard_scorer(self.scorer, cfg.precision)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.999),
            eps=1e-8,
        )
        warmup = cfg.lr_warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.ref_model = self._frozen_copy() if cfg.kl_coef > 0 else None
        # The weights of past versions: the PPO old policy (old_logprobs=recompute) and the
        # own-version backend mismatch (own_version_groups) both rescore tokens under them. On several
        # ranks only rank 0 rescores (it holds the whole batch), with an unsharded copy of its own.
        own_version = cfg.own_version_groups > 0 and self.rank == 0
        recompute = cfg.old_logprobs == "recompute"
        self.old_model = self._frozen_copy(shard=recompute) if recompute or own_version else None
        self.flops_per_token = fsdp_free_flops_per_token(self.model)

    def setup(self) -> None:
        cfg, schedule = self.config, self.schedule
        self.setup_model()
        self.store = CheckpointStore(
            self.run_dir, keep=cfg.keep_checkpoints, model_source=str(self.model_dir)
        )
        self.telemetry = Telemetry(self.run_dir)
        restored = self.store.load(self.model, self.optimizer, scheduler=self.scheduler)
        self.state = restored or TrainerState()
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
        self.publisher = Publisher(
            cfg.broadcast_address,
            self.model_name,
            auth_token=cfg.auth_token,
            bucket_bytes=cfg.bucket_bytes,
            wait_committed_s=cfg.wait_committed_s,
        )
        broadcast_latest = self.publisher.latest_version()
        published = max(self.state.published_version, self._read_published_file(), broadcast_latest)
        self.state.published_version = published
        if published > self.state.weight_version:  # published after the checkpoint: lost weights
            self.state.lost_versions.append([self.state.weight_version + 1, published])
        log.info(
            "trainer ready: step %d, version %d (highest published %d), floor %s, %d rollouts applied%s",
            self.state.step,
            self.state.weight_version,
            published,
            self.state.replay_floor,
            len(self.applied_ids),
            " (restored)" if restored else "",
        )
        reseed = bool(cfg.broadcast_address) and broadcast_latest < self.state.weight_version
        if published > self.state.weight_version or reseed:
            log.warning(
                "resuming at version %d (highest published %d, broadcast holds %d): re-publishing the "
                "restored weights; rollouts of versions %s are dropped",
                self.state.weight_version,
                published,
                broadcast_latest,
                self.state.lost_versions or "none",
            )
            self._publish()
        self._snapshot_current()
        self.ready = True

    def _frozen_copy(self, shard: bool = True):
        copy = load_model(self.model_dir, self.config.dtype, self.device, packing=self.config.packing)
        copy.eval()
        for param in copy.parameters():
            param.requires_grad_(False)
        scorer = scorer_for(copy, self.config.precision)
        if self.distributed and shard:
            from trainer import fsdp

            fsdp.shard_scorer(scorer, self.config.precision)
        return scorer

    def _read_published_file(self) -> int:
        path = self.run_dir / PUBLISHED_VERSION_FILE
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return 0

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
        """One optimizer step on `batch`; acks its entries; records metrics."""

        start = time.perf_counter()
        version = self.state.weight_version
        sequences, rewards, zero_groups = self._prepare(batch)
        with tracing.span(
            "train_step",
            {
                tracing.ATTR_WEIGHT_VERSION: version,
                tracing.ATTR_STEP: self.state.step + 1,
                tracing.ATTR_TOKENS: sum(len(s.rollout_logprobs) for s in sequences),
                "parity.groups": len(batch.groups),
            },
            links_from=batch.traceparents,
        ) as span:
            self._step_traceparents.append(tracing.current_traceparent())
            reset_peak_memory(self.device)
            totals, grad_norm, stepped = self.local_update(sequences)
            # A non-finite gradient skips the optimizer step: the batch is dropped, not trained.
            nonfinite = totals.trainable_tokens > 0 and not math.isfinite(grad_norm)
            own_version = self._score_own_version(sequences)
            self._unpublished_steps += int(stepped)
            self.queue.ack(batch.all_entry_ids())
            step_time_s = time.perf_counter() - start
            metrics = self._metrics(batch, sequences, rewards, zero_groups, totals, grad_norm, step_time_s)
            metrics.update(self._speed_metrics(totals, step_time_s))
            metrics.update(self._own_version_metrics(totals, own_version))
            span.set_attribute(tracing.ATTR_LAG, metrics["lag_max"])
            span.set_attribute("parity.lag_mean", metrics["lag_mean"])
            span.set_attribute("parity.mismatch_k3", metrics["mismatch_k3"])
        trained_ids, skipped_ids = ([], batch.rollout_ids()) if nonfinite else (batch.rollout_ids(), [])
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if nonfinite else 0
        with self.lock:
            self.state.step += 1
            metrics["step"] = self.state.step
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
            self.state.zero_variance_groups_total += zero_groups
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
            samples=step_samples(batch, version, metrics["step"]),
        )
        log.info(
            "step %d v%d: reward %.3f, loss %.4f, k3(own version) %.2e, lag %.2f, %d tok in %.2fs (%.0f tok/s)",
            metrics["step"],
            version,
            metrics["reward_mean"],
            metrics["loss"],
            metrics.get("mismatch_k3_own_version", math.nan),
            metrics["lag_mean"],
            metrics["num_tokens"],
            step_time_s,
            metrics["tokens_per_s"],
        )
        if nonfinite:
            self._record_skipped(metrics["step"], skipped_ids, grad_norm)
        # After the step is recorded: with on_mismatch=stop this raises MismatchGateError, which ends
        # the run with the gate's message (the step's rollouts are trained and accounted for).
        self.gate.observe(metrics["step"], metrics)
        return metrics

    def _record_skipped(self, step: int, rollout_ids: list[str], grad_norm: float) -> None:
        """A step whose gradient was not finite: its rollouts go to skipped_rollouts.jsonl (acked,
        never trained, not in the lineage); `max_nonfinite_steps` of them in a row stop the run."""
        with open(self.run_dir / SKIPPED_ROLLOUTS_FILE, "a") as handle:
            handle.write(
                json.dumps({"step": step, "reason": "nonfinite_gradient", "rollout_ids": rollout_ids}) + "\n"
            )
        limit = self.config.max_nonfinite_steps
        log.warning(
            "step %d skipped: gradient norm %s; its %d rollouts are dropped (%d in a row, limit %d)",
            step,
            grad_norm,
            len(rollout_ids),
            self._nonfinite_in_a_row,
            limit,
        )
        if self._nonfinite_in_a_row >= limit:
            raise NonFiniteStepsError(
                f"{self._nonfinite_in_a_row} steps in a row (up to step {step}) had a non-finite gradient "
                f"norm (trainer.max_nonfinite_steps={limit}); stopping. Their rollouts are in "
                f"{self.run_dir / SKIPPED_ROLLOUTS_FILE}; the weights are those of the last finite step."
            )

    # ---- the step's pieces -----------------------------------------------------------------------
    def local_update(
        self, sequences: list[ScoredSequence], global_counts: tuple[int, int] | None = None
    ) -> tuple[StepTotals, float, bool]:
        """Gradients of this rank's `sequences`, clip, AdamW + scheduler step: (totals, grad norm,
        whether the optimizer stepped). `global_counts` = (trainable tokens, trainable sequences)
        of the whole batch over all ranks (the loss normaliser); this rank's own counts when None."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        totals = self._micro_batches(sequences, global_counts)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
        stepped = totals.trainable_tokens > 0 and math.isfinite(grad_norm)
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return totals, grad_norm, stepped

    def _prepare(self, batch: Batch) -> tuple[list[ScoredSequence], list[float], int]:
        import torch

        cfg = self.config
        sequences: list[ScoredSequence] = []
        rewards: list[float] = []
        zero_groups = 0
        for group_index, group in enumerate(batch.groups):
            group_rewards = torch.tensor([[s.reward for s in group.samples]], dtype=torch.float64)
            adv = objectives.group_advantages(group_rewards, normalise_std=cfg.objective != "ppo")
            zero = bool(adv.zero_variance_G[0])
            zero_groups += int(zero)
            transform = SamplingTransform.from_proto(group.sampling)
            prompt = tuple(int(t) for t in group.prompt_token_ids)
            for sample, advantage in zip(group.samples, adv.values_GN[0].tolist(), strict=True):
                rewards.append(float(sample.reward))
                if not sample.token_ids:
                    continue
                sequences.append(
                    ScoredSequence(
                        inputs=SequenceInput(prompt, tuple(int(t) for t in sample.token_ids), transform),
                        rollout_logprobs=list(sample.logprobs),
                        versions=token_versions(group, sample),
                        advantage=float(advantage),
                        trainable=not zero or cfg.kl_coef > 0,
                        contexts=token_context_versions(group, sample),
                        group_index=group_index,
                    )
                )
        return sequences, rewards, zero_groups

    def _micro_batches(
        self, sequences: list[ScoredSequence], global_counts: tuple[int, int] | None = None
    ) -> StepTotals:
        """Forward/backward every trainable micro-batch, forward-only the rest; gather metric inputs."""
        import torch

        trainable = [s for s in sequences if s.trainable]
        frozen = [s for s in sequences if not s.trainable]
        tokens, seqs = global_counts or (sum(len(s.rollout_logprobs) for s in trainable), len(trainable))
        totals = StepTotals(trainable_tokens=tokens, trainable_seqs=seqs)
        losses = []
        for chunk in self._split(trainable):
            if not chunk:  # another rank has more micro-batches: join its collectives, add nothing
                fsdp.idle_micro_batch(self.scorer, self.ref_model, train=True)
                continue
            totals.train_forward_tokens += sum(
                len(s.inputs.prompt_ids) + len(s.rollout_logprobs) for s in chunk
            )
            loss = self._micro_batch_loss(chunk, totals)
            if loss.requires_grad:
                loss.backward()
            losses.append(loss.detach())
        totals.loss = float(torch.stack(losses).sum()) if losses else math.nan  # nothing trained
        with torch.no_grad():
            for chunk in self._split(frozen):
                if not chunk:
                    fsdp.idle_micro_batch(self.scorer, self.ref_model, train=False)
                    continue
                totals.eval_forward_tokens += sum(
                    len(s.inputs.prompt_ids) + len(s.rollout_logprobs) for s in chunk
                )
                new_T, entropy_T = token_logprobs(self.scorer, [s.inputs for s in chunk])
                self._collect_metric_inputs(chunk, new_T, entropy_T, totals)
        if self.distributed:  # else the clip would miss the root group's gradients (fsdp.reshard_all)
            fsdp.reshard_all(self.scorer)
        return totals

    def _split(self, sequences: list[ScoredSequence]) -> list[list[ScoredSequence]]:
        cfg = self.config
        chunks = token_budget_batches(
            sequences, lambda s: s.inputs, cfg.micro_batch_size, cfg.micro_batch_tokens, packed=cfg.packing
        )
        # Ranks of a sharded model run equally many micro-batches (empty ones idle).
        return fsdp.align_micro_batches(chunks, self.device) if self.distributed else chunks

    def _collect_metric_inputs(self, chunk, new_T, entropy_T, totals: StepTotals):
        """Record the chunk's per-token metric inputs; returns its rollout logprobs [T]."""
        import torch

        rollout_T = torch.tensor([lp for s in chunk for lp in s.rollout_logprobs], dtype=torch.float32)
        rollout_T = to_device(rollout_T, self.device)
        totals.trainer_logprobs.append(new_T.detach().float())
        totals.rollout_logprobs.append(rollout_T)
        totals.entropy.append(entropy_T.detach())
        version = self.state.weight_version
        totals.lags.extend(lag for s in chunk for lag in offpolicy.token_lags(version, s.versions))
        totals.clean.extend(c == v for s in chunk for v, c in zip(s.versions, s.contexts, strict=True))
        return rollout_T

    def _micro_batch_loss(self, chunk: list[ScoredSequence], totals: StepTotals):
        import torch

        cfg = self.config
        total_tokens, total_seqs = totals.trainable_tokens, totals.trainable_seqs
        new_T, entropy_T = token_logprobs(self.scorer, [s.inputs for s in chunk])
        behaviour_T = self._collect_metric_inputs(chunk, new_T, entropy_T, totals)
        lengths = [len(s.rollout_logprobs) for s in chunk]
        seq_lengths_S = to_device(torch.tensor(lengths), self.device)
        seq_index_T = torch.repeat_interleave(torch.arange(len(chunk), device=self.device), seq_lengths_S)
        finite_T = torch.isfinite(new_T.detach())
        totals.nonfinite_counts.append((~finite_T).sum())
        # A token the trainer's mask excludes (-inf) cannot be trained on; it gets zero loss.
        new_safe_T = torch.where(finite_T, new_T, behaviour_T)
        if cfg.old_logprobs == "recompute":
            old_T, known_T = self._recompute_old(chunk, behaviour_T)
            # Backend mismatch on every token, stale or not: trainer vs rollout at the same weights.
            totals.at_version_trainer_logprobs.append(old_T[known_T].float())
            totals.at_version_rollout_logprobs.append(behaviour_T[known_T].float())
        elif cfg.is_correction != "none":
            old_T = new_safe_T.detach()  # decoupled PPO: the proximal policy is the current one
        else:
            old_T = behaviour_T
        weights_T, corrected_T = offpolicy.is_weights(
            old_T, behaviour_T, seq_index_T, len(chunk), cfg.is_correction, cfg.is_level, cfg.is_cap
        )
        totals.is_weights.append(weights_T)
        totals.is_corrected.append(corrected_T)
        totals.kl_new_old.append(objectives.kl_k3(new_safe_T.detach(), old_T).masked_fill(~finite_T, 0.0))
        adv_S = to_device(torch.tensor([s.advantage for s in chunk], dtype=torch.float32), self.device)
        eps_low, eps_high = cfg.clip_range()
        if cfg.objective == "gspo":
            loss_S, clip_S = objectives.gspo_sequence_loss(
                new_safe_T, old_T, adv_S, seq_index_T, len(chunk), eps_low, eps_high
            )
            w_S = objectives.segment_mean(weights_T, seq_index_T, len(chunk))
            loss = objectives.aggregate_sequences(
                loss_S * w_S, seq_lengths_S, cfg.loss_agg, total_tokens, total_seqs
            )
            totals.clip.append(clip_S)
        else:
            loss_T, clip_T = objectives.ppo_clip_token_loss(
                new_safe_T, old_T, adv_S[seq_index_T], eps_low, eps_high
            )
            loss_T = torch.where(finite_T, loss_T * weights_T, torch.zeros_like(loss_T))
            loss = objectives.aggregate(
                loss_T, seq_index_T, seq_lengths_S, cfg.loss_agg, total_tokens, total_seqs
            )
            totals.clip.append(clip_T)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_T, _ = token_logprobs(self.ref_model, [s.inputs for s in chunk], with_entropy=False)
            kl_T = torch.where(finite_T, objectives.kl_k3(new_safe_T, ref_T), torch.zeros_like(new_safe_T))
            totals.kl_ref.append(kl_T.detach())
            loss = loss + cfg.kl_coef * objectives.aggregate(
                kl_T, seq_index_T, seq_lengths_S, cfg.loss_agg, total_tokens, total_seqs
            )
        return loss

    # ---- old-policy recompute (optional) ---------------------------------------------------------
    def _snapshot_current(self) -> None:
        if self.old_model is None:
            return
        # On an accelerator the snapshots live in host memory (one copy back per use).
        host = self.device.type != "cpu"
        if self.distributed:
            # Rank 0 of several: the full weights, all-gathered bucket by bucket (announced to the
            # other ranks as GATHER, like a publish); one bucket of full tensors on the device at once.
            from trainer.policy import weight_buckets

            buckets = weight_buckets(self.model, self.config.bucket_bytes)
            named = ((name, tensor) for bucket in buckets for name, _, _, tensor in bucket)
        else:
            named = ((name, p.detach()) for name, p in self.model.named_parameters())
        self._snapshots[self.state.weight_version] = {
            name: (tensor.to("cpu", copy=True) if host else tensor.clone()) for name, tensor in named
        }
        for old in sorted(self._snapshots)[: max(0, len(self._snapshots) - (self.schedule.max_lag + 1))]:
            del self._snapshots[old]

    def _recompute_old(self, chunk: list[ScoredSequence], behaviour_T):
        """(Trainer logprobs at each token's own version, mask of tokens whose version is kept).

        Tokens whose version has no snapshot keep their behaviour logprobs and are outside the mask.
        """
        import torch

        versions = [v for s in chunk for v in s.versions]
        versions_T = to_device(torch.tensor(versions), self.device)
        old_T = behaviour_T.clone()
        known_T = torch.zeros_like(versions_T, dtype=torch.bool)
        params = dict(self.old_model.lm.named_parameters())
        with torch.no_grad():
            for version in sorted(set(versions)):
                snapshot = self._snapshots.get(version)
                if snapshot is None:
                    continue
                for name, tensor in snapshot.items():
                    params[name].copy_(tensor)
                lp_T, _ = token_logprobs(self.old_model, [s.inputs for s in chunk], with_entropy=False)
                use_T = versions_T == version
                old_T[use_T] = lp_T[use_T]
                known_T |= use_T
        return old_T, known_T

    # ---- backend mismatch at each token's own version --------------------------------------------
    def _score_own_version(self, sequences: list[ScoredSequence]) -> dict[str, Any] | None:
        """Rescore the first `own_version_groups` groups that hold clean stale tokens under the
        weights that sampled them. Lag-0 tokens need no rescoring (the step's forward already is at
        their version); mixed-context tokens are excluded (their KV came from older weights, which
        the trainer does not replay). Returns the sample's (trainer, rollout) logprobs and cost."""
        import torch

        cfg = self.config
        if cfg.own_version_groups == 0 or self.old_model is None:
            return None
        start = time.perf_counter()
        current = self.state.weight_version
        by_group: dict[int, list[ScoredSequence]] = {}
        for seq in sequences:
            if any(
                v != current and c == v and v in self._snapshots
                for v, c in zip(seq.versions, seq.contexts, strict=True)
            ):
                by_group.setdefault(seq.group_index, []).append(seq)
        chosen = [s for g in sorted(by_group)[: cfg.own_version_groups] for s in by_group[g]]
        if not chosen:
            return {
                "trainer": torch.zeros(0),
                "rollout": torch.zeros(0),
                "seconds": time.perf_counter() - start,
            }
        rollout_T = to_device(
            torch.tensor([lp for s in chosen for lp in s.rollout_logprobs], dtype=torch.float32), self.device
        )
        with torch.no_grad():
            scored_T, known_T = self._recompute_old(chosen, rollout_T)
        stale_clean_T = to_device(
            torch.tensor(
                [v != current and c == v for s in chosen for v, c in zip(s.versions, s.contexts, strict=True)]
            ),
            self.device,
        )
        use_T = known_T & stale_clean_T
        return {
            "trainer": scored_T[use_T].float().cpu(),
            "rollout": rollout_T[use_T].float().cpu(),
            "seconds": time.perf_counter() - start,
        }

    def _own_version_metrics(self, totals: StepTotals, own_version: dict[str, Any] | None) -> dict[str, Any]:
        """mismatch_*_own_version over every clean lag-0 token plus the rescored sample, and the
        mixed-context lag-0 tokens as their own class. Absent when own-version scoring is off."""
        import torch

        cat = StepTotals.cat
        trainer_T, rollout_T = cat(totals.trainer_logprobs), cat(totals.rollout_logprobs)
        lag0_T = torch.tensor(totals.lags, dtype=torch.long) == 0
        clean_T = torch.tensor(totals.clean, dtype=torch.bool)
        metrics: dict[str, Any] = {}
        mixed = mismatch.mismatch_stats(trainer_T[lag0_T & ~clean_T], rollout_T[lag0_T & ~clean_T])
        for key in ("k1", "k3", "max_abs"):
            metrics[f"mismatch_{key}_mixed_context"] = getattr(mixed, key)
        metrics["mixed_context_tokens"] = int((lag0_T & ~clean_T).sum())
        if own_version is None:
            return metrics
        own_trainer_T = torch.cat([trainer_T[lag0_T & clean_T], own_version["trainer"]])
        own_rollout_T = torch.cat([rollout_T[lag0_T & clean_T], own_version["rollout"]])
        own = mismatch.mismatch_stats(own_trainer_T, own_rollout_T)
        for key in ("k1", "k2", "k3", "max_abs", "ratio_p05", "ratio_p50", "ratio_p95", "nonfinite_tokens"):
            metrics[f"mismatch_{key}_own_version"] = getattr(own, key)
        metrics["own_version_tokens"] = int(own_trainer_T.numel())
        metrics["own_version_rescored_tokens"] = int(own_version["trainer"].numel())
        metrics["own_version_score_s"] = own_version["seconds"]
        return metrics

    # ---- metrics ---------------------------------------------------------------------------------
    def _metrics(
        self,
        batch: Batch,
        sequences: list[ScoredSequence],
        rewards: list[float],
        zero_groups: int,
        totals: StepTotals,
        grad_norm: float,
        step_time_s: float,
    ) -> dict[str, Any]:
        import torch

        cat = StepTotals.cat
        trainer_T, rollout_T = cat(totals.trainer_logprobs), cat(totals.rollout_logprobs)
        lags_T = torch.tensor(totals.lags, dtype=torch.long)
        # Backend mismatch needs a clean token: sampled at the current version over KV of that
        # version. Policy drift is every token against the current weights, stale ones included.
        lag0_T = lags_T == 0
        clean_lag0_T = lag0_T & torch.tensor(totals.clean, dtype=torch.bool)
        on_lag0 = mismatch.mismatch_stats(trainer_T[clean_lag0_T], rollout_T[clean_lag0_T])
        on_all = mismatch.mismatch_stats(trainer_T, rollout_T)
        nan = math.nan  # a metric with nothing to measure is NaN (null in metrics.jsonl), never 0
        rewards_t = torch.tensor(rewards, dtype=torch.float64)
        num_tokens = int(trainer_T.numel())
        is_w, is_corr, clip = cat(totals.is_weights), cat(totals.is_corrected), cat(totals.clip)
        entropy, kl_new_old, kl_ref = cat(totals.entropy), cat(totals.kl_new_old), cat(totals.kl_ref)
        metrics: dict[str, Any] = {
            "step": self.state.step + 1,
            "weight_version": self.state.weight_version,
            "reward_mean": float(rewards_t.mean()) if rewards else nan,
            "reward_std": float(rewards_t.std(unbiased=False)) if rewards else nan,
            "clip_rate": float(clip.float().mean()) if clip.numel() else nan,
            "kl_new_old": float(kl_new_old.mean()) if kl_new_old.numel() else nan,
            "entropy": float(entropy.mean()) if entropy.numel() else nan,
        }
        # Statistics over the tokens with finite logprobs (NaN when there are none); the others are
        # counted in mismatch_nonfinite_tokens*.
        for prefix, stats in (("mismatch_", on_lag0), ("policy_drift_", on_all)):
            for key in (
                "k1",
                "k2",
                "k3",
                "max_abs",
                "ratio_p05",
                "ratio_p50",
                "ratio_p95",
                "nonfinite_tokens",
            ):
                metrics[f"{prefix}{key}"] = getattr(stats, key)
        if totals.at_version_trainer_logprobs:  # only with --old_logprobs recompute
            at_version_T = cat(totals.at_version_trainer_logprobs)
            on_version = mismatch.mismatch_stats(at_version_T, cat(totals.at_version_rollout_logprobs))
            for key in ("k1", "k2", "k3", "max_abs", "nonfinite_tokens"):
                metrics[f"mismatch_{key}_at_version"] = getattr(on_version, key)
            metrics["at_version_token_frac"] = at_version_T.numel() / max(1, num_tokens)
        metrics.update(
            {
                "ess": on_all.ess,
                "ess_lag0": on_lag0.ess,
                "lag_mean": float(lags_T.float().mean()) if lags_T.numel() else nan,
                "lag_max": int(lags_T.max()) if lags_T.numel() else nan,
                "lag_hist": offpolicy.lag_histogram(totals.lags),
                "lag0_token_frac": float(lag0_T.float().mean()) if lags_T.numel() else nan,
                # The tokens mismatch_* is measured over (clean lag-0); 0 means mismatch_* is NaN.
                "mismatch_tokens": int(clean_lag0_T.sum()),
                "dropped_stale": batch.dropped_stale,
                "dropped_stale_total": self.state.dropped_stale_total + batch.dropped_stale,
                "dropped_future_version": batch.dropped_future_version,
                "dropped_future_version_total": self.state.dropped_future_version_total
                + batch.dropped_future_version,
                "duplicates_skipped": batch.duplicates,
                "malformed": batch.malformed,
                "zero_variance_groups": zero_groups,
                "num_groups": len(batch.groups),
                "num_sequences": len(sequences),
                "num_tokens": num_tokens,
                "trainable_tokens": totals.trainable_tokens,
                "trainer_nonfinite_tokens": int(sum(int(c) for c in totals.nonfinite_counts)),
                "loss": totals.loss,
                "grad_norm": grad_norm,
                "lr": float(self.scheduler.get_last_lr()[0]),
                "is_weight_mean": float(is_w.mean()) if is_w.numel() else nan,
                "is_corrected_frac": float(is_corr.mean()) if is_corr.numel() else nan,
                "kl_ref": float(kl_ref.mean()) if kl_ref.numel() else nan,
                "queue_wait_s": batch.wait_s,
                "step_time_s": step_time_s,
                "tokens_per_s": num_tokens / step_time_s if step_time_s > 0 else nan,
            }
        )
        return metrics

    def _speed_metrics(self, totals: StepTotals, step_time_s: float) -> dict[str, Any]:
        """Peak memory of the step (CUDA allocator peak; on CPU the process's peak RSS) and MFU:
        model FLOPs (6N per trained token, 2N per forward-only token, 2N per reference-model token)
        over step time x the device's dense peak x ranks. MFU is absent when the peak is unknown."""
        out: dict[str, Any] = {"peak_memory_gib": peak_memory_bytes(self.device) / 2**30}
        peak = peak_flops(self.device, self.config.precision)
        if peak is not None and step_time_s > 0:
            forward_only = totals.eval_forward_tokens
            if self.ref_model is not None:
                forward_only += totals.train_forward_tokens
            flops = self.flops_per_token * (totals.train_forward_tokens + forward_only / 3)
            out["mfu"] = flops / (step_time_s * peak * self.world_size)
        return out

    # ---- publish / checkpoint --------------------------------------------------------------------
    def _publish(self) -> None:
        """Publish the current weights as the next version; a failed transfer is retried with
        backoff (`trainer.publish_attempts`), then PublishError ends the run."""
        result = self.publisher.publish_retrying(
            self.model,
            self.state.published_version + 1,
            self.config.publish_attempts,
            self.config.publish_backoff_s,
            links_from=self._step_traceparents,
        )
        version = result.version
        self._step_traceparents = []
        atomic_write_text(self.run_dir / PUBLISHED_VERSION_FILE, str(version))
        with self.lock:
            self.state.published_version = version
            self.state.weight_version = version
            self.last_metrics["publish_s"] = result.seconds
        self._unpublished_steps = 0
        self.telemetry.set_gauge("weight_version", version)
        self.telemetry.set_gauge("publish_s", result.seconds)
        self._snapshot_current()

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

    def _bound_dedupe(self, floor: str) -> None:
        """Keep the rollout ids a restart can still meet: those of entries at or above the replay
        floor (redelivered by the rewind) and the newest `dedupe_window` (a producer's late
        duplicate). Older ids are dropped from the checkpoint and from memory."""
        window = self.config.dedupe_window
        ordered = list(self.applied_entries.items())
        recent = {rid for rid, _ in ordered[max(0, len(ordered) - window) :]} if window else set()
        floor_key = stream_key(floor)
        kept = [(rid, e) for rid, e in ordered if rid in recent or stream_key(e) >= floor_key]
        self.applied_entries = dict(kept)
        self.applied_ids.intersection_update(self.applied_entries)  # the consumer shares this set
        self.state.applied_rollout_ids = [rid for rid, _ in kept]
        self.state.applied_rollout_entries = [e for _, e in kept]

    def close(self) -> None:
        self.publisher.close()
        self.queue.close()


def fsdp_free_flops_per_token(model) -> float:
    """Training FLOPs per token, 6 x parameters outside the input embedding (forward 2N, backward
    4N; attention's sequence-length term left out). Counted before sharding."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    non_embedding = total - embed.numel() + (embed.numel() if head is embed else 0)
    return 6.0 * non_embedding


def step_samples(batch: Batch, version: int, step: int, limit: int = SAMPLES_PER_STEP) -> list[dict]:
    """A few of the step's completions for run trackers: the first sample of the first `limit`
    groups, with its prompt, reward, newest token version and lag (trainer version - oldest token)."""
    out = []
    for group in batch.groups[:limit]:
        sample = group.samples[0]
        versions = token_versions(group, sample) or [int(group.min_weight_version)]
        out.append(
            {
                "step": step,
                "rollout_id": sample.rollout_id,
                "prompt": group.prompt_text,
                "completion": sample.text,
                "reward": float(sample.reward),
                "version": max(versions),
                "lag": version - min(versions),
            }
        )
    return out


def stream_key(entry_id: str) -> tuple[int, int]:
    """A Redis stream id "ms-seq" as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
