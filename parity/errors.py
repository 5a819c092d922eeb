"""A request refused with a gRPC status code and details that name the bad field.

Validation code raises `RequestError` (`invalid(field, message)` for INVALID_ARGUMENT); the servicer
turns it into `context.abort(error.code, error.details)`, so a bad request never changes state and
never takes a service down. `details` is always "field: message", the convention every Parity
service answers with.
"""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """A refused request: the gRPC code to answer with and "field: message" details."""

    def __init__(self, code: grpc.StatusCode, field: str, message: str) -> None:
        self.code = code
        self.field = field
        self.details = f"{field}: {message}"
        super().__init__(self.details)


def invalid(field: str, message: str) -> RequestError:
    """INVALID_ARGUMENT naming `field`."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, field, message)
