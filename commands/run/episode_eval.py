"""Held-out evaluation of an environment task: greedy episodes against a rollout service over gRPC.

Invariants:
- Records come from the environment's `eval_records(n)`, disjoint from its training records.
- Each episode is played exactly as training plays it (rollout/episodes.py, token-in/token-out):
  every model turn is one Generate call with the exact token prefix as `prompt_token_ids`, greedy
  (temperature 0, n=1), so two evaluations of the same weights agree.
- An episode counts as solved when its return is > 0 (the built-in environments give 0 to a failed
  episode and partial credit shows in `reward_mean`); an episode that ended in an environment error
  is left out of every mean and counted in `rewards_failed`, never scored 0.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from commands.run.evaluation import EvalItem, EvalResult, _generate, _mean
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rollout.engine import CompletionResult


def evaluate_episodes(
    address: str,
    task,
    num_prompts: int,
    max_tokens: int,
    label: str,
    *,
    tokenizer_dir: str,
    chat_template: bool,
    system_prompt: str,
    max_turns: int,
    max_episode_tokens: int,
    max_model_len: int | None = None,
    concurrency: int = 32,
    timeout_s: float = 600.0,
) -> EvalResult:
    from transformers import AutoTokenizer

    from rollout.episodes import TurnTemplate, run_episode
    from rollout.tasks import Prompt
    from rollout.tasks.chat import token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    template = TurnTemplate(tokenizer, chat_template)
    prompts = task.eval_prompts(num_prompts)
    started = time.monotonic()
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, n=1)

    async def play_all():
        # Each Generate call blocks a thread; the default executor (cpu count + 4 threads) would let
        # only a handful of the episodes' turns reach the engine's batch at once.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts))))
        )
        with grpc.insecure_channel(address) as chan:
            stub = rollout_pb2_grpc.RolloutServiceStub(chan)

            async def generate(ids: list[int], turn_tokens: int, turn: int) -> CompletionResult:
                params = common_pb2.SamplingParams()
                params.CopyFrom(greedy)
                params.max_tokens = turn_tokens
                request = rollout_pb2.GenerateRequest(prompt_token_ids=ids, sampling=params)
                (completion,) = await asyncio.to_thread(_generate, stub, request, timeout_s)
                return CompletionResult(
                    index=0,
                    token_ids=list(completion.token_ids),
                    logprobs=list(completion.logprobs),
                    token_weight_versions=list(completion.token_weight_versions),
                    text=completion.text,
                    finish_reason=common_pb2.FinishReason.Name(completion.finish_reason)
                    .removeprefix("FINISH_REASON_")
                    .lower(),
                )

            def first_prompt(observation: str) -> list[int]:
                return token_ids(tokenizer, Prompt("eval", observation, ""), chat_template, system_prompt)

            return await asyncio.gather(
                *(
                    run_episode(
                        task.source.new_episode(f"eval-{label}-{i}"),
                        prompt.metadata,
                        first_prompt,
                        generate,
                        template,
                        max_turns,
                        max_episode_tokens,
                        max_tokens,
                        max_model_len=max_model_len,
                    )
                    for i, prompt in enumerate(prompts)
                )
            )

    episodes = asyncio.run(play_all())
    items = []
    for prompt, episode in zip(prompts, episodes, strict=True):
        failed = episode.end == "environment_error"
        items.append(
            EvalItem(
                prompt_id=prompt.prompt_id,
                prompt=episode.first_observation,
                answer=prompt.answer,
                completion=episode.text(tokenizer),
                reward=None if failed else episode.reward,
                weight_versions=sorted(set(episode.weight_versions)),
                reward_error=episode.error,
            )
        )
    scored = [item.reward for item in items if item.reward is not None]
    return EvalResult(
        label=label,
        accuracy=_mean([float(r > 0) for r in scored]),
        reward_mean=_mean(scored),
        num_prompts=len(items),
        weight_versions=sorted({v for item in items for v in item.weight_versions}),
        seconds=time.monotonic() - started,
        max_tokens=max_tokens,
        items=items,
        rewards_failed=sum(item.reward is None for item in items),
    )
