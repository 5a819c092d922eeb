"""Rewards (issue 18): built-ins, `task.reward` parsing, the scorer's off-loop calls with deadlines
and failure kinds, and the grpc:HOST:PORT client against a RewardService on loopback.

The Python RewardService here is a stand-in (named so): it proves the client's deadline, retry and
validation paths with exact expected calls. The Node implementation is tested in
tests/test_reward_node.py."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from parity.config.task import TaskConfig
from parity.v1 import reward_pb2, reward_pb2_grpc
from rollout.rewards import build_scorer, parse_reward
from rollout.rewards.builtin import exact, last_integer, math_verify
from rollout.rewards.scorer import RewardFailed
from rollout.tasks import Prompt, TaskError, get_task

PROMPT = Prompt("p1", "What is 7 + 12?", "19", metadata={"level": 2})


@pytest.mark.parametrize(
    ("reward", "completion", "answer", "expected"),
    [
        (exact, " 19\n", "19", 1.0),
        (exact, "19.", "19", 0.0),
        (last_integer, "7 + 12 = 19", "19", 1.0),
        (last_integer, "19, no, 20", "19", 0.0),
        (last_integer, "so 1,234 apples", "1234", 1.0),
        (last_integer, "", "19", 0.0),
        (math_verify, "The answer is $\\frac{3}{4}$.", "0.75", 1.0),
        (math_verify, "It is 72.", "72", 1.0),
        (math_verify, "It is 71.", "72", 0.0),
        (math_verify, "no number here", "72", 0.0),
    ],
)
def test_builtin_rewards(reward, completion: str, answer: str, expected: float) -> None:
    assert reward("q", completion, answer, {}) == expected


def test_reward_spec_parses_weights_and_names_the_field_on_errors() -> None:
    assert parse_reward("") == [(1.0, "task")]
    assert parse_reward("0.7*math_verify, 0.3*grpc:127.0.0.1:5000") == [
        (0.7, "math_verify"),
        (0.3, "grpc:127.0.0.1:5000"),
    ]
    task = get_task("arithmetic")
    for spec, message in [
        ("x*exact", r"^task\.reward: weight 'x'"),
        ("bogus", r"^task\.reward: unknown reward 'bogus'"),
        ("grpc:localhost", r"^task\.reward: expected grpc:HOST:PORT"),
        ("no_such_module:f", r"^task\.reward: cannot import 'no_such_module'"),
    ]:
        with pytest.raises(TaskError, match=message):
            build_scorer(task, TaskConfig(reward=spec))


def _score(spec: str, completions: list[str], timeout_s: float = 5.0, prompt: Prompt = PROMPT) -> list[float]:
    scorer = build_scorer(get_task("arithmetic"), TaskConfig(reward=spec, reward_timeout_s=timeout_s))
    return asyncio.run(scorer.score(prompt, completions, "g1"))


def test_weighted_sum_and_the_tasks_own_reward() -> None:
    assert _score("", ["19", "20"]) == [1.0, 0.0]  # the task's first-integer reward
    assert _score("0.25*task,0.75*last_integer", ["7 + 12 = 19", "19"]) == [0.75, 1.0]


@pytest.mark.parametrize(
    ("function", "kind", "reason", "timeout_s"),
    [  # a short timeout only where it is what fails: a slow box must not turn an error into a timeout
        ("tests.test_rewards:raises", "error", "ZeroDivisionError", 10.0),
        ("tests.test_rewards:not_finite", "non_finite", "returned nan for completion 1", 10.0),
        ("tests.test_rewards:hangs", "timeout", "no result within 0.5s", 0.5),
    ],
)
def test_a_failing_reward_fails_the_group_with_its_reason(
    function: str, kind: str, reason: str, timeout_s: float
) -> None:
    started = time.monotonic()
    with pytest.raises(RewardFailed) as info:
        _score(f"exact,{function}", ["19", "nan"], timeout_s=timeout_s)
    assert info.value.kind == kind and reason in info.value.reason and function in info.value.reason
    assert time.monotonic() - started < timeout_s + 2.5  # a hanging reward costs its timeout, not its hang


def raises(prompt: str, completion: str, answer: str, metadata) -> float:
    return 1 / 0


def not_finite(prompt: str, completion: str, answer: str, metadata) -> float:
    return math.nan if completion == "nan" else 1.0


def hangs(prompt: str, completion: str, answer: str, metadata) -> float:
    time.sleep(30)
    return 1.0


def test_reward_code_never_blocks_the_event_loop() -> None:
    """While a reward hangs, the loop keeps running other work (the actor's generate/publish)."""

    async def main() -> tuple[int, RewardFailed | None]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        scorer = build_scorer(
            get_task("arithmetic"), TaskConfig(reward="tests.test_rewards:hangs", reward_timeout_s=0.6)
        )
        try:
            await scorer.score(PROMPT, ["19"])
        except RewardFailed as exc:
            failure = exc
        task.cancel()
        return ticks, failure

    ticks, failure = asyncio.run(main())
    assert failure is not None and failure.kind == "timeout"
    # 0.6 s at 10 ms a tick is ~60 ticks on a quiet box; a loop blocked by the reward gets 0 or 1
    assert ticks >= 5, ticks


# --- grpc:HOST:PORT against a stand-in RewardService ----------------------------------------------
class StandInRewardService(reward_pb2_grpc.RewardServiceServicer):
    """Scores len(completion) / 10; can be told to fail its next calls, sleep, miscount, or answer
    with a reply over the client's 64 MB message limit."""

    def __init__(self) -> None:
        self.requests: list[reward_pb2.ScoreRequest] = []
        self.fail_next: list[grpc.StatusCode] = []
        self.sleep_s = 0.0
        self.drop_one = False
        self.oversize = False

    def Score(self, request, context):
        self.requests.append(request)
        if self.fail_next:
            context.abort(self.fail_next.pop(0), "stand-in failure")
        time.sleep(self.sleep_s)
        scores = [len(item.completion) / 10 for item in request.items]
        if self.oversize:
            scores *= 4_250_000  # 8.5M packed doubles: 68 MB
        return reward_pb2.ScoreResponse(scores=scores[:-1] if self.drop_one else scores)


@pytest.fixture
def reward_service() -> Iterator[tuple[str, StandInRewardService]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = StandInRewardService()
    reward_pb2_grpc.add_RewardServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_grpc_reward_sends_the_batch_and_returns_one_score_each(reward_service) -> None:
    address, servicer = reward_service
    assert _score(f"grpc:{address}", ["a", "abc"]) == [0.1, 0.3]
    (request,) = servicer.requests
    assert request.request_id == "g1" and request.task == "arithmetic"
    assert [(i.prompt_id, i.prompt, i.answer, i.completion) for i in request.items] == [
        ("p1", "What is 7 + 12?", "19", "a"),
        ("p1", "What is 7 + 12?", "19", "abc"),
    ]
    assert dict(request.items[0].metadata) == {"level": 2}


def test_grpc_reward_retries_unavailable_with_backoff_then_succeeds(reward_service) -> None:
    address, servicer = reward_service
    servicer.fail_next = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    started = time.monotonic()
    assert _score(f"grpc:{address}", ["ab"]) == [0.2]
    assert len(servicer.requests) == 3
    assert time.monotonic() - started >= 0.2 + 0.4  # backoff 0.2 s, then 0.4 s


@pytest.mark.parametrize(
    ("setup", "kind", "reason", "calls"),
    [
        (lambda s: s.fail_next.extend([grpc.StatusCode.INVALID_ARGUMENT]), "error", "INVALID_ARGUMENT", 1),
        (lambda s: s.fail_next.extend([grpc.StatusCode.UNAVAILABLE] * 3), "error", "UNAVAILABLE", 3),
        # a server's own RESOURCE_EXHAUSTED (a rate limit) is retried; a reply over the message
        # limit is not: it would be as large on every attempt
        (lambda s: s.fail_next.extend([grpc.StatusCode.RESOURCE_EXHAUSTED] * 3), "error", "stand-in", 3),
        (lambda s: setattr(s, "oversize", True), "error", "larger than max", 1),
        (lambda s: setattr(s, "sleep_s", 1.0), "timeout", "DEADLINE_EXCEEDED", 3),
        (lambda s: setattr(s, "drop_one", True), "error", "1 scores for 2 completions", 1),
    ],
)
def test_grpc_reward_failures_fail_the_group(
    reward_service, setup, kind: str, reason: str, calls: int
) -> None:
    address, servicer = reward_service
    setup(servicer)
    # Only the timeout case needs a short deadline; for the others a 0.3 s deadline could run out
    # before a loaded server dispatched an attempt, turning that attempt into a DEADLINE_EXCEEDED.
    with pytest.raises(RewardFailed) as info:
        _score(f"grpc:{address}", ["a", "b"], timeout_s=0.3 if kind == "timeout" else 30.0)
    assert info.value.kind == kind and reason in info.value.reason, info.value
    # retries = 2 (the default) only on retryable codes: the client's own count is in the reason
    if "scores for" not in reason:
        assert f"(attempt {calls})" in info.value.reason, info.value
    if kind == "timeout":
        # An attempt whose 0.3 s deadline ran out before the server dispatched it (a loaded box)
        # never reaches the handler: the server saw at most `calls`, at least the first.
        assert 1 <= len(servicer.requests) <= calls
    else:
        assert len(servicer.requests) == calls


def test_grpc_reward_to_nothing_fails_as_unavailable() -> None:
    import socket

    with socket.socket() as s:  # bound, never listening: refused, and nobody else can take it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(RewardFailed, match="UNAVAILABLE"):
            _score(f"grpc:127.0.0.1:{port}", ["a"], timeout_s=0.5)


def test_eval_scoring_reports_failures_in_place() -> None:
    scorer = build_scorer(
        get_task("arithmetic"), TaskConfig(reward="tests.reward_helpers:faulty", reward_timeout_s=2.0)
    )  # the prompts that score must score within it on a slow box; the hanging ones cost it
    from tests.reward_helpers import fault_kind

    prompts = [Prompt(f"id{i}", f"prompt {i}", "1") for i in range(9)]
    results = scorer.score_all_sync([(p, ["x"]) for p in prompts])
    for prompt, result in zip(prompts, results, strict=True):
        kind = fault_kind(prompt.text)
        if kind == "score":
            assert result == [0.5]
        else:
            assert isinstance(result, RewardFailed) and result.kind == (
                "error" if kind == "raise" else "timeout"
            )
    assert {fault_kind(p.text) for p in prompts} == {"raise", "hang", "score"}


def test_a_dropped_group_is_counted_in_rewards_failed_total() -> None:
    """The actor's drop path increments the Prometheus counter by reason (the run test reads the log)."""
    from types import SimpleNamespace

    from parity.config import load
    from rollout import metrics
    from rollout.actor import Actor

    cfg = load(["--task", "arithmetic", "--reward", "exact"], home="run", environ={}).config
    actor = Actor(cfg, SimpleNamespace(engine=SimpleNamespace()))  # the drop path touches no engine

    def count(reason: str) -> float:
        return metrics.REWARDS_FAILED.labels(reason=reason)._value.get()

    before = {reason: count(reason) for reason in ("error", "timeout", "non_finite")}
    actor._reward_failed("g1", PROMPT, RewardFailed("timeout", "x: no result within 1s"))
    actor._reward_failed("g2", PROMPT, RewardFailed("non_finite", "x: returned nan"))
    assert {r: count(r) - before[r] for r in before} == {"error": 0, "timeout": 1, "non_finite": 1}
    assert actor.rewards_failed == 2
