"""Python environments that tests/test_environments.py loads by name (`env:tests.fakes.environments:...`)
or wraps in LocalEnv: a well-behaved counter made by a plain function, and environments that fail in
each way the runner must survive (raise, hang, oversized, malformed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

# Set by a test's teardown so that hung environment threads return.
RELEASE = threading.Event()
HANG_S = 60.0


class CountTo:
    """Say the numbers 1, 2, ... up to the record's target, one per turn: 1.0 at the end, 0 on a slip.

    The class carries the records; `make_count_to` (a plain function) returns instances, so loading
    `env:tests.fakes.environments:make_count_to` finds the records on the returned class.
    """

    @staticmethod
    def train_records(seed: int) -> Iterator[dict]:
        index = seed
        while True:
            target = 2 + index % 3
            yield {"id": f"count-{target}", "target": target}
            index += 1

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [{"id": "count-9", "target": 9}][:n]

    def reset(self, record: Mapping[str, Any]) -> str:
        self.target, self.said = int(record["target"]), 0
        return f"Count to {self.target}, one number per turn. Start with 1."

    def step(self, action: str) -> tuple[str, float, bool]:
        if action.strip() != str(self.said + 1):
            return f"Expected {self.said + 1}.", 0.0, True
        self.said += 1
        if self.said == self.target:
            return "Done.", 1.0, True
        return "Next.", 0.0, False


def make_count_to() -> CountTo:
    return CountTo()


class _Plain:
    def reset(self, record: Mapping[str, Any]) -> str:
        return "go"

    def step(self, action: str) -> Any:
        return "ok", 0.0, False


def no_records() -> _Plain:
    """A factory whose environments carry no records (loading must say so, naming task.name)."""
    return _Plain()


def not_an_environment() -> dict:
    return {"reset": "no"}


INSTANCE = CountTo()  # an instance, not a factory: episodes would share its state


class Raises(_Plain):
    def step(self, action: str) -> Any:
        raise ValueError("the environment broke")


class RaisesOnReset(_Plain):
    def reset(self, record: Mapping[str, Any]) -> str:
        raise KeyError("target")


class Hangs(_Plain):
    def step(self, action: str) -> Any:
        RELEASE.wait(HANG_S)
        return "late", 0.0, False


class Oversized(_Plain):
    def step(self, action: str) -> Any:
        return "x" * 100_000, 0.0, False


class NotAString(_Plain):
    def step(self, action: str) -> Any:
        return 42, 0.0, False


class NaNReward(_Plain):
    def step(self, action: str) -> Any:
        return "ok", float("nan"), False


class StringReward(_Plain):
    def step(self, action: str) -> Any:
        return "ok", "1.0", False


class TwoValues(_Plain):
    def step(self, action: str) -> Any:
        return "ok", 1.0


class DoneNotBool(_Plain):
    def step(self, action: str) -> Any:
        return "ok", 1.0, "yes"


class ResetNotAString(_Plain):
    def reset(self, record: Mapping[str, Any]) -> Any:
        return ["a", "list"]


class MutatesRecord(_Plain):
    def reset(self, record: Any) -> str:
        record["id"] = "changed"
        record["nested"].append(1)
        return "go"


class CloseRaises(CountTo):
    def close(self) -> None:
        raise RuntimeError("close broke")
