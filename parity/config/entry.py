"""The start of every command that takes the run config: parse, validate, print, log, then run.

    def main(argv):
        return entrypoint("parity serve trainer", "trainer", argv, serve)

`--help` prints every option and exits 0; `--print-config` prints the effective config with the
source of each value and exits 0; a bad value prints `PROG: error: section.field: why` and exits 2
(the exit code argparse uses). A service section is checked for security before anything starts.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from parity.config.base import ConfigError, ServiceConfig
from parity.config.loader import HelpRequested, load
from parity.config.schema import ParityConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def entrypoint(prog: str, home: str | None, argv: Sequence[str], body: Callable[[ParityConfig], int]) -> int:
    try:
        loaded = load(argv, home=home)
        section = getattr(loaded.config, home) if home else None
        if isinstance(section, ServiceConfig):
            try:
                section.check_security()
            except ConfigError as exc:
                raise ConfigError(f"{home}.{exc}") from None
    except HelpRequested as help_text:
        print(f"usage: {prog} [--config FILE] [--print-config] [--section.field VALUE ...]\n{help_text}")
        return 0
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if loaded.print_config:
        print(loaded.to_toml(), end="")
        return 0
    loaded.config.observability.apply_to_environment()
    logging.basicConfig(level=loaded.config.observability.log_level, format=LOG_FORMAT, stream=sys.stderr)
    return int(body(loaded.config) or 0)
