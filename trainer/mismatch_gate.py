"""The running mismatch gate: the preflight's threshold, applied to every training step.

The preflight (`parity check`, run by `parity run` before training) measures the rollout-vs-trainer
mismatch once. This gate watches the same number during the run: the backend mismatch at each
token's own version over its informative tokens (`mismatch_k3_own_version_informative`,
trainer/step_metrics.py: tokens whose processed distribution is degenerate read 0 on any backend
and would make a broken step look clean). When it exceeds its threshold (`running_threshold`) for
`check.gate_steps` consecutive measured steps (default 1: the first faulty step), `check.on_mismatch`
decides: `stop` raises `MismatchGateError` (the trainer exits, `parity run` stops with its message),
`warn` logs once per streak.

The default threshold depends on the numerics (docs/ab_study.md has the measurements):
  - Float32 on both sides: 1e-6. Clean float32 runs measure 1e-11 to 3e-10 per step, and the
    smallest fault of the catalogue measured 7.8e-5 (a bf16 lm_head).
  - bf16 anywhere (rollout weights or head, trainer precision): the rounding alone is a mismatch,
    noisy per step and model-dependent (clean tiny steps measured up to 2.6e-2; SmolLM2, whose
    preflight read 7.2e-4, reached 1.05e-2 at its 4th step of ~90 tokens). The threshold is
    REDUCED_PRECISION_THRESHOLD, or GATE_MARGIN x the preflight's clean k3 of this engine and model
    where that is larger (`parity run` passes it to the trainer).

Version tags are judged apart from the numbers: a step with any token whose tags no engine can
produce (`version_tag_violations`, parity/versions.py `impossible_tags`: a weight version older
than an earlier token's of its sample, or older than the KV it attended to) makes the gate act at
once. Such tokens are scored at the wrong weights or left out of the own-version check as mixed
context, so the logprob comparison cannot be trusted to see them; a correct engine produces none.

Invariants:
  - A step with nothing measured (NaN: no own-version token, or none informative) neither extends nor breaks a streak: it is not evidence.
  - The message names the number, the threshold, the streak and the usual causes, so a user can act.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)

GATED_METRIC = "mismatch_k3_own_version_informative"
TAG_METRIC = "version_tag_violations"
LIKELY_CAUSES = (
    "prefix-cache KV from older weights (rollout.prefix_caching with reset_prefix_cache_on_update off), "
    "a low-precision lm_head (rollout.head_dtype), raw instead of processed logprobs "
    "(rollout.logprobs_mode), or stale weights in the engine (a weight update that did not land)"
)


FLOAT32_THRESHOLD = 1e-6
REDUCED_PRECISION_THRESHOLD = 1e-1
GATE_MARGIN = 10.0  # x the preflight's clean k3 with reduced precision, where that exceeds 1e-1


def _reduced_precision(run_config) -> list[str]:
    """The settings that put reduced precision into the logprobs either side compares ([] if none)."""
    rollout, trainer = run_config.rollout, run_config.trainer
    return [
        name
        for name, is_reduced in (
            (f"rollout.dtype {rollout.dtype}", rollout.dtype != "float32"),
            (
                f"rollout.head_dtype {rollout.head_dtype}",
                rollout.effective_head_dtype != "float32",
            ),
            (f"trainer.precision {trainer.precision}", trainer.precision != "fp32"),
            (f"trainer.dtype {trainer.dtype}", trainer.dtype != "float32"),
        )
        if is_reduced
    ]


def _measured(k3: float | None) -> bool:
    """Whether the preflight's k3 is a measurement the gate can scale (finite, above zero)."""
    return k3 is not None and math.isfinite(k3) and k3 > 0


def calibrated_threshold(run_config, preflight_k3: float | None) -> float | None:
    """GATE_MARGIN x the preflight's clean k3, where that sets the running gate: reduced precision,
    check.gate_threshold unset, and the product above the reduced-precision default. Else None."""
    if run_config.check.gate_threshold > 0 or not _reduced_precision(run_config):
        return None
    if not _measured(preflight_k3):
        return None
    value = GATE_MARGIN * preflight_k3
    return value if value > REDUCED_PRECISION_THRESHOLD else None


