"""The trainer service on several ranks: rank 0 leads, the other ranks follow its commands.

Rank 0 is the whole service (gRPC, the Redis consumer, the publisher, telemetry, checkpoints'
state.json). Ranks 1..N-1 only compute: they never touch Redis or gRPC. Everything rank 0 does
that needs the other ranks starts with a command, one int64 tensor broadcast from rank 0:

    rank 0                                     ranks 1..N-1 (`follow`)
    setup: load model, shard, DCP load  <->    the same (collective)
    loop:  collect a batch from Redis          wait for a command (heartbeats keep them waiting)
           STEP(version, tokens, seqs)   ->    scatter_sequences: own share of the batch
           forward_backward(share)      <->    forward_backward(share)   FSDP2: grads summed over ranks
           gather_stats                 <-     gather_stats          (metrics see the whole batch)
           optimizer_step               <->    optimizer_step        (the clip's norm is a collective)
           GATHER                        ->    all-gather full weights with rank 0 (once per published
                                                 version: the publish and the weight history share it)
           CHECKPOINT(step)              ->    DCP save of their shards (collective)
           STOP                          ->    leave the group, exit 0

Invariants:
- Commands and the collectives they start are issued by one thread of rank 0 (the training
  loop), in the same order on every rank; a follower does exactly what the command says.
- Every rank runs the same number of micro-batches of each kind (fsdp.align_micro_batches): a rank
  with fewer runs idle ones (one token, loss x 0), so FSDP2's all-gathers and reduce-scatters
  always pair up.
- Every collective has the group's timeout (`trainer.dist_timeout_s`). Whenever the followers wait
  for a command (every collective a command started is done), a thread of rank 0 sends a heartbeat
  (NOOP) every HEARTBEAT_S (at most a quarter of that timeout), so no rank-0-only phase times a
  follower out: waiting for rollouts, a Redis outage, publishing with its retries, scoring stale
  tokens, localising a mismatch. The thread and the training loop take turns on one lock, and the
  thread sends nothing while a command's collectives are under way, so the order of collectives
  stays the same on every rank. Rank 0 stuck inside a collective, or dead, still times them out.
- A rank that dies ends the service: its peers' next collective fails (or times out) and torchrun's
  elastic agent stops the others and exits non-zero naming the rank. Followers ignore SIGTERM and
  SIGINT: rank 0 turns them into a graceful stop (finish the step, publish, checkpoint) and sends STOP.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

from trainer import scatter
from trainer.loop import Trainer
from trainer.prepare import ScoredSequence, trainable_counts
from trainer.stats import StepStats

if TYPE_CHECKING:
    import torch

    from parity.config import ParityConfig

log = logging.getLogger(__name__)

NOOP, STEP, GATHER, CHECKPOINT, STOP = range(5)
COMMAND_WIDTH = 4  # op + 3 int64 arguments
HEARTBEAT_S = 10.0


def _command_tensor(device: torch.device, op: int = NOOP, *args: int):
    import torch

    values = [op, *args] + [0] * (COMMAND_WIDTH - 1 - len(args))
    return torch.tensor(values, dtype=torch.int64, device=device)


def send_command(device: torch.device, op: int, *args: int) -> None:
    """Rank 0: announce the next collective operation to every rank."""
    import torch.distributed as dist

    dist.broadcast(_command_tensor(device, op, *args), src=0)


def receive_command(device: torch.device) -> tuple[int, list[int]]:
    """Ranks 1..N-1: the next command (op, args); raises when rank 0 is gone or silent too long."""
    import torch.distributed as dist

    tensor = _command_tensor(device)
    dist.broadcast(tensor, src=0)
    op, *args = tensor.tolist()
    return op, args


# ---- rank 0 -------------------------------------------------------------------------------------
class RankZeroTrainer(Trainer):
    """The service's trainer on rank 0 of several: scatters each batch, gathers its measurements,
    and announces every collective (gather for publishing, checkpoint, stop) to the other ranks."""

    def setup_model(self) -> None:
        super().setup_model()
        self.heartbeat_s = min(HEARTBEAT_S, self.config.dist_timeout_s / 4)
        self._command_lock = threading.Lock()
        self._last_command = time.monotonic()
        # True while every rank's next collective is the next command (a NOOP may go). Not yet:
        # the checkpoint load of setup() is a collective no command announces.
        self._followers_waiting = False
        self._followers_stopped = False
        # Every full-weight gather (a publish, the history's first version) is announced first.
        self.announce_gather = lambda: self._command(GATHER, starts_collectives=True)
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeats, name="rank0-heartbeat", daemon=True)
        self._heartbeat.start()

    def setup(self) -> None:
        super().setup()  # its last unannounced collective is the checkpoint load
        self._followers_back()

    def _command(self, op: int, *args: int, starts_collectives: bool = False) -> None:
        with self._command_lock:
            send_command(self.device, op, *args)
            self._last_command = time.monotonic()
            self._followers_waiting = not starts_collectives

    def _followers_back(self) -> None:
        """The collectives the last command started are done here: the followers' next one is the
        next command, so heartbeats may go."""
        with self._command_lock:
            self._followers_waiting = True

    def _heartbeats(self) -> None:
        """A NOOP whenever the followers have waited HEARTBEAT_S for a command; ends with
        `_heartbeat_stop`, after STOP, or when a send fails (a follower gone: the next command of
        the training loop fails the same way and reports it)."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        while not self._heartbeat_stop.wait(self.heartbeat_s / 4):
            with self._command_lock:
                if self._followers_stopped:
                    return
                if not self._followers_waiting or time.monotonic() - self._last_command < self.heartbeat_s:
                    continue
                try:
                    send_command(self.device, NOOP)
                except Exception as exc:  # logged; the loop's next command raises it
                    log.warning("rank 0: heartbeat to the other ranks failed, heartbeats stop: %s", exc)
                    return
                self._last_command = time.monotonic()

    def forward_backward(
        self, sequences: list[ScoredSequence], counts: tuple[int, int] | None = None
    ) -> StepStats:
        """Scatter the batch, run this rank's share, gather every rank's statistics."""
        counts = counts or trainable_counts(sequences)
        shards = scatter.balance(
            sequences, self.world_size, lambda s: len(s.inputs.prompt_ids) + len(s.inputs.completion_ids)
        )
        self._command(STEP, self.state.weight_version, *counts, starts_collectives=True)
        mine = scatter.scatter_sequences(shards, self.device)
        merged = scatter.gather_stats(super().forward_backward(mine, counts), self.device)
        assert merged is not None
        return merged

    def optimizer_step(self, trainable_tokens: int):
        result = super().optimizer_step(trainable_tokens)  # the last collective of a STEP
        self._followers_back()
        return result

    def full_weights(self):
        named = super().full_weights()  # GATHER's collectives
        self._followers_back()
        return named

    def checkpoint(self):
        self._command(CHECKPOINT, self.state.step, starts_collectives=True)
        path = super().checkpoint()
        self._followers_back()
        return path

    def await_workers(self) -> int:
        # The other ranks have no part in it, and it may outlast their collective timeout: stop
        # them first.
        self._stop_followers()
        return super().await_workers()

    def serve_finished(self) -> None:
        self._stop_followers()  # as in await_workers: the wait may outlast their collective timeout
        super().serve_finished()

    def close(self) -> None:
        self._stop_followers()
        self._heartbeat_stop.set()
        self._heartbeat.join(timeout=self.heartbeat_s + self.config.dist_timeout_s)
        super().close()

    def _stop_followers(self) -> None:
        # Only after a clean finish: after a failure a command could wait out the timeout, and
        # torchrun stops the other ranks anyway once this one exits non-zero. Once only.
        if self.finished and not self._followers_stopped:
            with self._command_lock:  # no heartbeat after STOP: the followers are leaving the group
                send_command(self.device, STOP)
                self._followers_stopped = True


