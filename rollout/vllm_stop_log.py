"""vLLM's log lines about an engine core that ends with its service's stop, said as what they are.

A stop that signals the service's whole process group (`parity run`, `parity.procs.stop_groups`)
reaches vLLM's engine core at the moment it reaches the service. The engine core aborts the
requests it holds and those that reach it while it stops (they end with finish reason `abort`), and
exits once idle. A request that reaches it after its last pass over its input queue is never
answered: the service's vLLM client sees the engine-core process gone and fails that request with
EngineDeadError, which the service answers UNAVAILABLE. That is the stop working, but vLLM's client
says it as a crash: "engine core exited unexpectedly" and "AsyncLLM output_handler failed" with a
traceback at ERROR.

`quiet_engine_stop()` installs a filter on those two vLLM loggers. Before the service has begun to
stop, the filter changes nothing: an engine core that dies while the service runs is a crash and is
logged as vLLM logs it (the service restarts the engine). Once `service_stopping()` has been called
(from the service's SIGTERM handler, which runs before the engine core can finish its step and
exit), those two lines become one INFO line each, and only those two: any other error is logged
unchanged.
"""

from __future__ import annotations

import logging

# (vLLM logger, start of the message it logs when its engine core is gone) -> what it means here
_STOP_LINES = {
    ("vllm.v1.engine.core_client", "[shutdown] MPClient: engine core exited unexpectedly"): (
        "vLLM engine core exited with the service's stop"
    ),
    ("vllm.v1.engine.async_llm", "AsyncLLM output_handler failed"): (
        "vLLM engine core stopped with the service; requests it had not answered end UNAVAILABLE"
    ),
}


class _EngineStopFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.stopping:
            return True
        for (logger_name, start), said in _STOP_LINES.items():
            if record.name != logger_name or not str(record.msg).startswith(start):
                continue
            if record.exc_info and type(record.exc_info[1]).__name__ != "EngineDeadError":
                return True  # another failure: a real error, logged unchanged
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args = said, ()
            record.exc_info, record.exc_text = None, None
        return True


_FILTER = _EngineStopFilter()


def quiet_engine_stop() -> None:
    """Install the filter on vLLM's client loggers (idempotent; inert until `service_stopping`)."""
    for logger_name in {name for name, _ in _STOP_LINES}:
        logger = logging.getLogger(logger_name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def service_stopping() -> None:
    """The service has begun to stop: an engine core that now exits is part of the stop."""
    _FILTER.stopping = True
