"""What a restarted trainer needs to continue without reusing a version or training a rollout twice.

A checkpoint holds the weights, optimizer, version, the rollout ids in those weights and the
stream *replay floor* (every entry below it is reflected in them). On restart the group is rewound
to the floor: entries acknowledged after the checkpoint are delivered again, and those already in
the checkpoint are recognised by rollout id and skipped (`bound_dedupe` keeps exactly the ids a
rewind can still meet).

Versions continue above the highest version ever published (checkpoint, the run directory's
`published_version` file, the broadcast service's latest, the newest version a rollout in the
stream carries). If that is above the checkpoint's
version, or the broadcast service holds less than it (a restarted service, as after
`parity run --resume`), the restored weights are re-published at once as the next number, so that
rollout workers stop sampling from weights the trainer no longer has. The versions between the
checkpoint's and the highest published are *lost*: rollouts sampled from them are dropped and
counted (dropped_future_version).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PUBLISHED_VERSION_FILE = "published_version"


def read_published_version(run_dir: Path) -> int:
    """The version the run directory records as last published (0 when none)."""
    try:
        return int((run_dir / PUBLISHED_VERSION_FILE).read_text().strip())
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class ResumePlan:
    published: int  # the highest version ever published: the next publish is above it
    lost: tuple[int, int] | None  # versions published after the checkpoint (their weights are gone)
    republish: bool  # publish the restored weights before training


def plan_resume(
    weight_version: int,
    checkpoint_published: int,
    file_published: int,
    broadcast_latest: int,
    has_broadcast: bool,
    stream_latest: int = 0,
) -> ResumePlan:
    """`stream_latest`: the highest version a rollout in the stream carries. A trainer killed
    mid-publish may have delivered a version to the workers before it recorded it anywhere;
    its rollouts must not pass for the next version's, so that number counts as published. The
    trainer passes it only on a resume (a checkpoint or a published version on record): a new run
    directory trains the rollouts it is given."""
    published = max(checkpoint_published, file_published, broadcast_latest, stream_latest)
    lost = (weight_version + 1, published) if published > weight_version else None
    reseed = has_broadcast and broadcast_latest < weight_version
    return ResumePlan(published, lost, lost is not None or reseed)


def stream_key(entry_id: str) -> tuple[int, int]:
    """A Redis stream id "ms-seq" as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def bound_dedupe(applied_entries: dict[str, str], floor: str, window: int) -> dict[str, str]:
    """The rollout ids (-> stream entry, in training order) a restart can still meet: those of
    entries at or above the replay floor (redelivered by the rewind) and the newest `window` (a
    producer's late duplicate). Older ids are dropped from the checkpoint and from memory."""
    ordered = list(applied_entries.items())
    recent = {rid for rid, _ in ordered[max(0, len(ordered) - window) :]} if window else set()
    floor_key = stream_key(floor)
    return {rid: e for rid, e in ordered if rid in recent or stream_key(e) >= floor_key}
