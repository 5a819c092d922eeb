"""The built-in rewards: `exact`, `last_integer` and `math_verify`, each in [0, 1].

Every reward has the user signature `(prompt, completion, answer, metadata) -> float` (prompt is the
prompt text), so a built-in and a `package.module:function` reward are called the same way
(rollout/rewards/scorer.py runs them off the actor's event loop, with a timeout).

  exact         1 when the completion, stripped, equals the answer, stripped; else 0.
  last_integer  1 when the last integer in the completion (thousands commas allowed) equals the
                answer read as an integer; else 0. An answer that is not an integer raises.
  math_verify   1 when the `math-verify` package finds the completion's final expression equal to
                the answer (numbers, fractions, LaTeX); else 0. Its own signal-based timeout is
                off: it would only work on the main thread, and the scorer bounds the call instead.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

RewardFunction = Callable[[str, str, str, Mapping[str, Any]], float]
_INTEGER = re.compile(r"-?\d(?:[\d,]*\d)?")


def exact(prompt: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def _as_int(text: str) -> int:
    return int(text.replace(",", "").strip())


def last_integer(prompt: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    try:
        expected = _as_int(answer)
    except ValueError:
        raise ValueError(f"last_integer: the answer {answer!r} is not an integer") from None
    found = _INTEGER.findall(completion)
    return 1.0 if found and _as_int(found[-1]) == expected else 0.0


def math_verify(prompt: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> float:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every untimed call
    gold = parse(answer, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the answer {answer!r}")
    predicted = parse(completion, parsing_timeout=None)
    return 1.0 if predicted and verify(gold, predicted, timeout_seconds=None) else 0.0


BUILTIN: dict[str, RewardFunction] = {
    "exact": exact,
    "last_integer": last_integer,
    "math_verify": math_verify,
}
