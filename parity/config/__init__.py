"""The one typed config of a run: per-component sections composed into `ParityConfig`."""

from parity.config.base import (
    LOOPBACK_HOSTS,
    ConfigError,
    ServiceConfig,
    format_validation_error,
    is_loopback,
    load_config,
)

__all__ = [
    "LOOPBACK_HOSTS",
    "ConfigError",
    "ServiceConfig",
    "format_validation_error",
    "is_loopback",
    "load_config",
]
