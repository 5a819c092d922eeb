"""Held-out evaluation over gRPC: greedy answers from a rollout service, scored by the run's reward.

Invariants:
- Prompts come from `task.eval_prompts(n)`, which the task keeps disjoint from its training stream.
- Prompts are rendered as training renders them (rollout/tasks/chat.py): plain prompts go as
  prompt_text with `use_chat_template`; chats and system prompts go as token ids from the model's
  own tokenizer (loaded here only then).
- Decoding is greedy (temperature 0, n=1), so two evaluations of the same weights agree exactly and
  before/after differences are the weights', not the sampler's. With `pass_k`, k more answers per
  prompt are sampled (the training temperature, seeded by prompt index) and pass@k is the share of
  prompts with at least one correct answer among the k (the unbiased estimator with n = k).
- Rewards are the run's scorer (task.reward), the same as in training. A prompt whose reward failed
  is left out of every mean and counted in `rewards_failed`; it is never scored 0. A mean over no
  scored prompt is None (nothing measured).
- A prompt counts as correct when its reward is >= `CORRECT_REWARD` (the task's reward is in [0, 1];
  a partial-credit reward, if a task has one, shows in `reward_mean`, not in accuracy).
- Every completion's token weight versions are recorded, so an evaluation can prove which weights
  answered (`weight_versions`).
- An interrupt (Ctrl-C) stops an evaluation at once: its requests run on daemon threads, which an
  exiting process does not wait for, and closing the channel cancels the RPCs in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass, field

import grpc

from parity.errors import RETRY_AFTER_METADATA_KEY
from parity.grpc_retry import retryable
from parity.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

CORRECT_REWARD = 0.999


@dataclass
class EvalItem:
    prompt_id: str
    prompt: str
    answer: str
    completion: str
    reward: float | None  # None: the reward failed (reward_error says why)
    weight_versions: list[int]
    reward_error: str = ""
    sample_rewards: list[float] | None = None  # the pass@k samples' rewards (None: not sampled/failed)


@dataclass
class EvalResult:
    """One evaluation of the served weights on the held-out prompts."""

    label: str
    accuracy: float | None
    reward_mean: float | None
    num_prompts: int
    weight_versions: list[int]
    seconds: float
    max_tokens: int
    items: list[EvalItem] = field(default_factory=list)
    rewards_failed: int = 0
    pass_k: int = 0
    pass_at_k: float | None = None
    sample_reward_mean: float | None = None

    def as_dict(self, with_items: bool = True) -> dict:
        out = asdict(self)
        if not with_items:
            out.pop("items")
        return out


def _generate(
    stub: rollout_pb2_grpc.RolloutServiceStub,
    request: rollout_pb2.GenerateRequest,
    timeout_s: float,
) -> list[rollout_pb2.Completion]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return list(stub.Generate(request, timeout=max(1.0, deadline - time.monotonic())).completions)
        except grpc.RpcError as exc:
            # Retried until the deadline: UNAVAILABLE while a worker catches up on weights, and
            # RESOURCE_EXHAUSTED while the service's admission limits are full (the run's actor
            # shares them; a request alone is always admitted), after the service's retry hint.
            code = exc.code()
            overloaded = code == grpc.StatusCode.RESOURCE_EXHAUSTED and retryable(exc)
            if not (code == grpc.StatusCode.UNAVAILABLE or overloaded) or time.monotonic() > deadline:
                raise
            time.sleep(_retry_after_s(exc) if overloaded else 0.5)


def _retry_after_s(exc: grpc.RpcError) -> float:
    """The refusal's `retry-after-ms` hint (parity/errors.py), within 0.05-5 s; 0.5 s without one."""
    for key, value in exc.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == RETRY_AFTER_METADATA_KEY:
            try:
                return min(5.0, max(0.05, int(value) / 1000))
            except ValueError:
                break
    return 0.5


