"""A rank for tests/test_trainer_agent.py, run by torchrun's agent through `trainer.agent`.

    python -m tests.agent_rank MODE READY_FILE

It writes READY_FILE (and, beside it, the TORCH_ELASTIC_SHUTDOWN_TIMEOUT it inherited) and waits. On SIGTERM it ends as MODE says: an integer N records N as rank
0's exit status (`trainer.agent.record_rank0_exit`, what the trainer service does) and exits N;
`unrecorded` exits 0 without recording, as a rank 0 killed before its exit never records.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from trainer.agent import record_rank0_exit


def main() -> None:
    mode, ready = sys.argv[1], Path(sys.argv[2])

    def stop(signum: int, frame: object) -> None:
        if mode == "unrecorded":
            os._exit(0)
        record_rank0_exit(int(mode))
        os._exit(int(mode))

    signal.signal(signal.SIGTERM, stop)
    # the environment the agent gave its ranks (what torchrun reads its shutdown timeout from)
    ready.with_suffix(".shutdown_timeout").write_text(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", ""))
    ready.write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
