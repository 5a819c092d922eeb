"""Ingest: receive a published version from the trainer, once, and verify it.

Invariants:
- The trainer is rank 0 and the service rank 1 of a two-member group under a fresh store prefix; the
  service hosts the TCPStore, so the trainer needs nothing but the plan.
- Bytes land in the version's own packed buffer (never in a buffer being fanned out); the watermark
  advances after each bucket so fan-out can forward what has arrived (cut-through).
- The version is COMMITTED only after every tensor's WSUM64 equals the trainer's; otherwise it is
  FAILED, the buffer is poisoned (forwarders abort, workers keep their weights), and the trainer may
  publish the same number again.
"""

from __future__ import annotations

import logging
import time

from parity import tracing
from parity.transport import StreamVerifier, TransferGroup
from parity.v1 import common_pb2
from services.broadcast.registry import VersionRecord

log = logging.getLogger(__name__)


def receive_and_verify(
    rendezvous: common_pb2.Rendezvous, record: VersionRecord
) -> tuple[float, float, list[str]]:
    """Blocking (run in a thread): returns (receive_seconds, verify_seconds, mismatched names)."""
    buffer = record.buffer
    assert buffer is not None
    start = time.monotonic()
    group = TransferGroup.join(rendezvous, host_store=True)
    try:
        group.recv_packed(record.metas, record.bucket_bytes, out=buffer.tensor, progress=buffer.advance)
    finally:
        group.close()
    # Verify only after the last bucket: checksumming between buckets would hold the trainer's send
    # (the trainer's cost must stay its own send). Forwarders already run; workers verify themselves.
    received = time.monotonic()
    attrs = {"parity.weight_version": record.version, "bytes": record.layout.total_bytes}
    with tracing.span("verify", attrs):
        bad = StreamVerifier(buffer.tensor, record.metas).mismatched()
    verify_s = time.monotonic() - received
    log.info(
        "v%d received %.1f MB in %.2fs, verified in %.3fs%s",
        record.version,
        record.layout.total_bytes / 1e6,
        received - start,
        verify_s,
        f", MISMATCH {bad[:5]}" if bad else "",
    )
    return received - start, verify_s, bad
