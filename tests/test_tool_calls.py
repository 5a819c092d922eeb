"""Structured tool calls on the OpenAI endpoint (rollout/tool_calls.py, rollout/sessions.py,
services/rollout/openai_api.py): read out of the reply's text, returned as `tool_calls`, accepted
back in the session's history, while the episode keeps the engine's exact tokens.

The session tests drive the session book with the tiny tokenizer and hand-made engine results, as
tests/test_openai_endpoint.py does; a real engine cannot be made to write a call here (the tiny
model's weights are random), so the endpoint's side is its `chat_message` function and, in
test_openai_endpoint.py, the validation of tool calls on a real service.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rollout.sessions import MessageTemplate, SamplingKey, SessionBook, SessionRefused, normalize_messages
from rollout.tool_calls import ToolCall, openai_tool_calls, parse_tool_calls
from services.rollout.openai_api import chat_message
from tests.test_openai_endpoint import encode, result

KEY = SamplingKey(temperature=1.0, top_p=1.0, top_k=0)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_hermes_calls_are_read_with_the_text_around_them() -> None:
    assert parse_tool_calls(f"Let me add. {CALL}", "hermes") == (
        "Let me add.",
        [ToolCall("add", {"a": 2, "b": 3})],
    )
    two = f'{CALL}<tool_call>{{"name": "neg", "parameters": "{{\\"x\\": 1}}"}}</tool_call>'
    assert parse_tool_calls(two, "hermes") == (
        "",
        [ToolCall("add", {"a": 2, "b": 3}), ToolCall("neg", {"x": 1})],
    )
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>', "hermes") == ("", [ToolCall("now", {})])


@pytest.mark.parametrize(
    "text",
    [
        "no call at all",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>["add"]</tool_call>',
        f'{CALL}<tool_call>{{"name": "add", "arg',  # the turn ended inside the second call
        f"{CALL}<tool_call>oops</tool_call>",  # all or nothing
    ],
)
def test_a_reply_that_is_not_well_formed_calls_stays_text(text: str) -> None:
    assert parse_tool_calls(text, "hermes") == (text, [])


def test_llama3_json_reads_a_reply_that_is_only_calls() -> None:
    one = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    assert parse_tool_calls(one, "llama3_json") == ("", [ToolCall("add", {"a": 2, "b": 3})])
    two = '<|python_tag|>{"name": "say", "parameters": {"s": "a;b"}}; {"name": "now", "arguments": {}};'
    assert parse_tool_calls(two, "llama3_json") == ("", [ToolCall("say", {"s": "a;b"}), ToolCall("now", {})])
    assert parse_tool_calls(f"{one}\n{one}", "llama3_json") == ("", [ToolCall("add", {"a": 2, "b": 3})] * 2)
    for text in (f"Sure: {one}", f"{one} and then some", '{"name": "add"', '{"nam": "add"}', CALL):
        assert parse_tool_calls(text, "llama3_json") == (text, []), text
    assert parse_tool_calls(one, "hermes") == (one, [])  # each parser reads its own format only


def test_parser_none_never_reads_calls() -> None:
    assert parse_tool_calls(CALL, "none") == (CALL, [])


def test_the_endpoint_returns_calls_only_when_the_call_offered_tools() -> None:
    message, finish = chat_message(f"Sure. {CALL}", "stop", TOOLS, "hermes", "req_0")
    assert finish == "tool_calls" and message["content"] == "Sure."
    assert message["tool_calls"] == [
        {
            "id": "call_req_0_0",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
    ]
    assert chat_message(CALL, "stop", TOOLS, "hermes", "r")[0]["content"] is None  # OpenAI's null content
    assert chat_message(CALL, "length", TOOLS, "hermes", "r")[1] == "length"
    for tools, parser in ((None, "hermes"), (TOOLS, "none")):
        assert chat_message(CALL, "stop", tools, parser, "r") == (
            {"role": "assistant", "content": CALL},
            "stop",
        )


def _first_turn(tokenizer, book: SessionBook, reply: str):
    """A chat session offered TOOLS whose first model turn sampled `reply` (then end of sequence)."""
    template = MessageTemplate(tokenizer)
    first = [{"role": "user", "content": "What is 2+3?"}]
    session = book.acquire("t", "chat", KEY)
    plan = book.plan_chat(session, first, TOOLS, template)
    session.tools = TOOLS  # as the endpoint sets it after a first call's plan
    turn = [*encode(tokenizer, reply), tokenizer.eos_token_id]
    book.commit(session, plan, result(tokenizer, turn, 1), 32, "hermes")
    book.release(session)
    return template, first, turn


def _as_returned(reply: str) -> dict:
    """The assistant message as a harness sends it back: the endpoint's message, OpenAI-shaped."""
    message, _ = chat_message(reply, "stop", TOOLS, "hermes", "req_0")
    return message


