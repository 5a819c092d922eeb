"""Structured tool calls read out of a model's reply, for the OpenAI endpoint's `tool_calls`.

    content, calls = parse_tool_calls(text, "hermes")
        text:    'Let me add.<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>'
        content: 'Let me add.'          calls: [ToolCall("add", {"a": 2, "b": 3})]

Formats (`rollout.openai_tool_parser`):
- `hermes`: each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>`, the format of the Hermes, Qwen2.5, Qwen3 and SmolLM3 chat templates (`parameters`
  is read as `arguments`, and arguments given as a JSON string are read as the object it holds).
- `llama3_json`: the whole reply is one JSON object `{"name": ..., "parameters": {...}}` (or several,
  separated by `;` or white space), optionally after `<|python_tag|>`: the Llama 3.1/3.2 templates' format for
  custom tools. A reply with any other text is text.
- `none`: never parsed; the reply is text.

Invariants:
- Parsing reads the reply's text and never changes its tokens: the episode keeps the engine's exact
  sampled tokens, `<tool_call>` markup included, whatever is parsed out of them.
- All or nothing: a reply with a block that is not a well-formed call (bad JSON, no name, arguments
  that are not an object, an unclosed `<tool_call>`) has no calls and stays text, as it was sampled.
- A call compares by name and arguments (as JSON values); `call_id`s only label the reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from parity.config.rollout import ToolParserName

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str, parser: ToolParserName) -> tuple[str, list[ToolCall]]:
    """(the reply's text outside the calls, stripped; the calls in order); ([text], []) when none."""
    if parser == "llama3_json":
        return _llama3_json(text)
    if parser == "none" or "<tool_call>" not in text:
        return text, []
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks or text.count("<tool_call>") != len(blocks):
        return text, []  # an unclosed call: the turn ended inside it
    calls = []
    for block in blocks:
        call = _json_call(block)
        if call is None:
            return text, []
        calls.append(call)
    return _HERMES_BLOCK.sub("", text).strip(), calls


def _llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):  # objects one after another, `;` or white space between them
        try:
            obj, at = decoder.raw_decode(body, at)  # anything but an object here: the reply is text
        except ValueError:
            return text, []
        call = _call(obj)
        if call is None:
            return text, []
        calls.append(call)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return "", calls


def _json_call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    return _call(obj)


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    arguments = arguments_object(arguments)
    return None if arguments is None else ToolCall(obj["name"], arguments)


def arguments_object(arguments: object) -> dict | None:
    """A call's arguments as an object: a dict as is, a JSON string holding an object read; else None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def openai_tool_calls(calls: list[ToolCall], id_prefix: str) -> list[dict]:
    """The calls as an OpenAI chat message's `tool_calls` (arguments as a JSON string)."""
    return [
        {
            "id": f"call_{id_prefix}_{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for i, call in enumerate(calls)
    ]
