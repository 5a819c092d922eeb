"""Held-out evaluation during a run: before training, every `task.eval_every` steps, and after.

A task of completions is scored by commands/run/evaluation.py (greedy answers, the run's reward);
an environment task plays greedy episodes (commands/run/episode_eval.py). Either way the result
records which weight versions answered.
"""

from __future__ import annotations

from commands.run.console import log
from parity.config import ParityConfig


def run_eval(cfg: ParityConfig, task: object, address: str, label: str, step: int) -> dict:
    from parity import models

    t = cfg.task
    if getattr(task, "is_environment", False):
        from commands.run.episode_eval import evaluate_episodes

        result = evaluate_episodes(
            address,
            task,
            t.eval_size,
            t.eval_tokens,
            label,
            tokenizer_dir=str(models.resolve(cfg.model.name)),
            chat_template=t.chat_template,
            system_prompt=t.system_prompt,
            max_turns=t.max_turns,
            max_episode_tokens=t.max_episode_tokens,
            max_model_len=cfg.rollout.max_model_len,
        )
    else:
        result = _evaluate_completions(cfg, task, address, label, step)
    return _report_eval(cfg, result, label, step)


def _evaluate_completions(cfg: ParityConfig, task: object, address: str, label: str, step: int):
    from commands.run.evaluation import evaluate
    from parity import models
    from parity.v1 import common_pb2
    from rollout.rewards import build_scorer

    t = cfg.task
    return evaluate(
        address,
        task,
        t.eval_size,
        t.eval_tokens,
        use_chat_template=t.chat_template,
        label=label,
        scorer=build_scorer(task, t),  # type: ignore[arg-type]
        system_prompt=t.system_prompt,
        tokenizer_dir=str(models.resolve(cfg.model.name)),
        pass_k=t.eval_pass_k,
        sampling=common_pb2.SamplingParams(
            temperature=t.temperature, top_p=t.top_p, top_k=t.top_k, seed=cfg.run.seed * 1_000_003 + step + 1
        ),
    )


def _report_eval(cfg: ParityConfig, result, label: str, step: int) -> dict:
    t = cfg.task

    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    pass_k = f", pass@{t.eval_pass_k} {pct(result.pass_at_k)}" if t.eval_pass_k else ""
    failed = f", {result.rewards_failed} rewards failed" if result.rewards_failed else ""
    log(
        f"held-out accuracy {label}: {pct(result.accuracy)}{pass_k}{failed} ({result.num_prompts} prompts, "
        f"greedy, weight versions {result.weight_versions}, {result.seconds:.0f}s)"
    )
    return {**result.as_dict(), "step": step}


class PeriodicEval:
    """task.eval_every: the held-out evaluation every N trainer steps while training goes on (the
    weight versions that answered are recorded; the last step is left to the final evaluation)."""

    def __init__(self, cfg: ParityConfig, task: object, address: str, evals: list[dict]) -> None:
        self.cfg, self.task, self.address, self.evals = cfg, task, address, evals
        self.done: set[int] = set()

    def __call__(self, step: int) -> None:
        every = self.cfg.task.eval_every
        if not (every and self.cfg.task.eval_size) or step % every or step >= self.cfg.run.steps:
            return
        if step not in self.done:
            self.done.add(step)
            self.evals.append(run_eval(self.cfg, self.task, self.address, f"step {step}", step))
