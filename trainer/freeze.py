"""Frozen parameters (`trainer.freeze`): named by fnmatch patterns, never trained.

A frozen parameter gets no gradient and no optimizer state, so every published version carries it
unchanged; with `broadcast.delta_updates` the broadcast service then sends only the blocks that did
change (broadcast/delta.py). Tied weights share one parameter: freezing the embedding of a
tied model freezes its output head too.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import TYPE_CHECKING

from parity.config.base import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def patterns(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def freeze_parameters(model: torch.nn.Module, spec: str) -> list[str]:
    """Turn off requires_grad for every parameter matching a pattern of `spec`; returns their names.
    A pattern that matches nothing is a config error naming trainer.freeze."""
    wanted = patterns(spec)
    if not wanted:
        return []
    names = [name for name, _ in model.named_parameters()]
    for pattern in wanted:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"trainer.freeze: pattern {pattern!r} matches no parameter of the model "
                f"(names look like {names[0]!r})"
            )
    frozen = []
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in wanted):
            param.requires_grad_(False)
            frozen.append(name)
    total = sum(p.numel() for p in model.parameters())
    kept = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    log.info("frozen: %d parameters (%.1f%% of the weights) by %s", len(frozen), 100 * kept / total, wanted)
    return frozen
