"""Episodes token-in/token-out (rollout/episodes.py): the model's turns are exactly the engine's
tokens, observations are tokenized once with the chat template's delimiters, the next turn's prompt
is the exact token prefix, and every way an episode ends is recorded.

The tiny model's tokenizer spells `<|eos|>` character by character as seven tokens; decoding them
and encoding the text again gives the single end-of-sequence token. A turn that samples those seven
tokens is kept as sampled: a loop that re-tokenized its text would have trained on other tokens.
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from rollout.environments import LocalEnv
from rollout.environments.loading import get_environment
from rollout.episodes import TurnTemplate, retokenization_drift, run_episode
from rollout.tasks import Prompt
from rollout.tasks.chat import token_ids
from tests.fakes.environments import Raises
from tests.fakes.scripted_engine import ScriptedEngine

RECORD = {"id": "guess-8-5", "high": 8, "secret": 5, "max_guesses": 4}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def play(
    tokenizer,
    turns,
    record=RECORD,
    env="env:guess_number",
    max_turns=4,
    max_episode_tokens=512,
    max_tokens=64,
    max_model_len=None,
):
    engine = ScriptedEngine(tokenizer, turns)
    episode_env = env if not isinstance(env, str) else get_environment(env, seed=0).new_episode("g/0")
    template = TurnTemplate(tokenizer, chat_template=True)

    def first_prompt(observation: str) -> list[int]:
        return token_ids(tokenizer, Prompt("p", observation, ""), chat_template=True, system_prompt="")

    episode = asyncio.run(
        run_episode(
            episode_env, record, first_prompt, engine.generate, template,
            max_turns, max_episode_tokens, max_tokens, max_model_len=max_model_len,
        )
    )  # fmt: skip
    return episode, engine, template


def test_model_turns_are_the_engines_tokens_and_the_next_prompt_is_the_exact_prefix(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    # Turn 1 guesses 3, then spells "<|eos|>" as seven character tokens: its decoded text re-encodes
    # to other tokens. Turn 2 guesses 5 (correct) and ends with the real end-of-sequence token.
    spelled_eos = encode(tokenizer, "<") + encode(tokenizer, "|eos|>")
    turn1 = [*encode(tokenizer, "3"), *spelled_eos, eos]
    turn2 = [*encode(tokenizer, "5"), eos]
    assert encode(tokenizer, tokenizer.decode(spelled_eos)) != spelled_eos  # the case is real
    episode, engine, template = play(tokenizer, [turn1, turn2])
    assert episode.end == "done" and episode.reward > 0.5
    obs = episode.observations[0]
    obs_ids = template.observation_ids(obs, turn1)
    assert "<|user|>" in template.observation_text(obs, turn1)  # the template's own delimiters
    assert episode.token_ids == [*turn1, *obs_ids, *turn2]
    assert episode.loss_mask == [True] * len(turn1) + [False] * len(obs_ids) + [True] * len(turn2)
    # The second request's prompt is the first prompt plus exactly what came since.
    assert engine.prompts[1] == [*engine.prompts[0], *turn1, *obs_ids]
    assert episode.check_exact() == 0
    assert retokenization_drift(tokenizer, episode.prompt_token_ids, episode.token_ids) > 0
    # Per-token fields cover the model's tokens only, each with its own turn's version.
    assert len(episode.logprobs) == len(episode.weight_versions) == len(turn1) + len(turn2)
    assert episode.weight_versions == [3] * len(turn1) + [4] * len(turn2)
    roles = [(t.role, t.end - t.start) for t in episode.turns]
    assert roles == [("model", len(turn1)), ("environment", len(obs_ids)), ("model", len(turn2))]
    assert episode.turns[1].reward == 0.0 and episode.turns[-1].reward == episode.reward


def test_every_end_reason_is_recorded(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    wrong = [*encode(tokenizer, "1"), eos]
    episode, _, _ = play(tokenizer, [wrong] * 4, max_turns=2)
    assert episode.end == "max_turns" and len([t for t in episode.turns if t.role == "model"]) == 2
    episode, engine, _ = play(tokenizer, [wrong] * 4, max_episode_tokens=len(wrong) + 3)
    assert episode.end == "context_length" and len(engine.prompts) == 1  # the observation would not fit
    episode, _, _ = play(tokenizer, [[*encode(tokenizer, "1" * 20), eos]], max_tokens=4)
    assert episode.end == "context_length"  # a turn cut at max_tokens ends the episode
    broken = LocalEnv(Raises, name="raises", episode_id="g/0", step_timeout_s=5)
    episode, _, _ = play(tokenizer, [wrong] * 4, env=broken)
    assert episode.end == "environment_error" and episode.error and episode.error_reason == "error"


def test_an_episode_stays_within_the_engines_context_and_ends_context_length(tokenizer) -> None:
    """max_episode_tokens counts the episode after its prompt; the engine's max_model_len counts
    the prompt too. A turn whose prompt would reach it is never asked for (vLLM refuses such a
    request, which ended the actor's loop): the episode ends context_length, its last observation
    not appended, every request within the context."""
    eos = tokenizer.eos_token_id
    turns = [[*encode(tokenizer, "3"), eos], [*encode(tokenizer, "4"), eos], [*encode(tokenizer, "5"), eos]]
    whole, _, _ = play(tokenizer, turns)
    first_prompt = len(whole.prompt_token_ids)
    second_prompt = first_prompt + whole.turns[1].end  # prompt + turn 1 + its observation
    limit = second_prompt + 1  # room for turn 2's prompt and one token, not for a third prompt
    episode, engine, _ = play(tokenizer, turns, max_model_len=limit)
    assert episode.end == "context_length", episode.end
    assert all(len(p) + m <= limit for p, m in zip(engine.prompts, engine.max_tokens, strict=True))
    assert len(engine.prompts) == 2 and engine.max_tokens[1] == 1  # turn 2: the one token left
    assert episode.token_ids[-1] == turns[1][0]  # it ends on the model's token: no observation after it


def test_the_last_allowed_turn_ends_max_turns_with_no_observation_after_it(tokenizer) -> None:
    """An observation after the last turn the episode may take feeds no turn: appended, it was
    forwarded by the trainer every step and counted as environment tokens."""
    eos = tokenizer.eos_token_id
    turn1 = [*encode(tokenizer, "3"), eos]  # a wrong guess: the environment answers, not done
    episode, engine, _ = play(tokenizer, [turn1, turn1], max_turns=1)
    assert episode.end == "max_turns" and len(engine.prompts) == 1
    assert episode.token_ids == turn1 and episode.loss_mask == [True] * len(turn1)
    assert episode.turns[-1].role == "model" and episode.turns[-1].reward is not None
