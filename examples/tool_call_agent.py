"""An agent harness written against the OpenAI client, with a tool, training through Parity.

Each episode asks the model to add two numbers with an `add` tool: the harness runs the tool calls the
model makes (as `tool_calls` in the reply), sends the results back as `tool` messages, and scores the
final answer; the episodes of one question are finished under one group id, so they are published to
the run's Redis stream as one GRPO group. The rollout service keeps each episode's exact tokens, the
tool-call markup as sampled included; see docs/environments.md.

    export PARITY_ROLLOUT_AUTH_TOKEN=$(openssl rand -hex 16)
    parity serve rollout --model smollm2-135m --openai_port 8100 --run.redis_url redis://127.0.0.1:6379/0 &
    python examples/tool_call_agent.py --base_url http://127.0.0.1:8100/v1 --questions 2 --group_size 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import uuid

import httpx
import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


# the questions of the worked examples, each pair both ways round
WORKED = [(x, y) for a, b in ((12, 30), (4, 9), (21, 5)) for x, y in ((a, b), (b, a))]


def few_shot(examples: int = len(WORKED)) -> list[dict]:
    """A system prompt and `examples` worked examples of the call format (a small model learns it from
    them; each costs context)."""
    messages = [{"role": "system", "content": "Reply with a tool call."}]
    for x, y in WORKED[:examples]:
        call = json.dumps({"name": "add", "arguments": {"a": x, "b": y}})
        messages += [
            {"role": "user", "content": f"Add {x} and {y}."},
            {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        ]
    return messages


def add(arguments: str) -> str:
    """The tool: its result as text, or an error the model sees instead."""
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}"


def run_episode(
    api: openai.OpenAI,
    question: tuple[int, int],
    max_turns: int = 3,
    temperature: float = 1.0,
    examples: int = len(WORKED),
) -> tuple[str, float, list[str]]:
    """One episode in its own session: (session id, reward, what happened per turn)."""
    a, b = question
    session = f"agent-{uuid.uuid4().hex[:12]}"
    messages = [*few_shot(examples), {"role": "user", "content": f"Add {a} and {b}."}]
    log, reward = [], 0.0
    for _ in range(max_turns):
        reply = api.chat.completions.create(
            model="parity",
            messages=messages,
            tools=TOOLS,
            max_tokens=48,
            temperature=temperature,
            extra_headers={"X-Parity-Session": session},
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            reward = 1.0 if str(a + b) in (message.content or "") else 0.0
            log.append(f"answer {message.content!r}")
            break
        # send the reply back as it came, then one tool message per call
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            result = add(call.function.arguments) if call.function.name == "add" else "error: no such tool"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            log.append(f"{call.function.name}({call.function.arguments}) -> {result}")
    return session, reward, log


def finish(base_url: str, token: str, session: str, reward: float, group_id: str, group_size: int) -> dict:
    """The episode's reward; the service publishes the group once `group_size` episodes are in."""
    response = httpx.post(
        f"{base_url}/sessions/{session}/finish",
        json={"reward": reward, "group_id": group_id, "group_size": group_size},
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    )
    response.raise_for_status()
    return response.json()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base_url", default="http://127.0.0.1:8100/v1")
    parser.add_argument("--questions", type=int, default=2, help="GRPO groups to play")
    parser.add_argument("--group_size", type=int, default=4, help="episodes per question")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--examples", type=int, default=len(WORKED), choices=range(len(WORKED) + 1),
        help="worked examples of the call format in the prompt",
    )  # fmt: skip
    args = parser.parse_args(argv)
    token = os.environ.get("PARITY_ROLLOUT_AUTH_TOKEN", "")  # never on the command line
    api = openai.OpenAI(base_url=args.base_url, api_key=token or "none", max_retries=0, timeout=120)
    rng = random.Random(args.seed)
    for q in range(args.questions):
        question = (rng.randint(1, 49), rng.randint(1, 49))
        group_id = f"add-{args.seed}-{q}"
        for e in range(args.group_size):
            session, reward, log = run_episode(
                api, question, temperature=args.temperature, examples=args.examples
            )
            done = finish(args.base_url, token, session, reward, group_id, args.group_size)
            print(f"{group_id} episode {e}: reward {reward:.0f}; {'; '.join(log)}", flush=True)
        print(f"{group_id}: published {done['published']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
