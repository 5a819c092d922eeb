"""What `parity run` prints: one timestamped line per event."""

from __future__ import annotations

import time


def log(message: str) -> None:
    print(f"[parity run {time.strftime('%H:%M:%S')}] {message}", flush=True)
