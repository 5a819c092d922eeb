"""The `broadcast` section: the weight-broadcast service (`parity serve broadcast --help`).

Every field reads from `--field value` or `PARITY_BROADCAST_<FIELD>`. Bad values fail at startup
with the field named; a non-loopback bind without `auth_token` is refused (`check_security`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from parity.config.base import DEFAULT_BUCKET_BYTES, ServiceConfig


class BroadcastConfig(ServiceConfig):
    """Settings of `parity serve broadcast`."""

    backend: Literal["gloo", "nccl"] = Field(
        "gloo", description="torch.distributed backend for tensors: gloo (CPU) or nccl (GPU)."
    )
    data_host: str = Field(
        "127.0.0.1",
        description="Address peers use to reach this service's TCPStore and gloo sockets (the data plane).",
    )
    data_bind_host: str = Field(
        "",
        description="Address the TCPStore listens on; empty: data_host. Set it where data_host is a "
        "name that is not this host's own address (a Kubernetes Service: bind the pod's IP).",
    )
    store_port: int = Field(
        0, ge=0, le=65535, description="TCPStore port for rendezvous; 0 picks a free one."
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, le=300, description="How often workers are told to heartbeat."
    )
    heartbeat_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A worker silent for this long is dropped (never while updating)."
    )
    transfer_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Every rendezvous and every bucket collective fails after this."
    )
    rpc_margin_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Extra seconds on top of 2*transfer_timeout_s for a worker's UpdateWeights deadline.",
    )
    retry_failed_after_s: float = Field(
        30.0, gt=0, le=86400, description="A worker whose update failed is retried on the latest after this."
    )
    bucket_bytes: int = Field(
        DEFAULT_BUCKET_BYTES,
        ge=4096,
        le=4 * 1024**3,
        description="Bucket size of packed transfers when the publisher leaves it 0.",
    )
    max_version_bytes: int = Field(
        64 * 1024**3, gt=0, description="Largest version accepted (RESOURCE_EXHAUSTED above)."
    )
    max_workers: int = Field(256, gt=0, description="Most registered workers (RESOURCE_EXHAUSTED above).")
    history_versions: int = Field(
        256, gt=0, le=100_000, description="How many versions GetStatus and WatchVersions remember."
    )
    delta_updates: bool = Field(
        False,
        description="Send only the tensors whose checksum changed since the previous version (with "
        "the tensors sharing their module), when every worker of the epoch serves that version; "
        "otherwise the whole version. Saves bytes when parameters are frozen (trainer.freeze).",
    )
    notify_redis: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Also publish every version event, serialized once, to Redis pub/sub channels "
        "'<run.stream>:versions:<kind>' (parity/weights/version_watch.py reads them; Redis fans out "
        "in C, so 1,000 watchers cost the service one write per event, not 1,000 gRPC stream writes). "
        "auto: when run.redis_url is set; on: run.redis_url is required; off: gRPC WatchVersions only.",
    )

    @model_validator(mode="after")
    def _timeouts_consistent(self) -> BroadcastConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s: must exceed heartbeat_interval_s={self.heartbeat_interval_s}"
            )
        return self