def running_threshold(run_config, preflight_k3: float | None = None) -> tuple[float, str]:
    """(the running gate's threshold, where it comes from) for a ParityConfig; `preflight_k3` is the
    clean mismatch the preflight measured on this engine and model (reduced precision uses it)."""
    if run_config.check.gate_threshold > 0:
        return run_config.check.gate_threshold, "check.gate_threshold"
    reduced = ", ".join(_reduced_precision(run_config))
    if (value := calibrated_threshold(run_config, preflight_k3)) is not None:
        return value, f"{GATE_MARGIN:g}x the preflight's k3 {preflight_k3:.2e} ({reduced})"
    if reduced:
        if _measured(preflight_k3):
            why = f"{GATE_MARGIN:g}x the preflight's k3 {preflight_k3:.2e} is lower"
        else:
            why = "no preflight k3"
        return REDUCED_PRECISION_THRESHOLD, f"default for reduced precision, {why} ({reduced})"
    return FLOAT32_THRESHOLD, "default for float32 rollouts and trainer"


class MismatchGateError(RuntimeError):
    """The running gate stopped training."""


class MismatchGate:
    def __init__(
        self,
        threshold: float,
        steps: int,
        action: Literal["warn", "stop"],
        source: str = "check.gate_threshold",
    ) -> None:
        self.threshold = threshold
        self.source = source
        self.steps = steps
        self.action = action
        self.streak: list[float] = []
        self.tags_flagged = 0  # steps with impossible version tags

    def observe(self, step: int, metrics: dict, explain: Callable[[], str] | None = None) -> str:
        """Feed one step's metrics; returns the warning issued ("" if none). Raises on `stop`.
        When the gate acts, `explain()` (where the mismatch lives, the likely fault classes) is
        appended to its message; a failure there is logged and never hides the gate's verdict."""
        violations = int(metrics.get(TAG_METRIC) or 0)
        if violations > 0:
            message = (
                f"{TAG_METRIC}: {violations} token(s) of step {step} carry weight-version tags no "
                f"engine can produce (a version older than an earlier token's of the same sample, or "
                f"older than the KV it attended to). The rollout engine's version accounting is wrong: "
                f"the trainer would score those tokens at the wrong weights. The running gate acts on "
                f"any such token; --check.on_mismatch warn keeps training."
            )
            first, self.tags_flagged = self.tags_flagged == 0, self.tags_flagged + 1
            return self._act(message, explain if first else None)  # localised once (warn: every step)
        value = metrics.get(GATED_METRIC)
        if value is None or not math.isfinite(float(value)):
            return ""
        if float(value) <= self.threshold:
            self.streak.clear()
            return ""
        self.streak.append(float(value))
        if len(self.streak) < self.steps:
            return ""
        message = (
            f"{GATED_METRIC} exceeded the running gate's threshold {self.threshold:g} ({self.source}) "
            f"for {len(self.streak)} consecutive "
            f"measured steps (up to step {step}: {', '.join(f'{v:.2e}' for v in self.streak[-self.steps :])}). "
            f"The rollout engine's logprobs do not match the trainer's at the weights that sampled them. "
            f"Usual causes: {LIKELY_CAUSES}. --check.on_mismatch warn keeps training; "
            f"--check.gate_threshold sets the threshold."
        )
        if len(self.streak) > self.steps and self.action == "warn":
            return message  # warned once for this streak
        return self._act(message, explain)

    def _act(self, message: str, explain: Callable[[], str] | None) -> str:
        """Localise (`explain`), then raise (`stop`) or log the warning (`warn`)."""
        if explain is not None:
            try:
                message += f" Localisation: {explain()}"
            except Exception as exc:  # the verdict stands without it; say why it is missing
                log.warning("mismatch localisation failed: %r", exc)
                message += f" (localisation failed: {exc!r})"
        if self.action == "stop":
            raise MismatchGateError(message)
        log.warning("running mismatch gate: %s", message)
        return message
