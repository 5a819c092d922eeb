"""What every config section shares: the section base, the service base, errors, loopback rules.

Invariants:
- A section is a pydantic model with `extra="forbid"`: an unknown key is an error that names it.
- Every field has a description (it is the `--help` text and the comment in `--print-config`).
- A field whose `json_schema_extra` carries `secret=True` is never printed and never written to a
  config file; it reaches a child process through its environment only.
"""

from __future__ import annotations

import ipaddress

from pydantic import BaseModel, ConfigDict, Field

# Bucket size of packed weight transfers (trainer.bucket_bytes, broadcast.bucket_bytes). Measured on
# loopback gloo (bench/weight_sync.py, SmolLM2, relay to 2 receivers, idle 2-core box): e2e/raw 3.05 at
# 64 MiB, 2.04 at 32, 1.87 at 16, 1.72-1.94 at 8, 2.04 at 4 MiB. Smaller buckets pipeline the relay's
# cut-through better; much smaller ones pay per-op cost.
DEFAULT_BUCKET_BYTES = 8 * 1024 * 1024
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
SECRET = {"secret": True}


def is_loopback(host: str) -> bool:
    """True when `host` names only this machine."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MIN_EXPOSED_TOKEN_CHARS = 16  # a token guarding a service off loopback (`openssl rand -hex 16`: 32)


def check_address(value: str) -> str:
    """A HOST:PORT setting (empty: none). Field validators call it; the message is the field's."""
    if not value:
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError("must be host:port with a port in 1-65535")
    return value


class ConfigError(ValueError):
    """A config value is invalid. The message names the key (`section.field`)."""


class Section(BaseModel):
    """One component's part of the run config."""

    # inf and NaN are no setting: an infinite timeout is a wait with no end, and code that converts
    # one to an integer (a timedelta, a byte count) fails long after the config was accepted
    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True, allow_inf_nan=False)


class ServiceConfig(Section):
    """Settings every gRPC service has (each service section extends this)."""

    host: str = Field("127.0.0.1", description="Address to bind. Loopback unless told otherwise.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    auth_token: str = Field(
        "",
        description="Shared token required on weight-changing RPCs. Mandatory when host is not loopback, "
        "and there at least 16 characters with no blanks. "
        "Secret: environment only (PARITY_<SECTION>_AUTH_TOKEN), never printed or written.",
        json_schema_extra=SECRET,
    )
    metrics_port: int = Field(
        -1, ge=-1, le=65535, description="Prometheus /metrics port; -1 disables, 0 picks."
    )
    port_file: str = Field("", description="If set, write the bound gRPC port here once serving.")
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest gRPC request accepted, in bytes; a larger one gets RESOURCE_EXHAUSTED "
        "before it is decoded.",
    )

    def check_security(self) -> None:
        """Refuse to expose weight-changing RPCs to the network without a token, or with one a
        remote client could guess (shorter than MIN_EXPOSED_TOKEN_CHARS, or with blanks)."""
        if is_loopback(self.host):
            return
        if not self.auth_token:
            raise ConfigError(
                f"auth_token: required when host={self.host!r} is not loopback "
                "(weight-changing RPCs must not be callable by unauthenticated remote clients)"
            )
        token = self.auth_token
        if len(token) < MIN_EXPOSED_TOKEN_CHARS or any(c.isspace() for c in token):
            raise ConfigError(
                f"auth_token: with host={self.host!r} (not loopback) it must be at least "
                f"{MIN_EXPOSED_TOKEN_CHARS} characters with no blanks, e.g. `openssl rand -hex 16`"
            )


def is_secret(section: type[BaseModel], field: str) -> bool:
    extra = section.model_fields[field].json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("secret"))
