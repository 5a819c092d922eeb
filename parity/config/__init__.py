"""The one typed config of a run: per-component sections composed into `ParityConfig`.

Sections live one per module in this package (schema.py lists them); loading, printing and handing
the config to child processes is loader.py; the common start of every command is entry.py.
"""

from parity.config.base import LOOPBACK_HOSTS, ConfigError, ServiceConfig, is_loopback
from parity.config.loader import LoadedConfig, env_for, load, to_toml, write_config
from parity.config.schema import SECTIONS, ParityConfig

__all__ = [
    "LOOPBACK_HOSTS",
    "SECTIONS",
    "ConfigError",
    "LoadedConfig",
    "ParityConfig",
    "ServiceConfig",
    "env_for",
    "is_loopback",
    "load",
    "to_toml",
    "write_config",
]
