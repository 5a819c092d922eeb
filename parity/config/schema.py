"""`ParityConfig`: the one config of a run, composed of one section per component.

    [model]          what every component loads as version 0         parity/config/model.py
    [task]           prompts, reward, sampling of training rollouts   parity/config/task.py
    [run]            the shared schedule and the `parity run` launcher parity/config/run.py
    [rollout]        the rollout service and its actor                parity/config/rollout.py
    [trainer]        the trainer service                              parity/config/trainer.py
    [broadcast]      the weight-broadcast service                     parity/config/broadcast.py
    [check]          `parity check`                                   parity/config/check.py
    [observability]  logs and traces                                  parity/config/observability.py

Every default is defined once, on its field. Checks that span sections live here and name the key
they reject. Loading (file, environment, flags) is `parity.config.loader`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from parity.config.broadcast import BroadcastConfig
from parity.config.check import CheckConfig
from parity.config.model import ModelConfig
from parity.config.observability import ObservabilityConfig
from parity.config.rollout import RolloutConfig
from parity.config.run import RunConfig
from parity.config.task import TaskConfig
from parity.config.trainer import TrainerConfig


class ParityConfig(BaseModel):
    """Every setting of a run. `parity run --print-config` prints it with the source of each value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    broadcast: BroadcastConfig = Field(default_factory=BroadcastConfig)
    check: CheckConfig = Field(default_factory=CheckConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)

    @model_validator(mode="after")
    def _consistent(self) -> ParityConfig:
        run, task, rollout = self.run, self.task, self.rollout
        if run.publish_every > run.steps:
            raise ValueError("run.publish_every: must be <= run.steps, or no new weights are ever published")
        if run.mode == "sync" and run.groups_per_step % run.rollout_workers:
            raise ValueError(
                f"run.groups_per_step: in sync mode it must be divisible by run.rollout_workers "
                f"({run.rollout_workers}) so that every worker generates the same share"
            )
        if run.mode == "sync" and run.publish_every != 1:
            raise ValueError(
                "run.publish_every: sync mode publishes every step (generate -> train -> update)"
            )
        if rollout.fault.partition("@")[0] == "one_worker_not_updated" and run.rollout_workers < 2:
            raise ValueError(
                "rollout.fault: one_worker_not_updated acts on the second rollout worker (worker_index 1): "
                "needs run.rollout_workers >= 2"
            )
        if task.group_size > rollout.max_n:
            raise ValueError(f"task.group_size: must be <= rollout.max_n={rollout.max_n}")
        if task.eval_pass_k > rollout.max_n:  # the held-out evaluation asks for eval_pass_k samples at once
            raise ValueError(f"task.eval_pass_k: must be <= rollout.max_n={rollout.max_n}")
        for key, tokens in (
            ("task.max_tokens", task.max_tokens),
            ("task.eval_max_tokens", task.eval_tokens),
            ("check.max_tokens", self.check.max_tokens),
        ):
            if tokens > rollout.effective_max_tokens:
                raise ValueError(
                    f"{key}: must be <= {rollout.effective_max_tokens} "
                    "(rollout.max_tokens_limit, or rollout.max_model_len - 1)"
                )
        return self

    def engine_seed(self) -> int:
        """The seed of this rollout service's engine: distinct per worker, fixed by run.seed."""
        return self.run.seed + self.rollout.worker_index


SECTIONS: dict[str, type[BaseModel]] = {
    name: field.default_factory
    for name, field in ParityConfig.model_fields.items()  # type: ignore[misc]
}
