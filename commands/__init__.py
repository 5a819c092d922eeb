"""The user commands: `parity` (main.py) and its subcommands `run` and `check`/`compare`."""
