"""The `observability` section: logs and traces of every process of a run.

Tracing uses the standard OpenTelemetry variables. This section sets their defaults
(`OTEL_TRACES_EXPORTER`, `OTEL_EXPORTER_OTLP_ENDPOINT`) when a process starts; a standard variable
already present in the environment wins, as OpenTelemetry users expect.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from parity.config.base import Section


class ObservabilityConfig(Section):
    """Logging and OpenTelemetry tracing (off by default)."""

    log_level: str = Field("INFO", description="Python logging level: DEBUG, INFO, WARNING or ERROR.")
    traces_exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="Span exporter (OTEL_TRACES_EXPORTER): none, console or otlp."
    )
    otlp_endpoint: str = Field(
        "", description="OTLP collector URL (OTEL_EXPORTER_OTLP_ENDPOINT); empty = the SDK's default."
    )

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
        return value.upper()

    def apply_to_environment(self) -> None:
        """Default the OTEL_* variables from this section; ones already set are kept."""
        os.environ.setdefault("OTEL_TRACES_EXPORTER", self.traces_exporter)
        if self.otlp_endpoint:
            os.environ.setdefault("OTEL_EXPORTER_OTLP_ENDPOINT", self.otlp_endpoint)