# ---- ranks 1..N-1 -------------------------------------------------------------------------------
def follow(run_config: ParityConfig) -> int:
    """A follower rank's whole life: set up like rank 0, then obey commands until STOP."""
    from trainer.checkpoint import CheckpointStore, TrainerState
    from trainer.weight_history import weight_buckets

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 stops us (STOP), or torchrun does (SIGKILL)
    trainer = Trainer(run_config)
    trainer.setup_model()
    store = CheckpointStore(trainer.run_dir, keep=trainer.config.keep_checkpoints)
    store.load(trainer.model, trainer.optimizer, scheduler=trainer.scheduler)
    log.info("rank %d/%d ready", trainer.rank, trainer.world_size)
    steps = 0
    while True:
        op, args = receive_command(trainer.device)
        if op == NOOP:
            continue
        if op == STEP:
            trainer.state.weight_version = args[0]
            share = scatter.scatter_sequences(None, trainer.device)
            scatter.gather_stats(trainer.forward_backward(share, (args[1], args[2])), trainer.device)
            trainer.optimizer_step(args[1])
            steps += 1
        elif op == GATHER:
            for _bucket in weight_buckets(trainer.model, trainer.config.bucket_bytes):
                pass
        elif op == CHECKPOINT:
            store.save(trainer.model, trainer.optimizer, TrainerState(step=args[0]), trainer.scheduler)
        elif op == STOP:
            break
        else:
            raise RuntimeError(f"rank {trainer.rank}: unknown command {op} from rank 0")
    log.info("rank %d: stopped by rank 0 after %d steps", trainer.rank, steps)
    if trainer.config.after_last_step == "serve":
        wait_while_rank_0_serves(trainer.rank)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def wait_while_rank_0_serves(rank: int) -> None:
    """`trainer.after_last_step serve`: rank 0 stays up after the last step, so this rank does too,
    until it is stopped (SIGTERM or SIGINT: the pod deleted, the agent stopping). A rank that
    exited would end its torchrun agent: where that agent runs no rank 0 (another pod of a
    StatefulSet), the pod would be restarted into a rendezvous that can never complete."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("rank %d: idle while rank 0 serves (trainer.after_last_step serve)", rank)
    while not stop.wait(3600):
        pass
