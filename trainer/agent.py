"""torchrun's elastic agent for `parity serve trainer --nproc N`, ending a signal stop like one rank.

    python -m trainer.agent --standalone --nproc-per-node=N ... -m commands.main serve trainer

It runs torchrun's own agent (`torch.distributed.run.main`, same arguments) with two changes at
the edges:
- A stop by SIGTERM or SIGINT exits with rank 0's exit status (0 after its graceful stop: finish
  the step, publish, checkpoint, stop the other ranks), as the one-rank service does. torchrun's
  agent turns such a signal into `SignalException`: it forwards the signal to the ranks, waits for
  them up to its shutdown timeout (then SIGKILL), and re-raises, so plain torchrun always ended
  with a traceback and exit 1, whatever the ranks did. Rank 0 writes its exit status to the file
  named by `PARITY_RANK0_EXIT_FILE` (`record_rank0_exit`) just before it exits; a rank 0 that never
  wrote it (killed at the shutdown timeout, or crashed) makes the agent exit 1, saying so.
- The exit file, and torchrun's own temporary directories, live in a scratch directory named after
  the agent's pid, removed when the agent exits; an agent killed by SIGKILL cannot remove its own,
  so each agent removes those of agents no longer running when it starts.
- `--standalone` (the ranks of one host) runs on a rendezvous store bound to loopback, with
  nothing pickled in it (trainer/local_rendezvous.py), not torchrun's own, which listens on every
  interface.
- `kill -USR1 PID` dumps the agent's Python stacks to its log (as every Parity command does)
  instead of killing it.

Anything else (a rank that failed: torchrun's ChildFailedError with its report naming the rank;
a bad argument) goes out exactly as torchrun's own command would end.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from parity.config.entry import LOG_FORMAT
from parity.procs import mark_as_parent
from parity.stack_dumps import dump_stacks_on_sigusr1
from trainer import local_rendezvous

EXIT_FILE_ENV = "PARITY_RANK0_EXIT_FILE"
SCRATCH_PREFIX = "parity-agent-"
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
SHUTDOWN_TIMEOUT_S = 240

log = logging.getLogger("parity.trainer.agent")


def record_rank0_exit(rc: int) -> None:
    """Rank 0, about to exit with `rc`: leave it where the agent reads it after a signal stop."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        Path(path).write_text(f"{rc}\n")


def rank0_exit(path: Path) -> int | None:
    """What rank 0 recorded, or None when it exited without recording (killed, crashed)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def remove_orphaned_scratch(parent: Path) -> list[Path]:
    """Remove the scratch directories of agents that are no longer running (SIGKILLed); returns them."""
    removed = []
    for path in parent.glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    dump_stacks_on_sigusr1()
    mark_as_parent()  # the ranks die with this agent, also when it is a container's pid 1
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    remove_orphaned_scratch(Path(tempfile.gettempdir()))
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-") as scratch:
        exit_file = Path(scratch) / "rank0.exit"
        os.environ[EXIT_FILE_ENV] = str(exit_file)  # the ranks inherit it
        # torchrun's own temporary directories (torchelastic_*: the ranks' error files) go inside
        # ours, so that they go with it: torchrun never removes them, so every start left one.
        tempfile.tempdir = scratch
        # After a stop signal the agent waits this long for the ranks (then SIGKILL): rank 0's
        # graceful stop finishes its step, publishes and checkpoints, which takes longer than
        # torchrun's 30 s on a real model. The deployments' grace periods are longer still.
        os.environ.setdefault(SHUTDOWN_TIMEOUT_ENV, str(SHUTDOWN_TIMEOUT_S))
        try:
            torchrun_main(local_rendezvous.use(sys.argv[1:] if argv is None else argv))
        except SignalException as exc:
            name = signal.Signals(exc.sigval).name
            rc = rank0_exit(exit_file)
            if rc is None:
                log.error(
                    "stopped by %s: rank 0 exited without an exit status (killed at torchrun's "
                    "shutdown timeout, or crashed): exit 1",
                    name,
                )
                return 1
            log.info("stopped by %s: rank 0 exited %d", name, rc)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