def _generate_all(
    stub: rollout_pb2_grpc.RolloutServiceStub, requests: list, concurrency: int, timeout_s: float
) -> list[list[rollout_pb2.Completion]]:
    """Every request's completions, in request order, at most `concurrency` at once on daemon
    threads (a pool's threads would be joined at exit, and an interrupted run would wait for its
    RPCs); the first failure is raised."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(requests):
        todo.put(item)

    def work() -> None:
        while True:
            try:
                index, request = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((index, _generate(stub, request, timeout_s), None))
            except Exception as exc:  # handed to the caller, which raises it
                done.put((index, None, exc))
                return

    for n in range(max(1, min(concurrency, len(requests)))):
        threading.Thread(target=work, name=f"eval-{n}", daemon=True).start()
    replies: list = [None] * len(requests)
    for _ in requests:
        while True:
            try:
                index, reply, error = done.get(timeout=1.0)  # a bounded wait: Ctrl-C lands at once
                break
            except queue.Empty:
                continue
        if error is not None:
            raise error
        replies[index] = reply
    return replies


@dataclass(frozen=True)
class PromptFormat:
    """How prompts are rendered (task.chat_template, task.system_prompt) and where the tokenizer is."""

    chat_template: bool = True
    system_prompt: str = ""
    tokenizer_dir: str = ""


def _requests(prompts: list, fmt: PromptFormat, sampling: common_pb2.SamplingParams) -> list:
    from rollout.tasks.chat import needs_tokenizer, request_text, token_ids

    tokenizer = None
    requests = []
    for index, prompt in enumerate(prompts):
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        if params.seed:
            params.seed = params.seed + index
        if needs_tokenizer(prompt, fmt.chat_template, fmt.system_prompt):
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(fmt.tokenizer_dir)
            ids = token_ids(tokenizer, prompt, fmt.chat_template, fmt.system_prompt)
            requests.append(rollout_pb2.GenerateRequest(prompt_token_ids=ids, sampling=params))
        else:
            text = request_text(prompt, fmt.chat_template, fmt.system_prompt)
            requests.append(
                rollout_pb2.GenerateRequest(
                    prompt_text=text, sampling=params, use_chat_template=fmt.chat_template
                )
            )
    return requests


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def evaluate(
    address: str,
    task: object,
    num_prompts: int,
    max_tokens: int,
    use_chat_template: bool,
    label: str,
    concurrency: int = 32,
    timeout_s: float = 600.0,
    *,
    scorer: object = None,
    system_prompt: str = "",
    tokenizer_dir: str = "",
    pass_k: int = 0,
    sampling: common_pb2.SamplingParams | None = None,
) -> EvalResult:
    """Score `num_prompts` held-out prompts greedily (and pass@k) on the rollout service at `address`.

    `scorer` is the run's rollout.rewards Scorer (default: the task's own reward); `sampling` gives
    the temperature/top-p/top-k/seed of the pass@k samples.
    """
    if scorer is None:
        from parity.config.task import TaskConfig
        from rollout.rewards import build_scorer

        scorer = build_scorer(task, TaskConfig())  # type: ignore[arg-type]
    prompts = task.eval_prompts(num_prompts)  # type: ignore[attr-defined]
    fmt = PromptFormat(use_chat_template, system_prompt, tokenizer_dir)
    started = time.monotonic()
    greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=max_tokens, n=1)
    requests = _requests(prompts, fmt, greedy)
    if pass_k:
        sampled = common_pb2.SamplingParams(max_tokens=max_tokens, n=pass_k)
        if sampling is not None:
            sampled.temperature, sampled.top_p, sampled.top_k = (
                sampling.temperature,
                sampling.top_p,
                sampling.top_k,
            )
            sampled.seed = sampling.seed
        requests += _requests(prompts, fmt, sampled)
    chan = grpc.insecure_channel(address)
    try:
        replies = _generate_all(rollout_pb2_grpc.RolloutServiceStub(chan), requests, concurrency, timeout_s)
    finally:
        chan.close()  # on an interrupt: cancels the RPCs in flight
    answers, samples = replies[: len(prompts)], replies[len(prompts) :]
    batches = [(p, [a[0].text]) for p, a in zip(prompts, answers, strict=True)]
    if pass_k:
        batches += [(p, [c.text for c in s]) for p, s in zip(prompts, samples, strict=True)]
    scores = scorer.score_all_sync(batches)  # type: ignore[attr-defined]
    items = []
    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        score = scores[index]
        failed = not isinstance(score, list)
        sample_score = scores[len(prompts) + index] if pass_k else None
        items.append(
            EvalItem(
                prompt_id=prompt.prompt_id,
                prompt=prompt.text,
                answer=prompt.answer,
                completion=answer[0].text,
                reward=None if failed else score[0],
                weight_versions=sorted({v for c in answer for v in c.token_weight_versions}),
                reward_error=str(score) if failed else "",
                sample_rewards=sample_score if isinstance(sample_score, list) else None,
            )
        )
    scored = [item.reward for item in items if item.reward is not None]
    sampled_items = [item.sample_rewards for item in items if item.sample_rewards is not None]
    failed = sum(not isinstance(s, list) for s in scores)
    return EvalResult(
        label=label,
        accuracy=_mean([float(r >= CORRECT_REWARD) for r in scored]),
        reward_mean=_mean(scored),
        num_prompts=len(items),
        weight_versions=sorted({v for item in items for v in item.weight_versions}),
        seconds=time.monotonic() - started,
        max_tokens=max_tokens,
        items=items,
        rewards_failed=failed,
        pass_k=pass_k,
        pass_at_k=_mean([float(max(r) >= CORRECT_REWARD) for r in sampled_items]) if pass_k else None,
        sample_reward_mean=_mean([v for r in sampled_items for v in r]) if pass_k else None,
    )
