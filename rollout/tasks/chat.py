"""How a prompt becomes token ids: the chat template on or off, with an optional system prompt.

Invariants:
  - `task.chat_template` on (the default) with no system prompt and a plain-text prompt is exactly
    the rollout engine's `encode(text, use_chat_template=True)`: one user turn plus the assistant cue.
  - With a system prompt, or a record given as `messages`, the turns go through the tokenizer's chat
    template (`add_generation_prompt=True`); a system prompt is put first unless the record has one.
  - Off: the prompt text is tokenized as is (the system prompt, if any, then a blank line, first).
    Records given as `messages` need the template, so `chat_template = false` with such records is
    refused when the run starts (`check_prompt_format`).
  - Training (the actor) and held-out evaluation (commands/run/evaluation.py) both call `token_ids`, so
    both see the same tokens for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.tasks.base import Prompt, TaskError


def chat_messages(prompt: Prompt, system_prompt: str) -> list[dict[str, str]]:
    turns = list(prompt.messages) or [("user", prompt.text)]
    if system_prompt and turns[0][0] != "system":
        turns.insert(0, ("system", system_prompt))
    return [{"role": role, "content": content} for role, content in turns]


def plain_text(prompt: Prompt, system_prompt: str) -> str:
    return f"{system_prompt}\n\n{prompt.text}" if system_prompt else prompt.text


def needs_tokenizer(prompt: Prompt, chat_template: bool, system_prompt: str) -> bool:
    """False when the rollout service can render the prompt itself from prompt_text (the gRPC path)."""
    return chat_template and bool(prompt.messages or system_prompt)


def request_text(prompt: Prompt, chat_template: bool, system_prompt: str) -> str:
    """The prompt_text of a GenerateRequest when `needs_tokenizer` is False."""
    return prompt.text if chat_template else plain_text(prompt, system_prompt)


def token_ids(tokenizer, prompt: Prompt, chat_template: bool, system_prompt: str) -> list[int]:
    """The prompt's token ids under the task's chat settings (module docstring)."""
    if not chat_template:
        return [int(t) for t in tokenizer.encode(plain_text(prompt, system_prompt), add_special_tokens=True)]
    ids = tokenizer.apply_chat_template(
        chat_messages(prompt, system_prompt), add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def check_prompt_format(prompts: Iterable[Prompt], chat_template: bool) -> None:
    if chat_template:
        return
    for prompt in prompts:
        if prompt.messages:
            raise TaskError(
                f"task.chat_template: off, but record {prompt.prompt_id!r} is given as messages, "
                "which only the chat template can render"
            )
