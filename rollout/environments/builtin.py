"""The built-in environments: `env:calculator` (a tool call, then an answer) and `env:guess_number`
(a game with feedback). Both are plain `Environment`s and carry their own records as
`train_records(seed)` / `eval_records(n)`, so `env:rollout.environments.builtin:Calculator` loads the
same thing as `env:calculator`.

Sized for SmolLM2-135M-Instruct on CPU: the model succeeds sometimes, so GRPO groups carry reward
variance. Records are split once into a training pool and a held-out pool by a hash of the record's
content, independent of the seed, so no held-out id ever appears in training at any seed; the
training stream draws from its pool with `random.Random(seed)`.

calculator. The question is "What is A OP B?" with two-digit operands and OP in + - * (A >= B for -).
Each model turn is read for its first tag:
  <calc>EXPR</calc>     the observation is the value ("444"), reward 0. EXPR may hold only digits,
                        + - * / ( ) and whitespace (at most 64 characters); it is parsed, never
                        eval'd; anything else answers "error: ...". At most MAX_TOOL_CALLS calls:
                        one more ends the episode with reward 0.
  <answer>N</answer>    ends the episode: reward 1.0 when N equals the answer, else 0.0.
  neither               one retry: the observation repeats the two forms (reward 0); a second turn
                        with neither is read as a plain answer, its last number (as the arithmetic
                        task reads completions): reward 1.0 when it is the answer, else 0.0. So a
                        model that has not learnt the tags yet still earns a reward now and then,
                        and GRPO has a signal to learn the tool from.
A closing tag may be missing at the very end of a turn (generation stopped at "</calc>").

guess_number. A secret integer in [1, high], high in 8..24, with max_guesses = high.bit_length()
(binary search always wins). Each turn's first integer is the guess; a turn without one, or outside
the range, uses up a guess. Observations: "Higher." / "Lower." with the guesses left. A win on guess
g of k ends the episode with reward 1 - 0.5 * (g - 1) / k (1.0 on the first guess, above 0.5 on the
last: fewer guesses are better); running out ends it with reward 0.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

EVAL_SHUFFLE_SEED = 1_000_003  # the held-out order, the same at every seed


def _held_out(key: str, percent: int) -> bool:
    return hashlib.sha256(key.encode()).digest()[0] * 100 // 256 < percent


def _split(records: Sequence[dict], percent: int) -> tuple[list[dict], list[dict]]:
    """(training pool, held-out pool) by a hash of each record's id."""
    train = [r for r in records if not _held_out(r["id"], percent)]
    held_out = [r for r in records if _held_out(r["id"], percent)]
    random.Random(EVAL_SHUFFLE_SEED).shuffle(held_out)
    return train, held_out


def _stream(pool: Sequence[dict], seed: int) -> Iterator[dict]:
    rng = random.Random(seed)
    while True:
        yield dict(rng.choice(pool))


# --- calculator ----------------------------------------------------------------------------------

MAX_TOOL_CALLS = 3
MAX_EXPRESSION_CHARS = 64
_EXPRESSION_CHARS = re.compile(r"[\d+\-*/()\s]+")
_TAG = re.compile(r"<(calc|answer)>(.*?)(?:</\1>|\Z)", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}

CALCULATOR_INSTRUCTION = (
    "You have a calculator: write <calc>EXPRESSION</calc>, for example <calc>3 * 4</calc>, and you "
    "will get the result. Give your final answer as <answer>NUMBER</answer>."
)
FORMAT_HINT = "Write <calc>EXPRESSION</calc> to calculate, or <answer>NUMBER</answer> to answer."


