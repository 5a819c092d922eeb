"""Typed configuration shared by every service.

Each component owns a `pydantic-settings` class that reads, in order of precedence: CLI flags,
environment variables (`PARITY_<COMPONENT>_<FIELD>`, so docker-compose can configure everything),
then field defaults. Invalid values fail at startup with the field named (`ConfigError`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """True when `host` names only this machine."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ConfigError(ValueError):
    """A config value is invalid. The message names the field."""


class ServiceConfig(BaseSettings):
    """Settings every gRPC service has."""

    model_config = SettingsConfigDict(extra="forbid", validate_default=True)

    host: str = Field("127.0.0.1", description="Address to bind. Loopback unless told otherwise.")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    auth_token: str = Field(
        "",
        description="Shared token required on weight-changing RPCs. Mandatory when host is not loopback.",
    )
    metrics_port: int = Field(
        -1, ge=-1, le=65535, description="Prometheus /metrics port; -1 disables, 0 picks."
    )
    port_file: str = Field("", description="If set, write the bound gRPC port here once serving.")
    log_level: str = Field("INFO", description="Python logging level.")

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
        return value.upper()

    def check_security(self) -> None:
        """Refuse to expose weight-changing RPCs to the network without a token."""
        if not is_loopback(self.host) and not self.auth_token:
            raise ConfigError(
                f"auth_token: required when host={self.host!r} is not loopback "
                "(weight-changing RPCs must not be callable by unauthenticated remote clients)"
            )


def format_validation_error(exc: ValidationError) -> str:
    """One line per bad field: `field: message (got value)`."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<config>"
        got = err.get("input")
        lines.append(f"{field}: {err['msg']} (got {got!r})")
    return "; ".join(lines)


C = TypeVar("C", bound=BaseSettings)


def load_config(cls: type[C], argv: Sequence[str] | None = None, **overrides: object) -> C:
    """Build `cls` from CLI flags (`--field value`), env vars and defaults; raise ConfigError."""
    try:
        if argv is None:
            return cls(**overrides)
        return CliApp.run(cls, cli_args=list(argv), **overrides)
    except ValidationError as exc:
        raise ConfigError(f"{cls.__name__}: {format_validation_error(exc)}") from None
