"""The TrainerService servicer: status, checkpoint and stop requests for the trainer loop.

GetStatus always answers; RequestCheckpoint and Stop change what is persisted, so they are protected
by the shared token (UNAUTHENTICATED without it, services/trainer/server.py registers them with
GrpcServer), answer UNAVAILABLE while the trainer is still loading, and FAILED_PRECONDITION once it
has finished (RequestCheckpoint also while stopping).
"""

from __future__ import annotations

import grpc

from parity.config.trainer import TrainerConfig
from parity.v1 import trainer_pb2, trainer_pb2_grpc

SERVICE_NAME = "parity.v1.TrainerService"
PROTECTED_METHODS = (f"/{SERVICE_NAME}/RequestCheckpoint", f"/{SERVICE_NAME}/Stop")


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, trainer, config: TrainerConfig) -> None:
        self.trainer = trainer
        self.config = config

    async def GetStatus(self, request, context):
        status = self.trainer.status()
        metrics = {
            k: float(v)
            for k, v in status["last_metrics"].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return trainer_pb2.TrainerServiceGetStatusResponse(
            weight_version=status["weight_version"],
            step=status["step"],
            last_metrics=metrics,
            rollouts_trained_total=status["rollouts_trained_total"],
            dropped_stale_total=status["dropped_stale_total"],
            duplicates_skipped_total=status["duplicates_skipped_total"],
            objective=self.config.objective,
            run_dir=self.config.run_dir,
            stopping=self.trainer.stop_event.is_set(),
            finished=self.trainer.finished and self.trainer.state.step >= self.trainer.schedule.steps,
        )

    async def _check_running(self, context, allow_stopping: bool) -> None:
        if not self.trainer.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "trainer: still loading the model/checkpoint")
        if self.trainer.finished:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "trainer: training has finished")
        if not allow_stopping and self.trainer.stop_event.is_set():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "trainer: stopping; a final checkpoint follows"
            )

    async def RequestCheckpoint(self, request, context):
        await self._check_running(context, allow_stopping=False)
        # Mid-step: after this step; while waiting for rollouts: right away, at the current step.
        step = self.trainer.state.step + (1 if self.trainer.in_step else 0)
        self.trainer.request_checkpoint()
        return trainer_pb2.RequestCheckpointResponse(step=step)

    async def Stop(self, request, context):
        await self._check_running(context, allow_stopping=True)
        self.trainer.request_stop()
        return trainer_pb2.StopResponse(step=self.trainer.state.step)
