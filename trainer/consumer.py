"""Assembling one training step's batch from the rollout queue: dedupe, staleness, validation.

Invariants:
- A rollout id is trained at most once in the lineage of the weights: `applied_ids` (restored with
  the checkpoint) plus the ids already in the batch being built. An entry any of whose rollout ids
  is known is a duplicate: it is skipped and counted.
- An entry whose oldest token is more than `max_lag` versions behind the trainer is dropped whole
  and counted (`dropped_stale`). So are malformed entries.
- An entry with a token sampled from a *lost* version (published by a process of this run that
  died before checkpointing it: `lost_versions`) is dropped whole and counted
  (`dropped_future_version`): those weights are not in the lineage being trained. So is an entry
  with a token of a version above the trainer's own (a fresh trainer on a stream that holds an
  earlier run's groups): no weights of this lineage produced it.
- Skipped entries (all of the above) are acknowledged here, as soon as they are read. Held pending
  until the step, they would count in the actors' backlog (undelivered + pending): a trainer that
  drops a whole backlog (after `--resume`, where the stream holds versions it lost or outgrew)
  would then wait for new groups that the actors, at their backlog bound, never generate. Acking
  early loses nothing: a skip depends only on the trainer's state, and a restart rewinds the stream
  to the checkpoint's floor, which stays below every entry of the batch being built.
- Admitted entries are not acknowledged here: the caller acks `batch.all_entry_ids()` after the
  optimizer step (acking a skipped id again is a no-op).
- The same entry delivered twice while the batch is built (XAUTOCLAIM can return this consumer's
  own idle entries) is used once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from parity import tracing
from parity.rollout_queue import QueueEntry, RolloutQueue
from parity.v1 import rollouts_pb2
from trainer.offpolicy import entry_lag

log = logging.getLogger(__name__)


@dataclass
class Batch:
    groups: list[rollouts_pb2.RolloutGroup] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)
    skipped_entry_ids: list[str] = field(default_factory=list)
    traceparents: list[str] = field(default_factory=list)  # of the admitted groups' publish spans
    dropped_stale: int = 0
    dropped_future_version: int = 0
    duplicates: int = 0
    malformed: int = 0
    wait_s: float = 0.0

    def all_entry_ids(self) -> list[str]:
        return self.entry_ids + self.skipped_entry_ids

    def rollout_ids(self) -> list[str]:
        return [s.rollout_id for g in self.groups for s in g.samples]


def validate_group(group: rollouts_pb2.RolloutGroup) -> str:
    """'' when the group can be trained on, else what is wrong with it."""
    if not group.group_id:
        return "group_id is empty"
    if not group.samples:
        return "no samples"
    if not group.prompt_token_ids:
        return "prompt_token_ids is empty"
    for sample in group.samples:
        if not sample.rollout_id:
            return "a sample has no rollout_id"
        if not math.isfinite(sample.reward):  # its group's advantages would all be NaN
            return f"{sample.rollout_id}: reward {sample.reward} is not finite"
        if not all(math.isfinite(lp) for lp in sample.logprobs):  # a sampled token has a finite one
            return f"{sample.rollout_id}: a logprob is not finite"
        n = len(sample.token_ids)
        if sample.loss_mask:  # an episode: per-token fields cover the model's tokens only
            problem = _episode_problem(sample)
            if problem:
                return f"{sample.rollout_id}: {problem}"
            n = sum(sample.loss_mask)
        if len(sample.logprobs) != n:
            return f"{sample.rollout_id}: {len(sample.logprobs)} logprobs for {n} tokens"
        if sample.token_weight_versions and len(sample.token_weight_versions) != n:
            return f"{sample.rollout_id}: {len(sample.token_weight_versions)} versions for {n} tokens"
        if sample.token_context_versions and len(sample.token_context_versions) != n:
            return (
                f"{sample.rollout_id}: {len(sample.token_context_versions)} context versions for {n} tokens"
            )
    return ""


def _episode_problem(sample: rollouts_pb2.RolloutSample) -> str:
    if len(sample.loss_mask) != len(sample.token_ids):
        return f"{len(sample.loss_mask)} loss-mask entries for {len(sample.token_ids)} tokens"
    at = 0
    for turn in sample.turns:
        if turn.start != at or turn.end < turn.start:
            return f"turn [{turn.start}, {turn.end}) does not continue at token {at}"
        model = turn.role == rollouts_pb2.TURN_ROLE_MODEL
        if any(bool(m) != model for m in sample.loss_mask[turn.start : turn.end]):
            return f"the loss mask disagrees with turn [{turn.start}, {turn.end})'s role"
        at = turn.end
    if sample.turns and at != len(sample.token_ids):
        return f"the turns cover {at} of {len(sample.token_ids)} tokens"
    return ""


def model_token_count(sample: rollouts_pb2.RolloutSample) -> int:
    """Tokens the model sampled: all of them for a single completion, the masked ones in an episode."""
    return sum(sample.loss_mask) if sample.loss_mask else len(sample.token_ids)


def token_versions(group: rollouts_pb2.RolloutGroup, sample: rollouts_pb2.RolloutSample) -> list[int]:
    """One version per token; an entry without per-token versions counts as its oldest version."""
    if sample.token_weight_versions:
        return list(sample.token_weight_versions)
    return [int(group.min_weight_version)] * model_token_count(sample)


def token_context_versions(group: rollouts_pb2.RolloutGroup, sample: rollouts_pb2.RolloutSample) -> list[int]:
    """Per token, the oldest version of the KV it attended to; without the field, its own version."""
    if sample.token_context_versions:
        return list(sample.token_context_versions)
    return token_versions(group, sample)


def uses_lost_version(group: rollouts_pb2.RolloutGroup, lost_versions: list[list[int]]) -> bool:
    """Whether any token of `group` was sampled from a version in one of the [first, last] ranges."""
    lo, hi = int(group.min_weight_version), int(group.max_weight_version)
    overlapping = [(a, b) for a, b in lost_versions if a <= hi and lo <= b]
    if not overlapping:
        return False
    versions = {v for sample in group.samples for v in token_versions(group, sample)}
    return any(a <= v <= b for v in versions for a, b in overlapping)


class RolloutConsumer:
    """Builds batches of `groups_per_step` admitted groups."""

    def __init__(
        self,
        queue: RolloutQueue,
        consumer_name: str,
        applied_ids: set[str],
        claim_idle_ms: int = 30_000,
        block_ms: int = 500,
        lost_versions: list[list[int]] | None = None,
    ) -> None:
        self.queue = queue
        # [first, last] inclusive; the trainer's own list (it appends on restore)
        self.lost_versions = lost_versions if lost_versions is not None else []
        self.consumer_name = consumer_name
        self.applied_ids = applied_ids
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms

    def collect(
        self,
        groups_per_step: int,
        trainer_version: int,
        max_lag: int,
        should_stop: Callable[[], bool] = lambda: False,
        on_wait: Callable[[], None] = lambda: None,
    ) -> Batch | None:
        """Block until the batch is full; None if `should_stop()` turns true first.

        `on_wait` runs before every read (the trainer checkpoints there on request while it waits
        for rollouts: the entries already taken for this batch are still pending, so the floor
        keeps them)."""
        import time

        batch = Batch()
        seen_entries: set[str] = set()
        skipped: set[str] = set()
        batch_ids: set[str] = set()
        start = time.perf_counter()
        while len(batch.groups) < groups_per_step:
            if should_stop():
                return None
            on_wait()
            entries = self.queue.read(
                self.consumer_name,
                count=groups_per_step - len(batch.groups),
                block_ms=self.block_ms,
                claim_idle_ms=self.claim_idle_ms,
            )
            skipped_before = len(batch.skipped_entry_ids)
            again: list[str] = []  # skipped before and delivered again: pending again
            for entry in entries:
                if entry.entry_id in seen_entries:
                    if entry.entry_id in skipped:
                        again.append(entry.entry_id)
                    continue
                seen_entries.add(entry.entry_id)
                self._admit(entry, batch, batch_ids, trainer_version, max_lag)
            newly_skipped = batch.skipped_entry_ids[skipped_before:]
            skipped.update(newly_skipped)
            self.queue.ack(newly_skipped + again)  # at once: see the module docstring
        batch.wait_s = time.perf_counter() - start
        return batch

    def _admit(
        self, entry: QueueEntry, batch: Batch, batch_ids: set[str], trainer_version: int, max_lag: int
    ) -> None:
        group = entry.group
        problem = entry.error or ("" if group is None else validate_group(group))
        if group is None or problem:
            log.warning("skipping malformed entry %s: %s", entry.entry_id, problem)
            batch.malformed += 1
            batch.skipped_entry_ids.append(entry.entry_id)
            return
        lag = entry_lag(trainer_version, group.min_weight_version)
        with tracing.span(
            "consume",
            {
                **tracing.messaging_attributes("process", self.queue.stream, message_id=entry.entry_id),
                tracing.ATTR_GROUP_ID: group.group_id,
                tracing.ATTR_WEIGHT_VERSION: trainer_version,
                tracing.ATTR_MIN_VERSION: int(group.min_weight_version),
                tracing.ATTR_MAX_VERSION: int(group.max_weight_version),
                tracing.ATTR_LAG: lag,
                tracing.ATTR_TOKENS: sum(len(s.token_ids) for s in group.samples),
                "parity.delivery": entry.delivery,
            },
            links_from=[entry.traceparent],
            kind="consumer",
        ) as span:
            ids = [s.rollout_id for s in group.samples]
            if any(i in self.applied_ids or i in batch_ids for i in ids):
                batch.duplicates += 1
                batch.skipped_entry_ids.append(entry.entry_id)
                span.set_attribute("parity.outcome", "duplicate")
                return
            beyond = int(group.max_weight_version) > trainer_version  # not this lineage's weights
            if beyond or (self.lost_versions and uses_lost_version(group, self.lost_versions)):
                batch.dropped_future_version += 1
                batch.skipped_entry_ids.append(entry.entry_id)
                span.set_attribute("parity.outcome", "dropped_future_version")
                return
            if lag > max_lag:
                batch.dropped_stale += 1
                batch.skipped_entry_ids.append(entry.entry_id)
                span.set_attribute("parity.outcome", "dropped_stale")
                return
            batch_ids.update(ids)
            batch.groups.append(group)
            batch.entry_ids.append(entry.entry_id)
            batch.traceparents.append(entry.traceparent)
            span.set_attribute("parity.outcome", "admitted")
