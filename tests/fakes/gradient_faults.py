"""Test-only fault: chosen training steps of an in-process `Trainer` get a NaN gradient.

A gradient hook on one trainable parameter replaces its gradient with NaN while the trainer is in
one of `steps` (numbered as in metrics.jsonl, from 1). The trainer's own clip then reports a
non-finite norm, exactly as a real overflow would. Product code has no such hook.
"""

from __future__ import annotations

from collections.abc import Iterable


class NanGradients:
    """Poison the gradients of `steps`; `remove()` takes the hook off."""

    def __init__(self, trainer, steps: Iterable[int]) -> None:
        self.trainer = trainer
        self.steps = set(steps)
        self.poisoned_steps: set[int] = set()
        param = next(p for p in trainer.model.parameters() if p.requires_grad)
        self._handle = param.register_hook(self._hook)

    def _hook(self, grad):
        import torch

        step = self.trainer.state.step + 1  # the step being taken
        if step not in self.steps:
            return grad
        self.poisoned_steps.add(step)
        return torch.full_like(grad, float("nan"))

    def remove(self) -> None:
        self._handle.remove()
