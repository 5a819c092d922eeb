"""`parity serve rollout` and `parity actor`: start the RolloutService (services/rollout/service.py)
around one engine, the membership link to the broadcast service, and the actor loop.

Startup: the gRPC port binds NOT_SERVING, the engine loads, the worker registers with the broadcast
service (when configured) and serves once caught up; SIGTERM/SIGINT drains in-flight requests for
`shutdown_grace_s`. A crashed actor loop restarts after a capped backoff, NOT_SERVING meanwhile,
up to `rollout.actor_restart_attempts` crashes in a row; a dead engine likewise, up to
`rollout.engine_restart_attempts` failures in a row (services/rollout/service.py). When either budget
is used up the service logs one line naming the component and the last cause, stops and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from parity import procs, tracing
from parity.config import ParityConfig
from parity.config.entry import entrypoint
from parity.metrics import serve_metrics
from parity.process_exit import serve_then_exit
from parity.server import GrpcServer, install_shutdown_handlers
from parity.v1 import rollout_pb2_grpc
from parity.weights.membership_client import MembershipClient, MembershipRefused
from rollout import metrics
from services.rollout.service import PROTECTED_METHODS, SERVICE_NAME, RolloutServicer, build_engine

log = logging.getLogger("parity.rollout")

ACTOR_RESTART_START_S = 1.0
ACTOR_RESTART_CAP_S = 30.0  # a loop that ran 10 x the cap starts a fresh count of crashes in a row


async def supervise_actor(
    actor,
    servicer: RolloutServicer,
    attempts: int,
    start_s: float = ACTOR_RESTART_START_S,
    cap_s: float = ACTOR_RESTART_CAP_S,
) -> str:
    """Run the actor loop; when it crashes, NOT_SERVING, then restart it after a capped backoff.

    Returns "" when the loop finished, or a one-line error naming the component and the last cause
    once `attempts` crashes in a row used up the budget (the service then stops and exits 1)."""
    delay_s, crashes = start_s, 0
    while not servicer.shutting_down:
        started = time.monotonic()
        try:
            await actor.run()
            return ""  # finished (max_groups) or shutting down
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            servicer.actor_failed = True
            await servicer.refresh_serving()
            metrics.ACTOR_RESTARTS.inc()
            if time.monotonic() - started > 10 * cap_s:
                delay_s, crashes = start_s, 0  # it ran a long while: a fresh fault
            crashes += 1
            if crashes >= attempts:
                return (
                    f"rollout actor: gave up after {crashes} crashes in a row (restart budget {attempts}); "
                    f"last cause: {type(exc).__name__}: {exc}"
                )
            log.error(
                "actor loop crashed (%r); restarting in %.1fs (restart %d of %d)",
                exc,
                delay_s,
                crashes,
                attempts - 1,
            )
            await asyncio.sleep(delay_s)
            delay_s = min(cap_s, 2 * delay_s)
            servicer.actor_failed = False
            await servicer.refresh_serving()
    return ""


async def serve(run_config: ParityConfig, model_dir: Path) -> int:
    tracing.init("parity-rollout")
    config = run_config.rollout
    settings = config.parity_settings(run_config.model.name)
    log.info("parity settings: %s", json.dumps(settings, sort_keys=True))
    if config.effective_head_dtype == "bfloat16":
        log.warning("bf16 head: expect ~2x the train-inference mismatch of an fp32 head")
    if config.logprobs_mode == "raw":
        log.warning("raw logprobs: they do NOT match the sampled distribution (temperature/top-k/top-p)")
    engine = build_engine(config, model_dir, run_config.engine_seed())
    servicer = RolloutServicer(run_config, engine, model_dir)
    server = GrpcServer(config, [SERVICE_NAME], protected_methods=PROTECTED_METHODS)
    servicer.server = server
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server.server)
    from parity.rollout_queue import connection_gauge

    connection_gauge("parity_rollout_redis_connected")  # NaN unless the actor talks to Redis
    metrics_port = serve_metrics(config.metrics_port, config.host)
    if metrics_port > 0:
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_port)
    port = await server.start()  # NOT_SERVING until the engine is loaded and caught up
    background: list[asyncio.Task] = []
    stopped = asyncio.Event()
    gave_up: list[str] = []  # a recovery loop gave up (its one-line error): the service exits 1
    stopping: list[asyncio.Future] = []  # the shutdown a give-up started, held: not collected mid-run
    stop_began: list[float] = []  # when shutdown() began, for the last log line
    openai_server = None  # services/rollout/openai_api.py, when rollout.openai_port is not -1

    async def shutdown() -> None:
        # New RPCs get UNAVAILABLE ("shutting down") from here on; in-flight groups get the grace
        # period to finish before the server stops. Once only (a signal and a give-up may both ask).
        if servicer.shutting_down:
            return
        servicer.shutting_down = True
        stop_began.append(time.monotonic())
        engine.service_stopping()  # before a group stop's engine core can exit (rollout/vllm_stop_log.py)
        await servicer.refresh_serving()
        await server.set_serving(False)
        for task in background:
            task.cancel()
        deadline = time.monotonic() + config.shutdown_grace_s
        while engine.num_running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if openai_server is not None:
            await openai_server.stop()
        await server.stop(0.5)
        stopped.set()

    def give_up(message: str) -> None:
        """A recovery budget is used up: one line naming the component and the last cause, then stop."""
        log.error("%s", message)
        gave_up.append(message)
        if not servicer.shutting_down and not stopping:
            stopping.append(asyncio.ensure_future(shutdown()))

    servicer.on_give_up = give_up
    install_shutdown_handlers(shutdown)
    procs.children_die_with_this_process()  # vLLM's engine core, when forked (parity.procs)
    started = time.monotonic()
    try:
        await servicer.start_engine()  # again if its engine core is killed while it starts
    except Exception as exc:
        # The engine refused its settings or its checkpoint (or its restart budget ran out): the
        # cause is logged once and the gRPC server stopped on this loop, then the service exits 1.
        log.exception("rollout engine: failed to start: %s: %s", type(exc).__name__, exc)
        await server.stop(0)
        return 1
    log.info(
        "%s engine loaded in %.1fs; serving weight version %d",
        config.engine,
        time.monotonic() - started,
        engine.weight_version,
    )
    metrics.WEIGHT_VERSION.set(engine.weight_version)
    address = f"{config.host}:{port}"
    if config.openai_port >= 0 and not servicer.shutting_down:
        from services.rollout.openai_api import start_openai_server

        openai_server = await start_openai_server(run_config, servicer)

    async def tick() -> None:
        while True:
            servicer.rate.tick()
            servicer.watch_engine()
            await servicer.refresh_serving()  # follows Redis, the actor loop and the engine
            await asyncio.sleep(0.5)

    background.append(asyncio.create_task(tick()))
    if config.broadcast_address:

        async def caught_up_to(latest_version: int) -> None:  # serve once at the latest version
            servicer.required_version = max(servicer.required_version, latest_version)
            servicer.registered = True
            await servicer.refresh_serving()

        link = MembershipClient(
            broadcast_address=config.broadcast_address,
            worker_id=config.worker_id or address,
            address=address,
            auth_token=config.auth_token,
            heartbeat_interval_s=config.heartbeat_interval_s,
            weight_version=lambda: engine.weight_version,
            on_registered=caught_up_to,
            device_uuid=await engine.device_uuid(),
        )
        servicer.membership = link
        membership = asyncio.create_task(link.run())
        background.append(membership)

        def membership_done(task: asyncio.Task) -> None:  # refused for good: say which setting, stop
            if not task.cancelled() and isinstance(task.exception(), MembershipRefused):
                give_up(f"rollout service: {task.exception()}")

        membership.add_done_callback(membership_done)
    await servicer.refresh_serving()
    if config.actor:
        from rollout.actor import Actor

        supervised = asyncio.create_task(
            supervise_actor(Actor(run_config, servicer), servicer, config.actor_restart_attempts)
        )
        background.append(supervised)

        def actor_done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None and task.result():
                give_up(task.result())

        supervised.add_done_callback(actor_done)
    await stopped.wait()
    if config.broadcast_address:
        await link.unregister()
    await engine.shutdown()
    if servicer._recovery is not None and not servicer._recovery.done():
        # a restart in progress: the engine it is building is shut down as soon as it is built
        await asyncio.wait({servicer._recovery}, timeout=config.shutdown_grace_s)
    # only shutdown() sets `stopped`, so the stop's start is always recorded here
    log.info("rollout service stopped (%.1fs after the stop began)", time.monotonic() - stop_began[0])
    return 1 if gave_up else 0


def main(argv: Sequence[str]) -> int:
    def body(config: ParityConfig) -> int:
        if config.rollout.actor and not config.run.redis_url:
            print(
                "parity serve rollout: error: run.redis_url: required when rollout.actor is on",
                file=sys.stderr,
            )
            return 2
        from parity import models

        try:
            model_dir = models.resolve(config.model.name)
        except models.ModelError as exc:
            print(f"parity serve rollout: error: {exc}", file=sys.stderr)
            return 2
        # Ended without waiting for leftover executor threads: a rendezvous still waiting for its
        # group would otherwise hold the stopped service for its timeout_s (parity.process_exit).
        serve_then_exit(serve(config, model_dir))

    return entrypoint("parity serve rollout", "rollout", list(argv), body)


def main_actor(argv: Sequence[str]) -> int:
    """`parity actor FLAGS`: the rollout service with its actor loop on (same flags)."""
    return main(["--rollout.actor", "true", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
