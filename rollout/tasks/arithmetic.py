"""Arithmetic with a verifiable reward: "What is 7 + 12?" -> reward 1 iff the first integer is 19.

Built for SmolLM2-135M-Instruct through its chat template: small additions that the model gets
right sometimes (so GRPO groups have reward variance to learn from) with an instruction to answer
with just the number. The (a, b) pairs are split once, by a hash independent of the seed, into a
training pool and a held-out pool, so eval prompts never appear in training at any seed.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from rollout.tasks.base import Prompt

INSTRUCTION = "Answer with just the number."
_FIRST_INTEGER = re.compile(r"-?\d+")


def _held_out(a: int, b: int, eval_fraction_pct: int) -> bool:
    digest = hashlib.sha256(f"{a}+{b}".encode()).digest()
    return digest[0] * 100 // 256 < eval_fraction_pct


class ArithmeticTask:
    """Additions a + b with operands in [min_operand, max_operand]."""

    name = "arithmetic"

    def __init__(
        self, seed: int = 0, min_operand: int = 1, max_operand: int = 30, eval_fraction_pct: int = 20
    ) -> None:
        if not 0 <= min_operand <= max_operand:
            raise ValueError("max_operand: must be >= min_operand >= 0")
        if not 0 < eval_fraction_pct < 100:
            raise ValueError("eval_fraction_pct: must be in (0, 100)")
        self.seed = seed
        pairs = [
            (a, b) for a in range(min_operand, max_operand + 1) for b in range(min_operand, max_operand + 1)
        ]
        self.eval_pairs = [p for p in pairs if _held_out(*p, eval_fraction_pct)]
        self.train_pairs = [p for p in pairs if not _held_out(*p, eval_fraction_pct)]

    @staticmethod
    def prompt(a: int, b: int, split: str) -> Prompt:
        return Prompt(
            prompt_id=f"arith-{split}-{a}+{b}", text=f"What is {a} + {b}? {INSTRUCTION}", answer=str(a + b)
        )

    def train_prompts(self) -> Iterator[Prompt]:
        rng = random.Random(self.seed)
        while True:
            a, b = rng.choice(self.train_pairs)
            yield self.prompt(a, b, "train")

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n <= 0:
            raise ValueError(f"n: must be > 0 (got {n})")
        pairs = list(self.eval_pairs)
        random.Random(1_000_003).shuffle(pairs)  # the same eval set at every seed
        return [self.prompt(a, b, "eval") for a, b in pairs[:n]]

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        match = _FIRST_INTEGER.search(completion_text)
        return 1.0 if match is not None and match.group(0) == prompt.answer else 0.0


class FinalAnswerArithmeticTask(ArithmeticTask):
    """The same additions and split, scored on the completion's last integer (its final answer).

    SmolLM2-135M-Instruct answers "What is 7 + 12? Answer with just the number." with "7 + 12 = 19":
    the first integer is an operand, so the first-integer reward is 0 for nearly every sample and GRPO
    gets no signal (measured on operands 1..30: 0 correct of ~1,000 samples at temperatures 0.3 to
    1.0, 0 of 100 greedy). The last integer is the model's stated answer: 28 of 100 greedy, about 23 %
    of samples at temperature 0.5, so groups carry reward variance. `parity run` trains on this one.
    """

    name = "arithmetic_final"

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        integers = _FIRST_INTEGER.findall(completion_text)
        return 1.0 if integers and integers[-1] == prompt.answer else 0.0
