"""Admission control of the rollout service's Generate RPCs: a cap on requests and tokens in flight.

An RPC is admitted when, with it, at most `max_requests` RPCs and `max_tokens` tokens are in flight
(a request costs n * (prompt tokens + max_tokens), the most KV it can hold). Otherwise it is refused
at once with RESOURCE_EXHAUSTED and a retry hint (`retry-after-ms` trailing metadata and in the
details). The hint places the refused clients in a virtual queue: the k-th refusal within the last
mean request time is told to come back after (1 + (k-1) / max_requests) x that mean, about when a
slot is free for it, so clients that were refused together come back spread out instead of all at
once (a retry storm that slowed the admitted requests: bench/rollout_load.py). Refusing instead of
queueing keeps the admitted requests' latency near what the engine does with that many sequences,
and tells a client when to come back.

A request over the token budget on its own is still admitted when nothing else is in flight, so a
large but valid request is never refused forever. The actor's in-process groups bypass this cap (it
bounds them itself, `rollout.concurrency`).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator

from parity.errors import overloaded
from rollout import metrics

# Weight of the newest admitted request's duration in the running mean used for retry hints.
_EWMA_WEIGHT = 0.2
_MIN_RETRY_S = 0.05
# The longest hint, in mean request times (a queue of refused clients longer than this many slots'
# worth is told to come back no later than this).
_MAX_RETRY_MEANS = 16.0


class Admission:
    """Counts admitted requests and their token cost; refuses what does not fit."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.requests = 0
        self.tokens = 0
        self.refused_total = 0
        self._mean_s: float | None = None
        self._recent_refusals: deque[float] = deque()  # monotonic times, within the last mean time

    def retry_after_s(self) -> float:
        """The hint for the next refusal: the recent mean time of an admitted request (1 s before
        any has finished), times 1 + (refusals in the last mean time) / max_requests."""
        mean = max(_MIN_RETRY_S, self._mean_s if self._mean_s is not None else 1.0)
        horizon = time.monotonic() - mean
        while self._recent_refusals and self._recent_refusals[0] < horizon:
            self._recent_refusals.popleft()
        ahead = len(self._recent_refusals)
        return mean * min(_MAX_RETRY_MEANS, 1 + ahead / self.max_requests)

    def precheck(self) -> None:
        """Refuse before any work (the request is decoded, not tokenised) when every slot is taken."""
        if self.requests >= self.max_requests:
            self._refuse(
                "in_flight_requests", f"{self.requests} Generate requests in flight (max {self.max_requests})"
            )

    @contextlib.contextmanager
    def admit(self, cost_tokens: int) -> Iterator[None]:
        """Hold a slot for the duration of the block, or raise RESOURCE_EXHAUSTED (RequestError)."""
        self.precheck()
        if self.requests and self.tokens + cost_tokens > self.max_tokens:
            self._refuse(
                "in_flight_tokens",
                f"{self.tokens} tokens in flight + {cost_tokens} requested > max {self.max_tokens}",
            )
        self.requests += 1
        self.tokens += cost_tokens
        metrics.INFLIGHT_REQUESTS.set(self.requests)
        started = time.monotonic()
        try:
            yield
        finally:
            self.requests -= 1
            self.tokens -= cost_tokens
            metrics.INFLIGHT_REQUESTS.set(self.requests)
            took = time.monotonic() - started
            metrics.GENERATE_SECONDS.observe(took)
            self._mean_s = (
                took if self._mean_s is None else (1 - _EWMA_WEIGHT) * self._mean_s + _EWMA_WEIGHT * took
            )

    def _refuse(self, field: str, message: str) -> None:
        self.refused_total += 1
        metrics.REFUSED_REQUESTS.labels(field).inc()
        hint = self.retry_after_s()
        self._recent_refusals.append(time.monotonic())
        raise overloaded(field, message, hint)
