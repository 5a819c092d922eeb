"""torchrun's rendezvous for the ranks of one host, on loopback only (`trainer.agent --standalone`).

torchrun's own `--standalone` rendezvous (the c10d backend) serves a TCPStore that listens on every
interface (torch binds its server socket itself, whatever host it is given) and keeps its state
in it as a pickle, which the agent loads on every sync: anyone who could reach the port could run
code in the agent. Here the agent serves the store on a socket bound to 127.0.0.1, and the ranks
connect to it there (torchrun's agent store: `use_agent_store`). Nothing on it is pickled: a
static rendezvous of one node keeps no state of its own in the store.

The ranks' gloo and NCCL bootstrap sockets are pinned to loopback too (`GLOO_SOCKET_IFNAME=lo`,
`NCCL_SOCKET_IFNAME=lo`, each unless set): NCCL otherwise picks the first non-loopback interface
for its bootstrap listener. Ranks of one host move their data over NVLink, PCIe or shared memory,
not these sockets. (The NCCL half is checked as far as the environment the ranks get: no GPUs here.)

    --standalone  ->  --rdzv-backend=parity-local --rdzv-endpoint=127.0.0.1:0 --nnodes=1
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from typing import Any

BACKEND = "parity-local"
HOST = "127.0.0.1"
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
NCCL_IFNAME_ENV = "NCCL_SOCKET_IFNAME"


def replace_standalone(argv: Sequence[str]) -> list[str]:
    """torchrun's arguments with `--standalone` turned into this rendezvous; others unchanged."""
    if "--standalone" not in argv:
        return list(argv)
    # torchrun's own arguments end where the script (or -m MODULE) begins
    end = next((i for i, arg in enumerate(argv) if arg == "-m" or not arg.startswith("-")), len(argv))
    if "--standalone" not in argv[:end]:
        return list(argv)
    own = [arg for arg in argv[:end] if arg != "--standalone"]
    local = [f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={HOST}:0", "--nnodes=1"]
    return [*local, *own, *argv[end:]]


def use(argv: Sequence[str]) -> list[str]:
    """torchrun's arguments for this process (the agent's): with `--standalone`, this rendezvous
    (registered with torchrun) and the ranks' gloo sockets pinned to loopback; otherwise (ranks
    across hosts) unchanged."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    replaced = replace_standalone(argv)
    if replaced != list(argv):
        rendezvous_handler_registry.register(BACKEND, _create_handler)
        os.environ.setdefault(GLOO_IFNAME_ENV, "lo")
        os.environ.setdefault(NCCL_IFNAME_ENV, "lo")
    return replaced


def _create_handler(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        """One node: the agent serves the store on a loopback socket bound here, at a free port."""

        def get_backend(self) -> str:
            return BACKEND

        def next_rendezvous(self) -> Any:
            if self._store is None:
                self._store, self.master_port = _loopback_store(self.timeout)
            return super().next_rendezvous()

    if params.max_nodes != 1:
        raise ValueError(
            f"--rdzv-backend={BACKEND} is for one host: --nnodes must be 1, not {params.max_nodes}"
        )
    timeout = int(params.config.get("timeout", 900))
    return LoopbackRendezvous(HOST, 0, 0, 1, params.run_id, timeout)


def _loopback_store(timeout: datetime.timedelta) -> tuple[Any, int]:
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    listener.listen(1024)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        HOST,
        port,
        None,
        True,
        timeout,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
    )
    return store, port