def test_a_reply_sent_back_as_its_tool_calls_extends_the_session_with_the_exact_tokens(tokenizer) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    template, first, turn1 = _first_turn(tokenizer, book, f"Adding. {CALL}")
    tool = {"role": "tool", "tool_call_id": "call_req_0_0", "content": "5"}
    messages = [*first, _as_returned(f"Adding. {CALL}"), tool]
    session = book.acquire("t", "chat", KEY)
    plan = book.plan_chat(session, normalize_messages(messages), TOOLS, template)
    assert plan.env_ids == encode(tokenizer, "\n<|tool|>5\n<|assistant|>")  # only the tool's answer
    turn2 = [*encode(tokenizer, "5"), tokenizer.eos_token_id]
    book.commit(session, plan, result(tokenizer, turn2, 2), 32, "hermes")
    book.release(session)
    episode = session.episode
    assert episode.token_ids == [*turn1, *plan.env_ids, *turn2]  # the call's markup as sampled
    assert episode.loss_mask == [True] * len(turn1) + [False] * len(plan.env_ids) + [True] * len(turn2)
    assert episode.check_exact() == 0
    # the same reply sent back as its text works as before
    book2 = SessionBook(max_sessions=4, session_ttl_s=60)
    template, first, _ = _first_turn(tokenizer, book2, f"Adding. {CALL}")
    text_reply = {"role": "assistant", "content": tokenizer.decode(turn1, skip_special_tokens=True)}
    held = book2.acquire("t", "chat", KEY)
    assert book2.plan_chat(held, normalize_messages([*first, text_reply, tool]), TOOLS, template).env_ids


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["tool_calls"][0]["function"].update(arguments='{"a": 2, "b": 4}'),
        lambda m: m["tool_calls"][0]["function"].update(name="sub"),
        lambda m: m["tool_calls"].append(json.loads(json.dumps(m["tool_calls"][0]))),
        lambda m: m.update(content="I changed my mind."),
    ],
)
def test_tool_calls_the_model_did_not_sample_are_refused_and_the_session_kept(tokenizer, change) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    template, first, turn1 = _first_turn(tokenizer, book, f"Adding. {CALL}")
    reply = _as_returned(f"Adding. {CALL}")
    change(reply)
    held = book.acquire("t", "chat", KEY)
    before = list(held.episode.token_ids)
    with pytest.raises(SessionRefused) as refused:
        book.plan_chat(
            held, normalize_messages([*first, reply, {"role": "tool", "content": "6"}]), TOOLS, template
        )
    assert refused.value.code == "session_history_mismatch" and "message 1" in refused.value.message
    assert held.episode.token_ids == before == turn1


def test_a_reply_without_calls_cannot_come_back_as_calls(tokenizer) -> None:
    book = SessionBook(max_sessions=4, session_ttl_s=60)
    template, first, _ = _first_turn(tokenizer, book, "5")
    invented = {
        "role": "assistant",
        "content": "5",
        "tool_calls": openai_tool_calls([ToolCall("add", {})], "x"),
    }
    held = book.acquire("t", "chat", KEY)
    with pytest.raises(SessionRefused, match="message 1"):
        book.plan_chat(
            held, normalize_messages([*first, invented, {"role": "user", "content": "ok"}]), TOOLS, template
        )


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": "x", "tool_calls": []}, None),  # empty: no calls
        ({"role": "user", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": "add"}, "messages[0].tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [{"type": "code"}]}, "messages[0].tool_calls[0]"),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "", "arguments": "{}"}}],
            },
            "messages[0].tool_calls[0].function.name",
        ),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_tool_calls_are_refused_naming_the_field(message: dict, param: str | None) -> None:
    if param is None:
        assert "tool_calls" not in normalize_messages([message])[0]
        return
    with pytest.raises(SessionRefused) as refused:
        normalize_messages([message])
    assert refused.value.kind == "invalid" and refused.value.param == param
