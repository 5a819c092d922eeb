"""Prometheus metrics of the rollout service and its actor (exposed by parity.metrics.serve_metrics).

Counters only go up; `parity_rollout_tokens_per_second` is the generated-token rate over the last
`RATE_WINDOW_S` seconds, refreshed by `TokenRate.tick()` once a second.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import Counter, Gauge, Histogram

RATE_WINDOW_S = 10.0

TOKENS_TOTAL = Counter("parity_rollout_tokens", "Generated completion tokens.")
TOKENS_PER_SECOND = Gauge(
    "parity_rollout_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:.0f} s."
)
GENERATE_SECONDS = Histogram(
    "parity_rollout_generate_duration_seconds",
    "Admitted Generate/GenerateStream RPCs, server side: from admission to the last completion "
    "(refused attempts are not observed; the actor's own groups bypass admission).",
    buckets=(
        0.05,
        0.1,
        0.2,
        0.3,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1,
        1.25,
        1.5,
        2,
        2.5,
        3,
        4,
        5,
        7.5,
        10,
        20,
        60,
        300,
    ),
)
QUEUE_DEPTH = Gauge("parity_rollout_queue_depth", "Rollout groups in Redis not yet consumed by the trainer.")
PAUSE_SECONDS = Counter("parity_rollout_pause_seconds", "Seconds generation was paused for weight updates.")
WEIGHT_VERSION = Gauge("parity_rollout_weight_version", "Weight version this service serves.")
BACKPRESSURE_SECONDS = Counter(
    "parity_rollout_backpressure_wait_seconds", "Seconds the actor waited for the trainer (max_lag)."
)
SURPLUS_GROUPS = Counter(
    "parity_rollout_surplus_groups",
    "Sync mode: groups generated past the step's last published one, returned to the prompt stream "
    "and generated again at the next version.",
)
ZERO_VARIANCE_DROPPED = Counter(
    "parity_rollout_zero_variance_dropped_groups",
    "Groups not published because every sample had the same reward (--skip_zero_variance).",
)
REWARDS_FAILED = Counter(
    "parity_rollout_rewards_failed",
    "Groups dropped because their reward raised, timed out or was not finite, by reason.",
    ["reason"],
)
for _reason in ("error", "timeout", "non_finite"):  # every series exists (at 0) from the start
    REWARDS_FAILED.labels(reason=_reason)
UPDATES = Counter("parity_rollout_weight_updates", "Weight updates by outcome.", ["outcome"])
ACTOR_RESTARTS = Counter("parity_rollout_actor_restarts", "Times the actor loop crashed and was restarted.")
ENGINE_RESTARTS = Counter(
    "parity_rollout_engine_restarts",
    "Times the engine died (its engine-core process exited) and was restarted.",
)
REGENERATED_GROUPS = Counter(
    "parity_rollout_regenerated_groups", "Actor groups lost with a dead engine and generated again."
)
UNPUBLISHED_GROUPS = Counter(
    "parity_rollout_unpublished_groups",
    "Actor groups generated and scored whose publish failed (Redis out past its outage limit): lost, "
    "and the actor loop restarts.",
)
INFLIGHT_REQUESTS = Gauge("parity_rollout_inflight_requests", "Generate RPCs admitted and not yet finished.")
REFUSED_REQUESTS = Counter(
    "parity_rollout_refused_requests",
    "Generate RPCs refused with RESOURCE_EXHAUSTED, by the limit they hit.",
    ["limit"],
)


# Measurements, not counts: NaN until something measures them (the actor's first backlog read, the
# engine loaded, a second rate sample), never a 0 that reads as measured.
for _gauge in (QUEUE_DEPTH, WEIGHT_VERSION, TOKENS_PER_SECOND):
    _gauge.set(float("nan"))


class TokenRate:
    """Sliding-window tokens/s from the running token total."""

    def __init__(self) -> None:
        self.total = 0
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, num_tokens: int) -> None:
        self.total += num_tokens
        TOKENS_TOTAL.inc(num_tokens)

    def tick(self) -> float:
        now = time.monotonic()
        self._samples.append((now, self.total))
        while self._samples and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        first_t, first_total = self._samples[0]
        rate = (self.total - first_total) / (now - first_t) if now > first_t else float("nan")
        TOKENS_PER_SECOND.set(rate)
        return rate


EPISODES = Counter("parity_rollout_episodes", "Multi-turn episodes by end reason.", ["end"])
EPISODE_TURNS = Counter("parity_rollout_episode_model_turns", "Model turns taken in episodes.")
EPISODE_GROUPS_DROPPED = Counter(
    "parity_rollout_episode_groups_dropped",
    "Episode groups dropped, never scored: an environment failed (reason), or a model token differed "
    "from the engine's (token_mismatch).",
    ["reason"],
)
RETOKENIZATION_DRIFT = Counter(
    "parity_rollout_retokenization_drift_tokens",
    "Episode tokens a decode-then-encode round trip would have changed (avoided: tokens are kept).",
)
