"""`parity serve trainer`: the trainer loop behind parity.v1.TrainerService.

Lifecycle: load the run config (the `trainer` section plus the shared `model` and `run`; a bad value
-> exit 2 naming the key) -> bind gRPC (NOT_SERVING) -> load
model, restore checkpoint, rewind the stream (in a worker thread) -> SERVING -> train `steps` steps
-> final publish + checkpoint -> NOT_SERVING -> exit 0, without interpreter teardown
(parity.process_exit). With `trainer.after_last_step serve` it stays SERVING after the last
checkpoint (status, catch-ups) until SIGTERM, for orchestrators that restart a container that exits
0. SIGTERM/SIGINT and `Stop` finish the current step, publish, checkpoint and exit 0. A crash in the
loop exits 1.

RPCs: services/trainer/service.py (RequestCheckpoint and Stop are token-protected). Health is NOT_SERVING while Redis is unreachable: the queue retries with capped backoff
(parity.rollout_queue, "Redis outages") and training continues where it was once Redis is back.

Several ranks (`trainer.nproc` > 1, trainer/launch.py): the process re-launches itself under
torchrun; rank 0 is this service (RankZeroTrainer), the other ranks run `multirank.follow` and
never bind a port or touch Redis (trainer/multirank.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from parity import tracing
from parity.config import ParityConfig
from parity.config.entry import entrypoint
from parity.metrics import serve_metrics
from parity.process_exit import exit_after_shutdown
from parity.server import GrpcServer, install_shutdown_handlers
from parity.v1 import trainer_pb2_grpc
from services.trainer.service import PROTECTED_METHODS, SERVICE_NAME, TrainerServicer
from trainer.mismatch_gate import MismatchGateError

log = logging.getLogger("parity.trainer")


async def serve(run_config: ParityConfig) -> int:
    from trainer.fsdp import world

    tracing.init("parity-trainer")
    config = run_config.trainer
    if world()[1] > 1:
        from trainer.multirank import RankZeroTrainer as Trainer
    else:
        from trainer.loop import Trainer
    trainer = Trainer(run_config)
    server = GrpcServer(config, [SERVICE_NAME], protected_methods=PROTECTED_METHODS)
    trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(trainer, config), server.server)
    await server.start()
    metrics_port = serve_metrics(config.metrics_port, config.host)
    if metrics_port > 0:
        log.info("metrics on %s:%d/metrics", config.host, metrics_port)

    async def on_shutdown() -> None:
        log.info("shutdown requested: finishing the current step")
        trainer.request_stop()

    install_shutdown_handlers(on_shutdown)
    loop = asyncio.get_running_loop()
    rc = 0

    from parity.rollout_queue import connection_gauge, redis_connected

    connection_gauge("parity_trainer_redis_connected")

    async def follow_redis() -> None:  # NOT_SERVING while the queue waits out a Redis outage
        serving = True
        while True:
            await asyncio.sleep(0.5)
            now = redis_connected() is not False
            if now != serving:
                serving = now
                await server.set_serving(serving)

    try:
        await loop.run_in_executor(None, trainer.setup)
        await server.set_serving(True)
        watcher = asyncio.create_task(follow_redis())
        try:
            await loop.run_in_executor(None, trainer.run)
        finally:
            watcher.cancel()
        log.info("done: step %d, version %d", trainer.state.step, trainer.state.weight_version)
        if trainer.finished and config.await_workers:
            await loop.run_in_executor(None, trainer.await_workers)
        if trainer.finished and config.after_last_step == "serve":
            log.info(
                "finished at step %d, version %d; serving status and catch-ups until stopped "
                "(trainer.after_last_step serve)",
                trainer.state.step,
                trainer.state.weight_version,
            )
            await server.set_serving(True)  # Redis no longer matters: the stream is done with
            await loop.run_in_executor(None, trainer.serve_finished)
    except MismatchGateError as exc:
        log.error("training stopped by the running mismatch gate: %s", exc)
        rc = 3
    except Exception:
        log.exception("trainer failed")
        rc = 1
    finally:
        await server.stop(2.0)
        try:
            trainer.close()
        except Exception:  # already failing or never set up
            log.debug("close failed", exc_info=True)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    def body(config: ParityConfig) -> int:
        if not config.run.redis_url:
            print(
                "parity serve trainer: error: run.redis_url: required (the rollout stream)", file=sys.stderr
            )
            return 2
        from trainer import launch

        if config.trainer.nproc > 1 and not launch.under_torchrun():
            return launch.relaunch(config)
        if launch.under_torchrun():
            launch.die_with_agent()
        if launch.under_torchrun() and launch.rank() != 0:
            from trainer.multirank import follow

            return follow(config)
        # A trainer that served has finished its work (checkpoint, last publish, groups closed):
        # it ends without interpreter teardown, which can abort in native code (parity.process_exit).
        rc = asyncio.run(serve(config))
        if launch.under_torchrun():
            from trainer.agent import record_rank0_exit

            record_rank0_exit(rc)  # the agent's exit status after a signal stop
        exit_after_shutdown(rc)

    return entrypoint("parity serve trainer", "trainer", list(sys.argv[1:] if argv is None else argv), body)


if __name__ == "__main__":
    sys.exit(main())
