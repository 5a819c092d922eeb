"""FAKE engine for episode tests: returns scripted token ids per model turn, as an engine would
report them (logprobs, weight versions), and records every prompt it was given. Stands in for vLLM
only where a test needs chosen tokens (a non-canonical split that decode-then-encode would change);
the episode path against the real engine is tested in tests/test_episode_run.py."""

from __future__ import annotations

from collections.abc import Sequence

from rollout.engine import CompletionResult


class ScriptedEngine:
    def __init__(self, tokenizer, turns: Sequence[Sequence[int]], version: int = 3) -> None:
        self.tokenizer, self.turns, self.version = tokenizer, [list(t) for t in turns], version
        self.prompts: list[list[int]] = []
        self.max_tokens: list[int] = []

    async def generate(self, prompt_token_ids: list[int], max_tokens: int, turn: int) -> CompletionResult:
        self.prompts.append(list(prompt_token_ids))
        self.max_tokens.append(max_tokens)
        tokens = self.turns[turn][:max_tokens]
        finish = "stop" if len(tokens) == len(self.turns[turn]) else "length"
        return CompletionResult(
            index=0,
            token_ids=tokens,
            logprobs=[-0.25 - 0.01 * i for i in range(len(tokens))],
            token_weight_versions=[self.version + turn] * len(tokens),
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            finish_reason=finish,
            token_context_versions=[self.version + turn] * len(tokens),
        )
