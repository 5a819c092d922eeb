"""A request refused with a gRPC status code and details that name the bad field, and the one map from
any exception a handler lets out to the status a client sees.

Validation code raises `RequestError` (`invalid(field, message)` for INVALID_ARGUMENT,
`overloaded(...)` for RESOURCE_EXHAUSTED with a retry hint). `details` is always "field: message",
the convention every Parity service answers with, and never longer than MAX_DETAILS_BYTES
(`bounded`): details travel in a trailer, and a client refuses a trailer over its metadata limit
(16 KiB by default) with RESOURCE_EXHAUSTED instead of the refusal. A message quotes a client's
value through `quote`, which keeps the first MAX_QUOTE_CHARS of it. The error boundary
(`parity.server`) turns every exception into a status through `status_for`:

  RequestError                          -> its own code and details
  protobuf DecodeError, UnicodeError     -> INVALID_ARGUMENT (malformed bytes, invalid UTF-8)
  vLLM's VLLMValidationError (any VLLMClientError)
                                         -> INVALID_ARGUMENT (the engine's own request checks)
  vLLM's EngineDeadError                 -> UNAVAILABLE (the engine died; retry elsewhere/later)
  anything else                          -> INTERNAL "internal error (trace id ...)": a bug, logged
                                            with the same trace id and its traceback

vLLM classes are matched by name along the exception's MRO, so the core never imports vLLM.
"""

from __future__ import annotations

import grpc

RETRY_AFTER_METADATA_KEY = "retry-after-ms"
MAX_DETAILS_BYTES = 1024  # UTF-8; gRPC percent-encodes non-ASCII, so at most 3 KiB on the wire
MAX_QUOTE_CHARS = 200

# Exception class names (anywhere in the MRO) and the code they map to; see the module docstring.
_BY_CLASS_NAME = {
    "DecodeError": (grpc.StatusCode.INVALID_ARGUMENT, "request"),
    "UnicodeError": (grpc.StatusCode.INVALID_ARGUMENT, "request"),
    "VLLMClientError": (grpc.StatusCode.INVALID_ARGUMENT, "sampling"),
    "EngineDeadError": (grpc.StatusCode.UNAVAILABLE, "engine"),
}


def quote(value: object, limit: int = MAX_QUOTE_CHARS) -> str:
    """`repr` of a client's `value` for an error message, cut to its first `limit` characters."""
    text = value if isinstance(value, str | bytes) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} {'characters' if isinstance(text, str) else 'bytes'})"


def bounded(details: str) -> str:
    """`details` cut to MAX_DETAILS_BYTES of UTF-8, keeping its start (the "field:" prefix)."""
    encoded = details.encode("utf-8", "replace")
    if len(encoded) <= MAX_DETAILS_BYTES:
        return details
    tail = f"... [cut: {len(details)} characters]"
    head = encoded[: MAX_DETAILS_BYTES - len(tail)].decode("utf-8", "ignore")
    return head + tail


class RequestError(Exception):
    """A refused request: the gRPC code to answer with and "field: message" details."""

    def __init__(
        self, code: grpc.StatusCode, field: str, message: str, retry_after_s: float | None = None
    ) -> None:
        self.code = code
        self.field = field
        self.retry_after_s = retry_after_s
        self.details = bounded(f"{field}: {message}")
        super().__init__(self.details)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """`retry-after-ms` for an overload refusal; nothing otherwise."""
        if self.retry_after_s is None:
            return ()
        return ((RETRY_AFTER_METADATA_KEY, str(max(1, round(self.retry_after_s * 1000)))),)


def invalid(field: str, message: str) -> RequestError:
    """INVALID_ARGUMENT naming `field`."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, field, message)


def overloaded(field: str, message: str, retry_after_s: float) -> RequestError:
    """RESOURCE_EXHAUSTED naming the exhausted limit, with a `retry-after-ms` hint (metadata and text)."""
    return RequestError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        field,
        f"{message}; retry after {retry_after_s:.2f}s",
        retry_after_s=retry_after_s,
    )


def status_for(exc: BaseException) -> RequestError | None:
    """The refusal a client sees for `exc`, or None when `exc` is a bug (answer INTERNAL, log it)."""
    if isinstance(exc, RequestError):
        return exc
    for cls in type(exc).__mro__:
        mapped = _BY_CLASS_NAME.get(cls.__name__)
        if mapped is not None:
            code, field = mapped
            text = str(exc).strip() or type(exc).__name__
            return RequestError(code, field, f"{type(exc).__name__}: {text}")
    return None