class UnsafeExpression(ValueError):
    """An expression the calculator refuses; the message is what the model is told."""


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: integers, + - * /, parentheses, unary minus.

    Nothing is eval'd: the characters are checked first, then the parsed tree is walked and every
    node outside that grammar is refused (UnsafeExpression); division by zero too.
    """
    text = expression.strip()
    if not text:
        raise UnsafeExpression("error: empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise UnsafeExpression(f"error: expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _EXPRESSION_CHARS.fullmatch(text):
        raise UnsafeExpression("error: only digits, + - * / ( ) and spaces are allowed")
    try:
        tree = ast.parse(" ".join(text.split()), mode="eval")
    except SyntaxError:
        raise UnsafeExpression("error: not a valid expression") from None

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            divisor = value(node.right)
            if divisor == 0:
                raise UnsafeExpression("error: division by zero")
            return value(node.left) / divisor
        raise UnsafeExpression("error: only + - * / and parentheses are allowed")  # ** and // among them

    return value(tree.body)


def format_number(number: Fraction) -> str:
    """An integer as digits; anything else as a decimal with 10 significant digits."""
    return str(number.numerator) if number.denominator == 1 else format(float(number), ".10g")


def parse_number(text: str) -> Fraction | None:
    """The number in an <answer> (commas allowed), or None when it holds no single number."""
    cleaned = text.replace(",", "").strip()
    return Fraction(cleaned) if _NUMBER.fullmatch(cleaned) else None


def _calculator_records() -> list[dict]:
    records = []
    for a in range(10, 100):
        for b in range(10, 100):
            for op in "+-*":
                if op == "-" and a < b:
                    continue
                answer = {"+": a + b, "-": a - b, "*": a * b}[op]
                records.append(
                    {"id": f"calc-{a}{op}{b}", "question": f"What is {a} {op} {b}?", "answer": answer}
                )
    return records


_CALCULATOR_TRAIN, _CALCULATOR_EVAL = _split(_calculator_records(), percent=5)


class Calculator:
    """`env:calculator` (module docstring). Record: {"id", "question", "answer": int}."""

    name = "calculator"

    def __init__(self) -> None:
        self.answer = Fraction(0)
        self.tool_calls = 0
        self.format_retries_left = 1

    @staticmethod
    def train_records(seed: int) -> Iterator[dict]:
        return _stream(_CALCULATOR_TRAIN, seed)

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [dict(r) for r in _CALCULATOR_EVAL[:n]]

    def reset(self, record: Mapping[str, Any]) -> str:
        self.answer = Fraction(record["answer"])
        self.tool_calls, self.format_retries_left = 0, 1
        return f"{record['question']}\n{CALCULATOR_INSTRUCTION}"

    def step(self, action: str) -> tuple[str, float, bool]:
        tag = _TAG.search(action)
        if tag is None:
            if self.format_retries_left > 0:
                self.format_retries_left -= 1
                return FORMAT_HINT, 0.0, False
            numbers = _NUMBER.findall(action.replace(",", ""))
            given = parse_number(numbers[-1]) if numbers else None
            correct = given is not None and given == self.answer
            return ("Correct." if correct else "Wrong."), (1.0 if correct else 0.0), True
        kind, body = tag.groups()
        if kind == "answer":
            given = parse_number(body)
            correct = given is not None and given == self.answer
            return ("Correct." if correct else "Wrong."), (1.0 if correct else 0.0), True
        self.tool_calls += 1
        if self.tool_calls > MAX_TOOL_CALLS:
            return "Too many calculator calls.", 0.0, True
        try:
            return format_number(calculate(body)), 0.0, False
        except UnsafeExpression as exc:
            return str(exc), 0.0, False


# --- guess_number --------------------------------------------------------------------------------

_INTEGER = re.compile(r"-?\d+")


def _guess_records() -> list[dict]:
    return [
        {"id": f"guess-{high}-{secret}", "high": high, "secret": secret, "max_guesses": high.bit_length()}
        for high in range(8, 25)
        for secret in range(1, high + 1)
    ]


_GUESS_TRAIN, _GUESS_EVAL = _split(_guess_records(), percent=20)


class GuessNumber:
    """`env:guess_number` (module docstring). Record: {"id", "high", "secret", "max_guesses"}."""

    name = "guess_number"

    def __init__(self) -> None:
        self.high = self.secret = self.max_guesses = self.guesses = 0

    @staticmethod
    def train_records(seed: int) -> Iterator[dict]:
        return _stream(_GUESS_TRAIN, seed)

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [dict(r) for r in _GUESS_EVAL[:n]]

    def reset(self, record: Mapping[str, Any]) -> str:
        self.high, self.secret = int(record["high"]), int(record["secret"])
        self.max_guesses, self.guesses = int(record["max_guesses"]), 0
        return (
            f"I am thinking of a whole number between 1 and {self.high}. Guess it: reply with just one "
            f"number. After each guess I say higher or lower. You have {self.max_guesses} guesses."
        )

    def step(self, action: str) -> tuple[str, float, bool]:
        self.guesses += 1
        left = self.max_guesses - self.guesses
        match = _INTEGER.search(action)
        guess = int(match.group(0)) if match else None
        if guess == self.secret:
            return (
                f"Correct! The number was {self.secret}.",
                1.0 - 0.5 * (self.guesses - 1) / self.max_guesses,
                True,
            )
        if left <= 0:
            return f"Out of guesses: the number was {self.secret}.", 0.0, True
        plural = "guess" if left == 1 else "guesses"
        if guess is None or not 1 <= guess <= self.high:
            return f"Reply with one number between 1 and {self.high}. {left} {plural} left.", 0.0, False
        return f"{'Higher' if guess < self.secret else 'Lower'}. {left} {plural} left.", 0.0, False


BUILTIN: dict[str, type[Calculator] | type[GuessNumber]] = {
    "calculator": Calculator,
    "guess_number": GuessNumber,
}
