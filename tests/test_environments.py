"""Environments for multi-turn episodes (rollout/environments): the built-ins play scripted episodes,
records are deterministic and held out, every way an environment can fail becomes EnvironmentFailed
with its reason within the deadline, and `--task env:...` loads Python factories and gRPC services."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import grpc
import pytest

from parity.grpc_retry import RETRYABLE
from rollout.environments import (
    AsyncEpisodeEnv,
    EnvironmentFailed,
    EnvironmentSource,
    LocalEnv,
    StepResult,
    get_environment,
)
from rollout.environments import base as env_base
from rollout.environments.builtin import MAX_TOOL_CALLS, GuessNumber, UnsafeExpression, calculate
from rollout.environments.remote import RemoteSource
from rollout.tasks import TaskError
from tests.fakes import environments as fakes
from tests.fakes.env_service import serving

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 0.3


@pytest.fixture(autouse=True)
def release_hung_threads() -> Iterator[None]:
    fakes.RELEASE.clear()
    yield
    fakes.RELEASE.set()


async def play(env: AsyncEpisodeEnv, record: dict, actions: list[str]) -> tuple[str, list[StepResult]]:
    """Reset on `record`, then the actions until done; closes the episode."""
    try:
        first = await env.reset(record)
        results = []
        for action in actions:
            results.append(await env.step(action))
            if results[-1].done:
                break
        return first, results
    finally:
        await env.close()


def episode(source: EnvironmentSource, record: dict, actions: list[str]) -> tuple[str, list[StepResult]]:
    return asyncio.run(play(source.new_episode("ep-test"), record, actions))


# --- calculator ----------------------------------------------------------------------------------

CALC = {"id": "calc-37*12", "question": "What is 37 * 12?", "answer": 444}


def test_calculator_answers_the_tool_call_and_rewards_the_right_answer() -> None:
    first, results = episode(
        get_environment("env:calculator"), CALC, ["<calc>37*12</calc>", "<answer>444</answer>"]
    )
    assert first.startswith("What is 37 * 12?") and "<calc>" in first and "<answer>" in first
    assert results == [StepResult("444", 0.0, False), StepResult("Correct.", 1.0, True)]


@pytest.mark.parametrize(
    ("actions", "observations", "total"),
    [
        (["I think <answer>443</answer>"], ["Wrong."], 0.0),
        (["<answer>4,44</answer>"], ["Correct."], 1.0),  # thousands commas are allowed
        (["<answer>444.0</answer>"], ["Correct."], 1.0),
        (["<answer>lots</answer>"], ["Wrong."], 0.0),
        (["hmm", "<answer>444</answer>"], ["Write", "Correct."], 1.0),  # one retry
        (["hmm", "still nothing"], ["Write", "Wrong."], 0.0),
        (["hmm", "37 * 12 is 444"], ["Write", "Correct."], 1.0),  # after the retry: the last number
        (["hmm", "it is 443"], ["Write", "Wrong."], 0.0),
        (["<calc>37 * (10 + 2)", "<answer>444</answer>"], ["444", "Correct."], 1.0),  # stop string cut "</calc>"
        (["<answer>444</answer> <calc>1+1</calc>"], ["Correct."], 1.0),  # the first tag decides
        (["<calc>1+1</calc> then <answer>444</answer>"], ["2"], 0.0),
        (["<calc>10/4</calc>", "<calc>1/0</calc>"], ["2.5", "error: division by zero"], 0.0),
        (["<calc>1</calc>"] * (MAX_TOOL_CALLS + 1), ["1"] * MAX_TOOL_CALLS + ["Too many calculator calls."], 0.0),
    ],
)  # fmt: skip
def test_calculator_scripted_turns(actions: list[str], observations: list[str], total: float) -> None:
    _, results = episode(get_environment("env:calculator"), CALC, actions)
    assert [r.observation[: len(o)] for r, o in zip(results, observations, strict=True)] == observations
    assert sum(r.reward for r in results) == total


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('true')",
        "2**100",
        "7//2",
        "1e9",
        "abc",
        "(1",
        "",
        "1" * 65,
        "[1]",
        "3 % 2",
        "1 2",
    ],
)
def test_calculator_refuses_unsafe_expressions(expression: str) -> None:
    with pytest.raises(UnsafeExpression, match=r"^error: "):
        calculate(expression)
    _, results = episode(get_environment("env:calculator"), CALC, [f"<calc>{expression}</calc>"])
    assert results[0].observation.startswith("error: ") and results[0].reward == 0.0 and not results[0].done


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37*12", 444), ("  (2 + 3) * -4 ", -20), ("10 - 99", -89), ("7/2", Fraction(7, 2)), ("--3", 3)],
)
def test_calculator_evaluates_exactly(expression: str, value: Fraction) -> None:
    assert calculate(expression) == value


# --- guess_number --------------------------------------------------------------------------------


def binary_search(source: EnvironmentSource, record: dict) -> list[StepResult]:
    async def go() -> list[StepResult]:
        env = source.new_episode(f"bs-{record['id']}")
        await env.reset(record)
        low, high, results = 1, record["high"], []
        while not results or not results[-1].done:
            guess = (low + high) // 2
            results.append(await env.step(f"My guess is {guess}."))
            low, high = (
                (guess + 1, high) if results[-1].observation.startswith("Higher") else (low, guess - 1)
            )
        await env.close()
        return results

    return asyncio.run(go())


def test_guess_number_binary_search_wins_every_held_out_game() -> None:
    source = get_environment("env:guess_number")
    for record in source.eval_records(1000):
        results = binary_search(source, record)
        guesses = len(results)
        assert guesses <= record["max_guesses"]
        assert results[-1].observation == f"Correct! The number was {record['secret']}."
        assert results[-1].reward == 1.0 - 0.5 * (guesses - 1) / record["max_guesses"]


def test_guess_number_feedback_and_losing() -> None:
    record = {"id": "guess-16-11", "high": 16, "secret": 11, "max_guesses": 4}
    _, results = episode(get_environment("env:guess_number"), record, ["8", "no idea", "99", "12"])
    assert [r.observation for r in results] == [
        "Higher. 3 guesses left.",
        "Reply with one number between 1 and 16. 2 guesses left.",  # an unparseable turn uses a guess
        "Reply with one number between 1 and 16. 1 guess left.",
        "Out of guesses: the number was 11.",
    ]
    assert [r.reward for r in results] == [0.0] * 4 and results[-1].done
    _, results = episode(get_environment("env:guess_number"), record, ["11 is my guess"])
    assert results == [StepResult("Correct! The number was 11.", 1.0, True)]


# --- records -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["calculator", "guess_number"])
def test_records_are_deterministic_and_held_out(name: str) -> None:
    source, other = get_environment(f"env:{name}", seed=0), get_environment(f"env:{name}", seed=1)
    eval_records = source.eval_records(10_000)
    assert eval_records == other.eval_records(10_000)  # the same held-out set at every seed
    assert len({r["id"] for r in eval_records}) == len(eval_records) >= 50
    first = list(itertools.islice(source.train_records(0), 200))
    assert first == list(itertools.islice(other.train_records(0), 200))
    assert first != list(itertools.islice(source.train_records(1), 200))
    train_ids = {r["id"] for r in itertools.islice(source.train_records(3), 20_000)}  # checked as they stream
    assert not train_ids & {r["id"] for r in eval_records}
    assert len(train_ids) > 100


def test_a_training_record_with_a_held_out_id_is_refused() -> None:
    source = get_environment("env:tests.fakes.environments:make_count_to")
    source.eval_records(1)  # count-9
    source._train = lambda seed: iter([{"id": "count-2"}, {"id": "count-9"}])  # type: ignore[attr-defined]
    stream = source.train_records(0)
    assert next(stream)["id"] == "count-2"
    with pytest.raises(ValueError, match="'count-9' is also a held-out"):
        next(stream)


# --- failures ------------------------------------------------------------------------------------


def local(environment: object, timeout_s: float = TIMEOUT_S, max_chars: int = 1000) -> LocalEnv:
    return LocalEnv(
        environment,  # type: ignore[arg-type]
        name="fake",
        episode_id="ep-7",
        step_timeout_s=timeout_s,
        max_observation_chars=max_chars,
    )


@pytest.mark.parametrize(
    ("environment", "reason", "detail"),
    [
        (fakes.Raises, "error", "step 0: ValueError: the environment broke"),
        (fakes.RaisesOnReset, "error", "reset: KeyError: 'target'"),
        (fakes.Hangs, "timeout", f"step 0: no answer within {TIMEOUT_S:g}s"),
        (fakes.Oversized, "oversized", "step 0: observation has 100000 characters, over the limit of 1000"),
        (fakes.NotAString, "malformed", "step 0: observation is int, not str"),
        (fakes.NaNReward, "malformed", "step 0: reward is nan, not finite"),
        (fakes.StringReward, "malformed", "step 0: reward is str, not a number"),
        (fakes.TwoValues, "malformed", "step 0: expected (observation, reward, done), got a tuple of 2"),
        (fakes.DoneNotBool, "malformed", "step 0: done is str, not bool"),
        (fakes.ResetNotAString, "malformed", "reset: observation is list, not str"),
        (fakes.not_an_environment, "malformed", "reset: the factory returned dict, which has no reset/step methods"),
    ],
)  # fmt: skip
def test_a_failing_environment_ends_the_episode_with_its_reason(
    environment: type, reason: str, detail: str
) -> None:
    started = time.monotonic()
    env = local(environment)
    with pytest.raises(EnvironmentFailed) as info:
        asyncio.run(play(env, {"id": "r1", "target": 2}, ["1", "2"]))
    assert time.monotonic() - started < TIMEOUT_S + 2.0
    assert info.value.reason == reason
    assert str(info.value) == f"{reason}: environment fake, episode ep-7: {detail}"
    assert env.failure is info.value
    with pytest.raises(RuntimeError, match="called while the episode is closed"):
        asyncio.run(env.step("again"))


def test_hung_calls_are_bounded_then_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(env_base, "MAX_STUCK_CALLS", 1)
    with pytest.raises(EnvironmentFailed, match="no answer within"):
        asyncio.run(play(local(fakes.Hangs), {"id": "r"}, ["a"]))
    started = time.monotonic()
    with pytest.raises(EnvironmentFailed, match="1 earlier environment calls are still running") as info:
        asyncio.run(play(local(fakes.CountTo), {"id": "r", "target": 2}, ["1"]))
    # Refused, not timed out: the message says so (a timed-out call reads "no answer within"); the
    # wall-clock bound only catches a wait far past the timeout (a loaded box stretches any bound).
    assert info.value.reason == "timeout" and "no answer within" not in str(info.value)
    assert time.monotonic() - started < TIMEOUT_S + 2.0
    fakes.RELEASE.set()  # the hung call returns; the next episode runs again
    deadline = time.monotonic() + 5
    while env_base._abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    _, results = asyncio.run(play(local(fakes.CountTo), {"id": "r", "target": 2}, ["1", "2"]))
    assert results[-1] == StepResult("Done.", 1.0, True)


def test_the_episode_gets_a_copy_of_the_record() -> None:
    record = {"id": "r1", "nested": []}
    asyncio.run(play(local(fakes.MutatesRecord), record, []))
    assert record == {"id": "r1", "nested": []}


def test_close_never_raises_and_calls_happen_in_order(caplog: pytest.LogCaptureFixture) -> None:
    env = local(fakes.CloseRaises)
    with pytest.raises(RuntimeError, match="step called while the episode is new"):
        asyncio.run(env.step("1"))
    with caplog.at_level(logging.WARNING):
        _, results = asyncio.run(play(env, {"id": "r", "target": 1}, ["1"]))
    assert results == [StepResult("Done.", 1.0, True)]
    assert "environment fake, episode ep-7: close: RuntimeError: close broke" in caplog.text


# --- loading -------------------------------------------------------------------------------------


def test_the_docs_environment_loads_by_name_and_plays() -> None:
    source = get_environment("env:tests.fakes.docs_environment:ReverseWord", seed=0)
    assert source.name == "tests.fakes.docs_environment:ReverseWord"
    record = source.eval_records(1)[0]
    assert record == {"id": "reverse-bread", "word": "bread"}
    first, results = episode(source, record, ["derb", "daerb"])
    assert first == "Spell the word 'bread' backwards. Answer with the reversed word only."
    assert results == [
        StepResult("Not quite: it starts with 'd'. Try again.", 0.0, False),
        StepResult("Correct.", 1.0, True),
    ]


def test_the_docs_show_the_tested_python_environment() -> None:
    code = (ROOT / "tests" / "fakes" / "docs_environment.py").read_text()
    example = code.split("# docs:start\n")[1].split("# docs:end")[0].strip()
    docs = (ROOT / "docs" / "environments.md").read_text()
    assert example in docs
    assert len(example.splitlines()) <= 35
    assert "clients/node/env_server.js" in docs


def test_a_factory_function_gets_records_from_the_class_it_returns() -> None:
    source = get_environment("env:tests.fakes.environments:make_count_to", seed=0)
    assert [r["id"] for r in itertools.islice(source.train_records(), 4)] == [
        "count-2",
        "count-3",
        "count-4",
        "count-2",
    ]
    _, results = episode(source, {"id": "count-2", "target": 2}, ["1", "2"])
    assert [r.reward for r in results] == [0.0, 1.0]


def test_builtin_classes_load_by_module_path_too() -> None:
    by_path = get_environment("env:rollout.environments.builtin:Calculator")
    assert by_path.eval_records(5) == get_environment("env:calculator").eval_records(5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("calculator", "task.name: expected env:NAME"),
        ("env:chess", "task.name: unknown environment 'env:chess'"),
        ("env:grpc:localhost", "task.name: expected env:grpc:HOST:PORT"),
        ("env:grpc:localhost:99999", "task.name: expected env:grpc:HOST:PORT"),
        ("env:tests.fakes.nothing_here:make", "task.name: cannot import 'tests.fakes.nothing_here'"),
        ("env:tests.fakes.environments:missing", "task.name: 'tests.fakes.environments' has no attribute"),
        ("env:tests.fakes.environments:no_records", "task.name: env:tests.fakes.environments:no_records gives no records"),
        ("env:tests.fakes.environments:not_an_environment", "returned a dict, not an Environment"),
        ("env:tests.fakes.environments:INSTANCE", "task.name: env:tests.fakes.environments:INSTANCE names an Environment instance"),
        ("env:tests.fakes.environments:HANG_S", "task.name: env:tests.fakes.environments:HANG_S is a float"),
    ],
)  # fmt: skip
def test_bad_specs_name_task_name(spec: str, message: str) -> None:
    with pytest.raises(TaskError, match=r"^task\.name: ") as info:
        get_environment(spec)
    assert message in str(info.value)


def test_settings_come_from_the_task_config() -> None:
    class Config:
        env_step_timeout_s = 1.5
        env_max_observation_chars = 77
        env_retries = 5

    env = get_environment("env:calculator", config=Config()).new_episode("e")
    assert (env.step_timeout_s, env.max_observation_chars) == (1.5, 77)
    remote = get_environment("env:grpc:127.0.0.1:1", config=Config())
    assert isinstance(remote, RemoteSource) and remote.client.retries == 5


# --- env:grpc ------------------------------------------------------------------------------------


@pytest.fixture
def guess_service() -> Iterator[tuple[str, object]]:
    with serving(GuessNumber, token="s3cret") as served:
        yield served


def test_grpc_environment_plays_an_episode_with_records_and_auth(
    guess_service: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, servicer = guess_service
    monkeypatch.setenv("PARITY_AUTH_TOKEN", "s3cret")
    source = get_environment(f"env:grpc:{address}", seed=0)
    assert source.name == f"grpc:{address}"
    assert source.eval_records(7) == GuessNumber.eval_records(7)  # whole numbers come back as ints
    assert list(itertools.islice(source.train_records(), 600)) == list(
        itertools.islice(GuessNumber.train_records(0), 600)
    )  # three pages of 256
    record = GuessNumber.eval_records(1)[0]
    results = binary_search(source, record)
    assert results[-1].done and results[-1].reward > 0.5
    assert servicer.closed == [f"bs-{record['id']}"]
    assert all(m.get("authorization") == "Bearer s3cret" for m in servicer.metadata)
    asyncio.run(source.close())


class _LongRecords(GuessNumber):
    """GuessNumber whose held-out records carry 1.5 MB of text each (a page of 4: 6 MB)."""

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [
            {**record, "text": str(i) * 1_500_000} for i, record in enumerate(GuessNumber.eval_records(n))
        ]


def test_grpc_pages_of_records_over_4_mb_arrive_whole() -> None:
    # Both of the client's channels take the same 64 MB messages: records come over the blocking
    # one, episodes over the aio one; gRPC's default receive limit is 4 MB.
    with serving(_LongRecords) as (address, _servicer):
        records = get_environment(f"env:grpc:{address}").eval_records(4)
    assert [len(r["text"]) for r in records] == [1_500_000] * 4
    assert records == _LongRecords.eval_records(4)


class _HugeRecords(GuessNumber):
    """GuessNumber whose held-out records carry 17 MB of text each (a page of 4: over 64 MB)."""

    @staticmethod
    def eval_records(n: int) -> list[dict]:
        return [{**record, "text": "x" * 17_000_000} for record in GuessNumber.eval_records(n)]


def test_grpc_page_over_the_message_limit_fails_at_once_naming_the_sizes() -> None:
    # gRPC reports an over-size message as RESOURCE_EXHAUSTED, a retried status; the same page
    # would come back just as large, so it is not asked for again.
    with serving(_HugeRecords) as (address, servicer):
        source = get_environment(f"env:grpc:{address}")
        assert source.client.retries == 2
        with pytest.raises(EnvironmentFailed) as info:
            source.eval_records(4)
    assert "RESOURCE_EXHAUSTED" in str(info.value) and "larger than max" in str(info.value)
    assert "(attempt 1)" in str(info.value)
    assert [c[0] for c in servicer.calls] == ["ListRecords"]


def test_grpc_without_the_token_fails_at_once(guess_service: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    address, servicer = guess_service
    monkeypatch.delenv("PARITY_AUTH_TOKEN", raising=False)
    env = get_environment(f"env:grpc:{address}").new_episode("ep-1")
    with pytest.raises(EnvironmentFailed) as info:
        asyncio.run(env.reset(GuessNumber.eval_records(1)[0]))
    assert info.value.reason == "error"
    assert f"environment grpc:{address}, episode ep-1: reset: UNAUTHENTICATED" in str(info.value)
    assert [c[0] for c in servicer.calls] == []  # refused before the handler ran; not retried


def test_grpc_retried_step_is_recognised_by_its_index(
    guess_service: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, servicer = guess_service
    monkeypatch.setenv("PARITY_AUTH_TOKEN", "s3cret")
    servicer.drop_replies = {0, 1}
    record = {"id": "guess-16-11", "high": 16, "secret": 11, "max_guesses": 5}
    _, results = episode(get_environment(f"env:grpc:{address}"), record, ["8", "12", "11"])
    assert [r.observation for r in results] == [
        "Higher. 4 guesses left.",
        "Lower. 3 guesses left.",
        "Correct! The number was 11.",
    ]
    assert [c[2] for c in servicer.calls if c[0] == "Step"] == [0, 0, 1, 1, 2]
    assert servicer.steps_applied == 3


class _Config:
    env_step_timeout_s = TIMEOUT_S
    env_max_observation_chars = 1000
    env_retries = 1


@pytest.mark.parametrize(
    ("environment", "hang_s", "reason", "detail"),
    [
        (fakes.Oversized, 0.0, "oversized", "step 0: observation has 100000 characters"),
        (fakes.NaNReward, 0.0, "malformed", "step 0: reward is nan, not finite"),
        (fakes.Raises, 0.0, "error", "step 0: UNKNOWN"),  # not retried
        (fakes.CountTo, 30.0, "timeout", "step 0: DEADLINE_EXCEEDED"),  # retried once, then given up
    ],
)
def test_grpc_failures_end_the_episode_with_their_reason(
    environment: type, hang_s: float, reason: str, detail: str
) -> None:
    with serving(environment) as (address, servicer):
        servicer.hang_s = hang_s
        source = get_environment(f"env:grpc:{address}", config=_Config())
        started = time.monotonic()
        with pytest.raises(EnvironmentFailed) as info:
            episode(source, {"id": "r1", "target": 2}, ["1"])
        assert time.monotonic() - started < 2 * TIMEOUT_S + 2.0
        assert info.value.reason == reason
        assert f"episode ep-test: {detail}" in str(info.value)
        assert servicer.closed == ["ep-test"]  # closed even after a failure
        steps = [c for c in servicer.calls if c[0] == "Step"]
        assert len(steps) == (2 if hang_s else 1)


def test_grpc_unreachable_service_is_retried_then_fails() -> None:
    source = RemoteSource("127.0.0.1:1", step_timeout_s=1.0, retries=2, backoff_s=0.01)
    with pytest.raises(EnvironmentFailed, match=r"reset: UNAVAILABLE: .* \(attempt 3\)") as info:
        asyncio.run(source.new_episode("e").reset({"id": "x"}))
    assert info.value.reason == "error"
    with pytest.raises(EnvironmentFailed, match=r"ListRecords\(eval, offset 0\): UNAVAILABLE"):
        source.eval_records(3)


def test_environment_service_follows_the_api_style() -> None:
    from parity.v1 import environment_pb2

    service = environment_pb2.DESCRIPTOR.services_by_name["EnvironmentService"]
    assert [m.name for m in service.methods] == ["Reset", "Step", "Close", "ListRecords"]
    for method in service.methods:
        assert method.input_type.name == f"{method.name}Request"
        assert method.output_type.name == f"{method.name}Response"
    for enum in environment_pb2.DESCRIPTOR.enum_types_by_name.values():
        assert enum.values[0].number == 0 and enum.values[0].name.endswith("_UNSPECIFIED")
    assert "step_index" in environment_pb2.StepRequest.DESCRIPTOR.fields_by_name
    assert {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    } == RETRYABLE
