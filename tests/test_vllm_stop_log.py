"""vLLM's "engine core gone" lines are INFO once the service is stopping, and unchanged before.

tests/test_rollout_stop.py stops a real service; the race that makes vLLM log these lines (a request
that reaches the engine core after its last step) is rare there, so the filter is checked here on
the real vLLM loggers, and against vLLM's installed source: if vLLM stops logging these exact lines,
the filter would silently match nothing.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import pytest
from vllm.v1.engine.exceptions import EngineDeadError

from rollout import vllm_stop_log


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setattr(vllm_stop_log._FILTER, "stopping", False)
    vllm_stop_log.quiet_engine_stop()
    handler = _Records()
    loggers = [logging.getLogger(name) for name, _ in vllm_stop_log._STOP_LINES]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.records
    for logger in loggers:
        logger.removeHandler(handler)


def _log_engine_gone(exc: Exception) -> None:
    logging.getLogger("vllm.v1.engine.core_client").warning(
        "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup"
    )
    try:
        raise exc
    except Exception:
        logging.getLogger("vllm.v1.engine.async_llm").exception("AsyncLLM output_handler failed.")


def test_vllm_still_logs_the_lines_the_filter_matches() -> None:
    for logger_name, start in vllm_stop_log._STOP_LINES:
        source = inspect.getsource(importlib.import_module(logger_name))
        assert f'"{start}' in source, f"{logger_name} no longer logs {start!r}"


def test_before_a_stop_an_engine_core_death_is_logged_as_vllm_logs_it(captured) -> None:
    _log_engine_gone(EngineDeadError())
    assert [r.levelname for r in captured] == ["WARNING", "ERROR"]
    assert captured[1].exc_info is not None


def test_during_a_stop_it_is_one_info_line_each_and_other_errors_stay_errors(captured) -> None:
    vllm_stop_log.service_stopping()
    _log_engine_gone(EngineDeadError())
    assert [(r.levelname, r.exc_info) for r in captured] == [("INFO", None), ("INFO", None)]
    assert "UNAVAILABLE" in captured[1].getMessage()
    _log_engine_gone(RuntimeError("a bug in the output handler"))
    assert [r.levelname for r in captured[2:]] == ["INFO", "ERROR"]
    assert captured[3].exc_info is not None
