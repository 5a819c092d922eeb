"""The start of every command that takes the run config: parse, validate, print, log, then run.

    def main(argv):
        return entrypoint("parity serve trainer", "trainer", argv, serve)

`--help` prints the command's common options and `--help-all` every one, and exits 0;
`--print-config` prints the effective config with the source of each value and exits 0 (a command
whose effective config is not just the loaded one, `parity run --resume`, passes `effective`); a
bad value prints `PROG: error: section.field: why` and exits 2 (the exit code argparse uses). A
service section is checked for security before anything starts.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence

from parity.config.base import ConfigError, ServiceConfig
from parity.config.cli import help_text
from parity.config.loader import HelpRequested, LoadedConfig, load
from parity.config.schema import ParityConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger(__name__)


def entrypoint(
    prog: str,
    home: str | None,
    argv: Sequence[str],
    body: Callable[[ParityConfig], int],
    effective: Callable[[LoadedConfig], LoadedConfig] | None = None,
) -> int:
    try:
        loaded = load(argv, home=home, as_command=True)
        if loaded.print_config and effective is not None:
            loaded = effective(loaded)
        section = getattr(loaded.config, home) if home else None
        if isinstance(section, ServiceConfig):
            try:
                section.check_security()
            except ConfigError as exc:
                raise ConfigError(f"{home}.{exc}") from None
    except HelpRequested as request:
        print(help_text(home, prog, full=request.full))
        return 0
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if loaded.print_config:
        print(loaded.to_toml(), end="")
        return 0
    loaded.config.observability.apply_to_environment()
    logging.basicConfig(level=loaded.config.observability.log_level, format=LOG_FORMAT, stream=sys.stderr)
    for key, suggestion in sorted(loaded.ignored_env.items()):
        if suggestion:  # likely a misspelt config variable; wiring variables pass without a word
            log.warning("%s names no config key and is ignored; did you mean %s?", key, suggestion)
    return int(body(loaded.config) or 0)
