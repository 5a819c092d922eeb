"""Tasks: deterministic prompt streams, held-out eval sets, verifiable rewards."""

from __future__ import annotations

import itertools

import pytest

from rollout.tasks import Prompt, get_task


def test_train_stream_is_deterministic_given_the_seed() -> None:
    first = list(itertools.islice(get_task("arithmetic", seed=3).train_prompts(), 50))
    again = list(itertools.islice(get_task("arithmetic", seed=3).train_prompts(), 50))
    other = list(itertools.islice(get_task("arithmetic", seed=4).train_prompts(), 50))
    assert first == again
    assert first != other
    assert len({p.prompt_id for p in first}) > 30  # a stream, not one prompt repeated


def test_eval_prompts_never_appear_in_training() -> None:
    for seed in (0, 1):
        task = get_task("arithmetic", seed=seed)
        held_out = {p.text for p in task.eval_prompts(100)}
        assert len(held_out) == 100
        train = {p.text for p in itertools.islice(task.train_prompts(), 5000)}
        assert not held_out & train
    assert get_task("arithmetic", seed=0).eval_prompts(20) == get_task("arithmetic", seed=9).eval_prompts(20)


def test_prompt_asks_for_just_the_number() -> None:
    prompt = get_task("arithmetic").eval_prompts(1)[0]
    a, b = prompt.text.removeprefix("What is ").split("?")[0].split(" + ")
    assert int(prompt.answer) == int(a) + int(b)
    assert "just the number" in prompt.text


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("19", 1.0),
        (" 19.", 1.0),
        ("The answer is 19", 1.0),
        ("19 or maybe 20", 1.0),
        ("20, no wait, 19", 0.0),
        ("nineteen", 0.0),
        ("", 0.0),
        ("-19", 0.0),
        ("190", 0.0),
    ],
)
def test_reward_is_the_first_integer(completion: str, reward: float) -> None:
    task = get_task("arithmetic")
    assert (
        task.reward(Prompt("p", "What is 7 + 12? Answer with just the number.", "19"), completion) == reward
    )


def test_unknown_task_names_the_field() -> None:
    with pytest.raises(ValueError, match="task"):
        get_task("chess")
