"""`parity serve trainer` with `trainer.nproc` > 1: the service re-launches itself under torchrun.

    parity serve trainer --nproc 2 ...            (this process)
      -> exec python -m trainer.agent --standalone --nproc-per-node 2 --max-restarts 0
               -m commands.main serve trainer      (torchrun's elastic agent replaces this process)
           -> rank 0: the service (gRPC, Redis, publisher); ranks 1..: followers (trainer/multirank.py)

Invariants:
- The ranks get the config the way every child of a launcher does: the effective config written
  to `RUN_DIR/torchrun/config.toml` (PARITY_CONFIG) plus the environment; no config value and no
  secret is put on the command line. Secrets (auth tokens, a Redis password inside the URL) are
  left out of the file by the writer and travel in the ranks' environment only.
- exec, not a child: the agent keeps this pid, so a supervisor's signals and process-group kill
  reach it, it forwards SIGTERM/SIGINT to the ranks, and its exit status is the service's: after a
  signal stop, rank 0's (trainer/agent.py), so a graceful stop of every rank exits 0.
- `--max-restarts 0`: a rank that dies ends the service (the agent stops the others and exits
  non-zero with a report naming the rank); restarting is the supervisor's decision, and a restart
  resumes from the last checkpoint.
- torchrun starts each rank in a session of its own, out of reach of a process-group kill of the
  service; so every rank asks the kernel to SIGKILL it when the agent dies (`die_with_agent`,
  PR_SET_PDEATHSIG): a supervisor that kills the agent after its grace period leaves no rank behind.
- Already under torchrun (WORLD_SIZE set, e.g. launched by Kubernetes with static rendezvous across
  hosts), nothing is re-launched: the rank count is torchrun's and `nproc` is not used.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parity.procs import die_with_parent

if TYPE_CHECKING:
    from parity.config import ParityConfig

log = logging.getLogger(__name__)


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def die_with_agent() -> None:
    """Linux: SIGKILL this rank when its parent (torchrun's agent) exits; exit now if it already has.
    An agent that is pid 1 (a container's entrypoint: plain `torchrun` too, which does not mark
    itself as Parity's agent does) is this rank's parent, not init that adopted an orphan."""
    die_with_parent(1 if os.getppid() == 1 and _agent_is_pid_1() else None)


def _agent_is_pid_1() -> bool:
    try:
        args = Path("/proc/1/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    names = {Path(arg.decode(errors="replace")).name for arg in args}
    return bool(names & {"torchrun", "torch.distributed.run", "trainer.agent"})


def torchrun_command(nproc: int) -> list[str]:
    """The agent's argv: no config value, no secret (those are in PARITY_CONFIG and the environment)."""
    return [
        sys.executable,
        "-m",
        "trainer.agent",  # torchrun's agent, ending a signal stop with rank 0's exit status
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        "commands.main",
        "serve",
        "trainer",
    ]


def secret_environment(config: ParityConfig) -> dict[str, str]:
    """The values the config file leaves out: every set secret field and the Redis URL (it may hold
    a password), as PARITY_<SECTION>_<FIELD> entries."""
    from parity.config import env_for
    from parity.config.base import is_secret

    env = env_for("run", redis_url=config.run.redis_url)
    for section, model in config:
        for name in type(model).model_fields:
            value = getattr(model, name)
            if is_secret(type(model), name) and value:
                env.update(env_for(section, **{name: value}))
    return env


def child_environment(config: ParityConfig, config_path: Path) -> dict[str, str]:
    """This process's environment with PARITY_CONFIG pointing at the written config and the secrets.
    Its config variables are left out: the written config already holds what they set, unless a
    flag overrode them, and in the ranks they would beat the file (a flag lost to a variable)."""
    from parity.config.loader import CONFIG_FILE_ENV, config_env_keys

    dropped = set(config_env_keys(os.environ))
    kept = {key: value for key, value in os.environ.items() if key not in dropped}
    return {**kept, CONFIG_FILE_ENV: str(config_path), **secret_environment(config)}


def relaunch(config: ParityConfig) -> int:
    """Replace this process with torchrun running `nproc` trainer ranks (returns only on failure)."""
    from parity.config.loader import write_config

    nproc = config.trainer.nproc
    config_path = write_config(config, Path(config.trainer.run_dir).resolve() / "torchrun" / "config.toml")
    command = torchrun_command(nproc)
    log.info("re-launching under torchrun: %d ranks (config %s)", nproc, config_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, child_environment(config, config_path))
    return 1  # not reached
