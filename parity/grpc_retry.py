"""Which failed gRPC calls a client of a user's service (rewards, environments) tries again.

Invariants:
- UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED are retried: a server that restarts, a
  slow reply, a rate limit. Every other status fails at once.
- Except a message over a size limit. gRPC reports it as RESOURCE_EXHAUSTED too ("Received message
  larger than max (N vs. M)" on the side that refused it, "Sent message larger than max" on the
  sender), and the same call gets the same reply again: it fails at once, its details naming both
  sizes.
"""

from __future__ import annotations

import grpc

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
_OVER_SIZE_LIMIT = "message larger than max"


def retryable(exc: grpc.RpcError) -> bool:
    """Whether the call that raised `exc` may succeed when made again (module docstring)."""
    code = exc.code()  # type: ignore[attr-defined]
    if code not in RETRYABLE:
        return False
    details = exc.details() or ""  # type: ignore[attr-defined]
    return not (code == grpc.StatusCode.RESOURCE_EXHAUSTED and _OVER_SIZE_LIMIT in details.lower())
