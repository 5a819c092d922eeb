"""The version registry: the single source of truth for weight versions (metadata only).

Invariants:
- Versions are monotonic. A publish is accepted only as `head + 1`, where head is the newest version
  that has not FAILED (any version in [1, MAX_VERSION] when the registry is empty: a resumed trainer
  continues its numbering), so a failed version may be re-published with the same number and
  nothing ever goes backwards. MAX_VERSION leaves room for a successor in int64.
- The schema (model name, tensor names, shapes, dtypes, order) is registered by the first version
  that a worker verified. A publish that fails (bogus sizes, nobody could receive it) leaves no trace
  but its FAILED record, and one that commits to an epoch without workers (no byte moved, nothing
  verified) binds nothing either, so the next valid publish succeeds. Once registered,
  every publish must match the schema exactly, or it is rejected before any byte moves.
- States only move forward: RECEIVING -> COMMITTED (a worker verified every checksum, or the epoch
  had no worker) -> DISTRIBUTED (every worker of the epoch acked), or RECEIVING -> FAILED.
- The registry holds no tensor bytes: the trainer sends them straight to the workers.
- All mutation happens on the service's event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from broadcast.events import EventLog, Kind
from parity.errors import RequestError, invalid, quote
from parity.v1 import broadcast_pb2 as pb
from parity.v1 import common_pb2
from parity.weights.layout import SUPPORTED_DTYPES, Layout

State = pb.VersionState
MAX_VERSION = 2**63 - 2  # its successor is the largest int64: a registry can always take head + 1
_PROGRESS = {
    State.VERSION_STATE_RECEIVING: 1,
    State.VERSION_STATE_COMMITTED: 2,
    State.VERSION_STATE_DISTRIBUTED: 3,
}


@dataclass
class VersionRecord:
    version: int
    model: str
    metas: list[common_pb2.TensorMeta]
    layout: Layout
    bucket_bytes: int
    state: int = State.VERSION_STATE_RECEIVING
    epoch: int = 0
    published_at_unix: float = field(default_factory=time.time)
    receive_seconds: float = 0.0
    error: str = ""
    traceparent: str = ""  # of the publish_version span: parent of every transfer of this version
    # A delta update (broadcast/delta.py): the epoch's plan sends only `delta_metas`, which
    # apply on top of `base_version`; 0 / None: the whole version.
    base_version: int = 0
    delta_metas: list[common_pb2.TensorMeta] | None = None
    delta_bytes: int = 0
    to_workers: bool = True  # False: its epoch had no worker, no byte of it moves anywhere

    def plan(self, rendezvous: common_pb2.Rendezvous, whole: bool = False) -> common_pb2.TransferPlan:
        """The plan that moves this version's bytes through the group `rendezvous` describes: the
        delta when there is one, unless `whole` (catch-ups and late joiners)."""
        delta = self.delta_metas is not None and not whole
        return common_pb2.TransferPlan(
            version=self.version,
            tensors=self.delta_metas if delta else self.metas,
            bucket_bytes=self.bucket_bytes,
            checksum_algorithm=common_pb2.CHECKSUM_ALGORITHM_WSUM64,
            rendezvous=rendezvous,
            base_version=self.base_version if delta else 0,
            full_bytes=self.layout.total_bytes if delta else 0,
        )

    def set_delta(self, base_version: int, metas: list[common_pb2.TensorMeta]) -> None:
        self.base_version, self.delta_metas = base_version, metas
        self.delta_bytes = Layout.of(metas).total_bytes

    def plan_bytes(self, whole: bool = False) -> int:
        """Bytes that `plan(..., whole)` moves (computed once, not per worker)."""
        return self.delta_bytes if self.delta_metas is not None and not whole else self.layout.total_bytes

    def info(self) -> pb.VersionInfo:
        return pb.VersionInfo(
            version=self.version,
            model=self.model,
            state=self.state,
            total_bytes=self.layout.total_bytes,
            num_tensors=len(self.metas),
            receive_seconds=self.receive_seconds,
            published_at_unix=self.published_at_unix,
            error=self.error,
        )


def reached(state: int, wanted: int) -> bool:
    """Whether a version in `state` has reached (or passed) `wanted`."""
    if wanted in _PROGRESS:
        progress = _PROGRESS.get(state, 0)
        if state == State.VERSION_STATE_SUPERSEDED:
            progress = _PROGRESS[State.VERSION_STATE_COMMITTED]
        return progress >= _PROGRESS[wanted]
    return state == wanted


def is_final_for(state: int, wanted: int) -> bool:
    """True when `state` can never reach `wanted` any more."""
    return not reached(state, wanted) and state in (
        State.VERSION_STATE_FAILED,
        State.VERSION_STATE_SUPERSEDED,
    )


class VersionRegistry:
    """Versions, their schema and their bytes; emits an event on every state change."""

    def __init__(self, events: EventLog, history_versions: int = 256, max_version_bytes: int = 1 << 36):
        self.events = events
        self.history_versions = history_versions
        self.max_version_bytes = max_version_bytes
        self.records: OrderedDict[int, VersionRecord] = OrderedDict()
        self.model = ""
        self.schema: list[tuple[str, tuple[int, ...], str]] = []

    # -- queries --------------------------------------------------------------------------------
    @property
    def head(self) -> int:
        """Newest version not FAILED (0 when none)."""
        alive = [v for v, r in self.records.items() if r.state != State.VERSION_STATE_FAILED]
        return max(alive, default=0)

    @property
    def latest_committed(self) -> int:
        done = [v for v, r in self.records.items() if r.state in (_COMMITTED_OR_LATER)]
        return max(done, default=0)

    def get(self, version: int) -> VersionRecord | None:
        return self.records.get(version)

    # -- publish --------------------------------------------------------------------------------
    def validate(self, request: pb.PublishVersionRequest) -> None:
        """Raise RequestError unless `request` may be published now (nothing is changed)."""
        if not 1 <= request.version <= MAX_VERSION:
            raise invalid(
                "version",
                f"must be in [1, {MAX_VERSION}] so that its successor fits int64 (got {request.version})",
            )
        if not request.model:
            raise invalid("model", "required (the name of the model the weights belong to)")
        if not request.tensors:
            raise invalid("tensors", "at least one tensor is required")
        if request.checksum_algorithm != common_pb2.CHECKSUM_ALGORITHM_WSUM64:
            raise invalid("checksum_algorithm", "must be CHECKSUM_ALGORITHM_WSUM64")
        if request.bucket_bytes < 0 or 0 < request.bucket_bytes < 4096:
            raise invalid("bucket_bytes", f"must be 0 or >= 4096 (got {request.bucket_bytes})")
        seen: set[str] = set()
        for i, meta in enumerate(request.tensors):
            where = f"tensors[{i}]"
            if not meta.name or meta.name in seen:
                raise invalid(f"{where}.name", f"empty or duplicate {quote(meta.name)}")
            seen.add(meta.name)
            if meta.dtype not in SUPPORTED_DTYPES:
                raise invalid(f"{where}.dtype", f"unsupported {quote(meta.dtype)} for {quote(meta.name)}")
            if any(d < 0 for d in meta.shape):
                raise invalid(f"{where}.shape", f"negative dimension for {quote(meta.name)}")
        if self.schema:
            self._check_schema(request)
        total = Layout.of(request.tensors).total_bytes
        if total > self.max_version_bytes:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "tensors",
                f"{total} bytes exceed max_version_bytes={self.max_version_bytes}",
            )
        head = self.head
        if self.records and request.version <= head:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "version",
                f"{request.version} goes backwards (latest is {head}); versions are monotonic",
            )
        if self.records and request.version != head + 1:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "version",
                f"{request.version} skips ahead; the next version must be {head + 1}",
            )

    def _check_schema(self, request: pb.PublishVersionRequest) -> None:
        if request.model != self.model:
            raise invalid("model", f"{quote(request.model)} is not the registered model {self.model!r}")
        expected = {name: (shape, dtype) for name, shape, dtype in self.schema}
        for i, meta in enumerate(request.tensors):
            if meta.name not in expected:
                raise invalid(f"tensors[{i}].name", f"{quote(meta.name)} is not in model {self.model!r}")
            shape, dtype = expected[meta.name]
            if tuple(meta.shape) != shape:
                raise invalid(
                    f"tensors[{i}].shape", f"{meta.name} has {list(meta.shape)}, model has {list(shape)}"
                )
            if meta.dtype != dtype:
                raise invalid(f"tensors[{i}].dtype", f"{meta.name} is {meta.dtype}, model has {dtype}")
        order = [name for name, _, _ in self.schema]
        given = [meta.name for meta in request.tensors]
        if given != order:
            missing = sorted(set(order) - set(given))
            detail = f"missing {missing[:5]}" if missing else "same names in a different order"
            raise invalid("tensors", f"must list every tensor of the model in registered order ({detail})")

    def begin(
        self, request: pb.PublishVersionRequest, bucket_bytes: int, epoch: int, to_workers: bool = True
    ) -> VersionRecord:
        """Accept a validated publish: record it as RECEIVING (nothing is allocated here).
        `to_workers` False (an epoch without workers): it commits without binding the schema."""
        metas = list(request.tensors)
        record = VersionRecord(
            version=request.version,
            model=request.model,
            metas=metas,
            layout=Layout.of(metas),
            bucket_bytes=bucket_bytes,
            epoch=epoch,
            to_workers=to_workers,
        )
        self.records.pop(request.version, None)  # a failed attempt at this number is replaced
        self.records[request.version] = record
        while len(self.records) > self.history_versions:
            self.records.popitem(last=False)
        self.events.emit(Kind.VERSION_EVENT_KIND_PUBLISHED, record.version)
        return record

    # -- transitions ----------------------------------------------------------------------------
    def commit(self, record: VersionRecord, receive_seconds: float) -> None:
        """A worker verified `record` (or there was nobody to send it to). The first version a
        worker verified registers the schema; one that went to nobody proves nothing about it."""
        if record.state != State.VERSION_STATE_RECEIVING:
            return
        if not self.schema and record.to_workers:
            self.model = record.model
            self.schema = [(m.name, tuple(m.shape), m.dtype) for m in record.metas]
        record.receive_seconds = receive_seconds
        record.state = State.VERSION_STATE_COMMITTED
        self.events.emit(Kind.VERSION_EVENT_KIND_COMMITTED, record.version)

    def distributed(self, record: VersionRecord) -> None:
        if record.state == State.VERSION_STATE_COMMITTED:
            record.state = State.VERSION_STATE_DISTRIBUTED
            self.events.emit(Kind.VERSION_EVENT_KIND_DISTRIBUTED, record.version)

    def fail(self, record: VersionRecord, error: str) -> None:
        record.state = State.VERSION_STATE_FAILED
        record.error = error
        self.events.emit(Kind.VERSION_EVENT_KIND_FAILED, record.version, error=error)


_COMMITTED_OR_LATER = (State.VERSION_STATE_COMMITTED, State.VERSION_STATE_DISTRIBUTED)
