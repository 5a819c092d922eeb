"""The Python environment of docs/environments.md, verbatim (tests/test_environments.py checks that
the docs show this code and plays it): `--task env:tests.fakes.docs_environment:ReverseWord`."""

# docs:start
import random

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "chair", "bread", "ocean"]


class ReverseWord:
    """Spell a word backwards: 1.0 when right; one retry with a hint."""

    @staticmethod
    def train_records(seed: int):
        rng = random.Random(seed)
        while True:  # endless, deterministic given the seed
            word = rng.choice(WORDS[:8])
            yield {"id": f"reverse-{word}", "word": word}

    @staticmethod
    def eval_records(n: int) -> list[dict]:  # held out: ids never in training
        return [{"id": f"reverse-{word}", "word": word} for word in WORDS[8:]][:n]

    def reset(self, record: dict) -> str:
        self.word, self.tries = record["word"], 0
        return f"Spell the word {self.word!r} backwards. Answer with the reversed word only."

    def step(self, action: str) -> tuple[str, float, bool]:
        self.tries += 1
        if action.strip().lower() == self.word[::-1]:
            return "Correct.", 1.0, True
        if self.tries == 1:
            return f"Not quite: it starts with {self.word[-1]!r}. Try again.", 0.0, False
        return f"The answer was {self.word[::-1]!r}.", 0.0, True


# docs:end
