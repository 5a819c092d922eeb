"""User-facing tools that drive the services from outside: `parity run` and `parity check`."""
