"""Held-out evaluation over gRPC: greedy answers from a rollout service, scored by the task's reward.

Invariants:
- Prompts come from `task.eval_prompts(n)`, which the task keeps disjoint from its training stream.
- Decoding is greedy (temperature 0, n=1), so two evaluations of the same weights agree exactly and
  before/after differences are the weights', not the sampler's.
- A prompt counts as correct when its reward is >= `CORRECT_REWARD` (the task's reward is in [0, 1];
  a partial-credit reward, if a task has one, shows in `reward_mean`, not in accuracy).
- Every completion's token weight versions are recorded, so an evaluation can prove which weights
  answered (`weight_versions`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import grpc

from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

CORRECT_REWARD = 0.999


@dataclass
class EvalItem:
    prompt_id: str
    prompt: str
    answer: str
    completion: str
    reward: float
    weight_versions: list[int]


@dataclass
class EvalResult:
    """One evaluation of the served weights on the held-out prompts."""

    label: str
    accuracy: float
    reward_mean: float
    num_prompts: int
    weight_versions: list[int]
    seconds: float
    max_tokens: int
    items: list[EvalItem] = field(default_factory=list)

    def as_dict(self, with_items: bool = True) -> dict:
        out = asdict(self)
        if not with_items:
            out.pop("items")
        return out


def _generate_one(
    stub: rollout_pb2_grpc.RolloutServiceStub,
    prompt_text: str,
    max_tokens: int,
    use_chat_template: bool,
    timeout_s: float,
) -> rollout_pb2.Completion:
    request = rollout_pb2.GenerateRequest(
        request_id="",
        prompt_text=prompt_text,
        sampling=common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=max_tokens, n=1),
        use_chat_template=use_chat_template,
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return stub.Generate(request, timeout=max(1.0, deadline - time.monotonic())).completions[0]
        except grpc.RpcError as exc:
            # UNAVAILABLE while a worker catches up on weights; retry until the deadline.
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def evaluate(
    address: str,
    task: object,
    num_prompts: int,
    max_tokens: int,
    use_chat_template: bool,
    label: str,
    concurrency: int = 32,
    timeout_s: float = 600.0,
) -> EvalResult:
    """Score `num_prompts` held-out prompts greedily on the rollout service at `address`."""
    prompts = task.eval_prompts(num_prompts)  # type: ignore[attr-defined]
    started = time.monotonic()
    with grpc.insecure_channel(address) as chan:
        stub = rollout_pb2_grpc.RolloutServiceStub(chan)
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(prompts)))) as pool:
            completions = list(
                pool.map(
                    lambda p: _generate_one(stub, p.text, max_tokens, use_chat_template, timeout_s), prompts
                )
            )
    items = []
    for prompt, completion in zip(prompts, completions, strict=True):
        reward = float(task.reward(prompt, completion.text))  # type: ignore[attr-defined]
        items.append(
            EvalItem(
                prompt_id=prompt.prompt_id,
                prompt=prompt.text,
                answer=prompt.answer,
                completion=completion.text,
                reward=reward,
                weight_versions=sorted(set(completion.token_weight_versions)),
            )
        )
    n = max(1, len(items))
    return EvalResult(
        label=label,
        accuracy=sum(item.reward >= CORRECT_REWARD for item in items) / n,
        reward_mean=sum(item.reward for item in items) / n,
        num_prompts=len(items),
        weight_versions=sorted({v for item in items for v in item.weight_versions}),
        seconds=time.monotonic() - started,
        max_tokens=max_tokens,
        items=items,
    )
