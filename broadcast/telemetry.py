"""Prometheus metrics of the weight-broadcast service (served by parity.metrics.serve_metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

UPDATE_SECONDS = Histogram(
    "parity_broadcast_update_duration_seconds",
    "One worker update, from the UpdateWeights call to its ack (transfer, verify, swap included).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
)
BYTES = Counter(
    "parity_broadcast_bytes",
    "Weight bytes delivered over the data group: direction=received counts each worker's verified "
    "ack of a version (the service itself moves no tensor bytes).",
    ["direction"],
)
DELTA_BYTES_SAVED = Counter(
    "parity_broadcast_delta_bytes_saved",
    "Bytes a delta update did not send to each epoch (whole version minus the changed tensors; "
    "broadcast.delta_updates).",
)
FAILURES = Counter(
    "parity_broadcast_update_failures",
    "Failed worker updates by reason: checksum, transfer, timeout, unreachable, rpc, internal.",
    ["reason"],
)
LATEST_VERSION = Gauge("parity_broadcast_latest_version", "Latest version a worker verified (COMMITTED).")
WORKERS = Gauge("parity_broadcast_workers", "Registered (live) rollout workers.")
