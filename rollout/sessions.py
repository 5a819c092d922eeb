"""Episode sessions: the calls an agent harness makes through the OpenAI-compatible endpoint
(services/rollout/openai_api.py), kept as one exact token sequence and published as rollouts.

    call 1 (session s, messages M0):  ids = chat_template(M0, add_generation_prompt)     # rendered once
        turn = engine(ids)            episode += turn.token_ids (mask 1, logprobs, versions)
                                      recorded = M0 + [assistant: turn.text]
                                      (with the tool calls read in turn.text when M0's call had tools)
    call 2 (session s, messages M1):  M1 must start with `recorded` (else EditedHistory: 409); the
                                      model's reply may come back as its text or as those tool calls
        new = M1[len(recorded):]      # user / tool / system messages, at least one
        env = template delimiters after the model's last token + new + the assistant cue  # tokenized once
        episode += env (mask 0);      turn = engine(prompt + episode.token_ids) ...
    finish(s, reward, group_id, group_size): the episode -> a RolloutSample; `group_size` episodes
        finished under one group id -> one RolloutGroup (published by the caller), or dropped after
        `group_timeout_s`.

Invariants:
- Token-in/token-out: a session's tokens are the first render, then per call the environment tokens
  of the new messages and the engine's own sampled tokens; earlier turns are never re-rendered or
  re-tokenized from the harness's text. `Episode.check_exact` holds (0 mismatches) for every
  published episode; one that fails it is dropped with its group.
- A session changes only when a call succeeded: a refused or failed call leaves it as it was, so the
  harness may retry. One call per session at a time (a second concurrent one is refused: busy).
- A session keeps the sampling transform of its first call (temperature, top_p, top_k): the trainer
  recomputes every token under its group's one transform. Episodes of one group share their prompt
  tokens and that transform; a finish that would break this is refused and the session kept.
- Completions sessions are the same over text: a prompt must start with the session's text (or,
  given as token ids, with its exact tokens); only the new suffix is tokenized.
- Bounded: at most `max_sessions` open sessions; a session idle for `session_ttl_s` and a group
  incomplete after `group_timeout_s` are dropped and counted, never published half-done.
"""

from __future__ import annotations

import collections
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import Counter

from parity.v1 import common_pb2, rollouts_pb2
from rollout import metrics
from rollout.engine import FINISH_REASONS, CompletionResult
from rollout.episodes import Episode, TurnRecord, TurnTemplate, retokenization_drift
from rollout.tool_calls import ToolCall, ToolParserName, arguments_object, parse_tool_calls

RefusalKind = Literal["invalid", "conflict", "not_found", "busy", "limit"]
SessionKind = Literal["chat", "completion"]
FinishEnd = Literal["done", "max_turns", "context_length"]
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
EPISODE_ENDS = {
    "done": rollouts_pb2.EPISODE_END_DONE,
    "max_turns": rollouts_pb2.EPISODE_END_MAX_TURNS,
    "context_length": rollouts_pb2.EPISODE_END_CONTEXT_LENGTH,
}
FINISHED_IDS_KEPT = 4096

SESSIONS_EXPIRED = Counter(
    "parity_rollout_openai_sessions_expired", "OpenAI-endpoint sessions dropped unfinished after the TTL."
)
GROUPS_PUBLISHED = Counter(
    "parity_rollout_openai_groups_published", "Groups of OpenAI-endpoint episodes published."
)
GROUPS_DROPPED = Counter(
    "parity_rollout_openai_groups_dropped",
    "Groups of OpenAI-endpoint episodes dropped, never published (timeout: group_size not reached).",
    ["reason"],
)


class SessionRefused(Exception):
    """A call or finish the session book refuses; `kind` decides the HTTP status (openai_api)."""

    def __init__(self, kind: RefusalKind, param: str, message: str, code: str = "") -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.kind, self.param, self.message, self.code = kind, param, message, code


@dataclass(frozen=True)
class SamplingKey:
    """The transform every token of a session (and of a group) is sampled and trained under."""

    temperature: float
    top_p: float
    top_k: int


def normalize_messages(messages: object, param: str = "messages") -> list[dict]:
    """OpenAI chat messages -> [{"role", "content"}, ...] with string content (text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise SessionRefused("invalid", param, "must be a non-empty array of messages")
    out = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise SessionRefused("invalid", where, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            raise SessionRefused("invalid", f"{where}.role", f"must be one of {sorted(ROLES)} (got {role!r})")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise SessionRefused(
                        "invalid",
                        f"{where}.content[{j}]",
                        "only text parts ({type: text, text}) are supported",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise SessionRefused("invalid", f"{where}.content", "must be a string or an array of text parts")
        normal = {"role": role, "content": content}
        if message.get("tool_calls"):
            if role != "assistant":
                raise SessionRefused(
                    "invalid", f"{where}.tool_calls", "only assistant messages carry tool calls"
                )
            normal["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            normal["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            normal["name"] = message["name"]
        out.append(normal)
    return out


def _normalize_tool_calls(calls: object, where: str) -> list[dict]:
    """OpenAI `tool_calls` -> [{"type": "function", "function": {"name", "arguments": {...}}}], the
    form chat templates render (arguments as an object, not a JSON string)."""
    if not isinstance(calls, list):
        raise SessionRefused("invalid", where, "must be an array of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise SessionRefused(
                "invalid", f"{where}[{j}]", "must be {type: function, function: {name, arguments}}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise SessionRefused("invalid", f"{where}[{j}].function.name", "must be a non-empty string")
        arguments = arguments_object(function.get("arguments", {}))
        if arguments is None:
            raise SessionRefused(
                "invalid",
                f"{where}[{j}].function.arguments",
                "must be a JSON object (or a string holding one)",
            )
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _calls(message: dict) -> list[ToolCall]:
    return [
        ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]


def _same_message(recorded: dict, given: dict) -> bool:
    if recorded["role"] != given["role"]:
        return False
    if "sampled_calls" in recorded:  # the model's own reply, as `commit` recorded it
        if given.get("tool_calls"):  # sent back as the structured calls the endpoint parsed out of it
            return recorded["sampled_calls"] == _calls(given) and (
                recorded["sampled_content"].strip() == given["content"].strip()
            )
        return recorded["content"].strip() == given["content"].strip()  # harnesses often strip it
    if recorded["role"] == "assistant":
        return recorded["content"].strip() == given["content"].strip() and _calls(recorded) == _calls(given)
    return recorded["content"] == given["content"]


def _ids(rendered) -> list[int]:
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return [int(t) for t in rendered]


class MessageTemplate:
    """The chat template, used twice: the first render of a session's messages, and the tokens of
    new messages after a model turn (the template's own delimiters, as `TurnTemplate` renders an
    observation, for any roles and any number of messages), each tokenized once."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise SessionRefused(
                "invalid", "messages", "the model's tokenizer has no chat template: use /v1/completions"
            )
        self.tokenizer = tokenizer
        self._probe = [
            {"role": "user", "content": TurnTemplate.PROBE_USER},
            {"role": "assistant", "content": TurnTemplate.PROBE_ASSISTANT},
        ]
        self._base = tokenizer.apply_chat_template(self._probe, tokenize=False)
        if TurnTemplate.PROBE_ASSISTANT not in self._base:
            raise SessionRefused("invalid", "messages", "the chat template drops assistant messages")
        at = self._base.index(TurnTemplate.PROBE_ASSISTANT) + len(TurnTemplate.PROBE_ASSISTANT)
        self._after_assistant = self._base[at:]
        eos = tokenizer.eos_token_id
        self._eos_id = eos
        self._eos_text = tokenizer.decode([eos]) if eos is not None else ""

    def first_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **kwargs
            )
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            raise SessionRefused("invalid", "messages", f"the chat template refused them: {exc}") from None
        return _ids(rendered)

    def continuation_text(self, new_messages: list[dict], model_turn_ids: Sequence[int]) -> str:
        try:
            more = self.tokenizer.apply_chat_template(
                [*self._probe, *new_messages], tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:
            raise SessionRefused("invalid", "messages", f"the chat template refused them: {exc}") from None
        if not more.startswith(self._base):
            raise SessionRefused(
                "invalid",
                "messages",
                "the chat template does not extend a conversation by appending these messages",
            )
        gap = self._after_assistant
        if model_turn_ids and model_turn_ids[-1] == self._eos_id and gap.startswith(self._eos_text):
            gap = gap[len(self._eos_text) :]  # the model already sampled the end-of-turn token
        return gap + more[len(self._base) :]

    def continuation_ids(self, new_messages: list[dict], model_turn_ids: Sequence[int]) -> list[int]:
        text = self.continuation_text(new_messages, model_turn_ids)
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]


def reply_tool_calls(text: str, tools: list | None, parser: ToolParserName) -> tuple[str, list[ToolCall]]:
    """The reply's text outside its tool calls and the calls, when the call offered tools; else (text, [])."""
    return parse_tool_calls(text, parser) if tools else (text, [])


@dataclass
class Session:
    session_id: str
    kind: SessionKind
    sampling: SamplingKey
    tools: list | None = None
    episode: Episode = field(default_factory=Episode)
    messages: list[dict] = field(default_factory=list)  # chat: the conversation the tokens are
    text: str = ""  # completion: the prompt and completions, as text
    max_tokens: int = 0  # the largest max_tokens of its calls (the group's sampling record)
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def started(self) -> bool:
        return bool(self.episode.prompt_token_ids)

    def all_ids(self) -> list[int]:
        return [*self.episode.prompt_token_ids, *self.episode.token_ids]


@dataclass
class TurnPlan:
    """One call's prompt, before the engine runs: committed to the session only if it succeeds."""

    prompt_ids: list[int]  # what the engine is asked to continue: the session's tokens + env_ids
    env_ids: list[int]  # tokens of the new messages (mask 0); the whole prompt on a first call
    new_messages: list[dict] = field(default_factory=list)
    new_text: str = ""
    first: bool = False


class SessionBook:
    """Open sessions by id (module docstring). Not thread-safe: used from the event loop, except
    `plan_*`, which only read a session that the caller holds busy."""

    def __init__(self, max_sessions: int, session_ttl_s: float) -> None:
        self.max_sessions = max_sessions
        self.session_ttl_s = session_ttl_s
        self.sessions: dict[str, Session] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.expired = 0

    def acquire(self, session_id: str, kind: SessionKind, sampling: SamplingKey) -> Session:
        """The session (created on its first call), marked busy; `release` it after the call."""
        if session_id in self._finished:
            raise SessionRefused("conflict", "session_id", f"session {session_id!r} was already finished")
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.max_sessions:
                raise SessionRefused(
                    "limit",
                    "session_id",
                    f"{len(self.sessions)} sessions open (rollout.openai_max_sessions); finish some first",
                )
            session = self.sessions[session_id] = Session(session_id, kind, sampling)
        if session.busy:
            raise SessionRefused("busy", "session_id", f"a call for session {session_id!r} is in flight")
        if session.kind != kind:
            raise SessionRefused(
                "conflict", "session_id", f"session {session_id!r} is a {session.kind} session"
            )
        for name in ("temperature", "top_p", "top_k"):
            if getattr(sampling, name) != getattr(session.sampling, name):
                raise SessionRefused(
                    "invalid",
                    name,
                    f"{getattr(sampling, name)} differs from this session's first call "
                    f"({getattr(session.sampling, name)}): an episode is trained under one sampling transform",
                )
        session.busy = True
        return session

    def release(self, session: Session) -> None:
        session.busy = False
        session.last_used = time.monotonic()
        if not session.started:  # its first call failed: nothing to keep
            self.sessions.pop(session.session_id, None)

    # -- one call -------------------------------------------------------------------------------
    @staticmethod
    def plan_chat(
        session: Session, messages: list[dict], tools: list | None, template: MessageTemplate
    ) -> TurnPlan:
        if not session.started:
            ids = template.first_ids(messages, tools)
            return TurnPlan(ids, ids, list(messages), first=True)
        if (tools or None) != session.tools:
            raise SessionRefused("conflict", "tools", "differ from the tools of this session's first call")
        recorded = session.messages
        if len(messages) <= len(recorded) or not all(
            _same_message(r, g) for r, g in zip(recorded, messages, strict=False)
        ):
            at = next(
                (
                    i
                    for i, (r, g) in enumerate(zip(recorded, messages, strict=False))
                    if not _same_message(r, g)
                ),
                min(len(recorded), len(messages)),
            )
            raise SessionRefused(
                "conflict",
                "messages",
                f"do not extend this session's conversation (they differ from it at message {at}; "
                f"the session holds {len(recorded)} messages, the last being the model's reply): the "
                "session keeps the exact tokens the model saw and never re-tokenizes edited history. "
                "Send the conversation as returned plus new messages, or start a new session",
                code="session_history_mismatch",
            )
        new = messages[len(recorded) :]
        if any(m["role"] == "assistant" for m in new):
            raise SessionRefused(
                "conflict",
                "messages",
                "a new assistant message that the model did not sample: only the model's own replies "
                "may appear as assistant turns in a session",
                code="session_history_mismatch",
            )
        last_turn = session.episode.engine_turns[-1] if session.episode.engine_turns else []
        env_ids = template.continuation_ids(new, last_turn)
        return TurnPlan([*session.all_ids(), *env_ids], env_ids, new)

    @staticmethod
    def plan_completion(session: Session, prompt: str | list[int], tokenizer) -> TurnPlan:
        if not session.started:
            if isinstance(prompt, str):
                ids = [int(t) for t in tokenizer.encode(prompt, add_special_tokens=True)]
            else:
                ids = list(prompt)
            return TurnPlan(ids, ids, new_text=prompt if isinstance(prompt, str) else "", first=True)
        if isinstance(prompt, list):
            held = session.all_ids()
            if len(prompt) <= len(held) or prompt[: len(held)] != held:
                raise SessionRefused(
                    "conflict",
                    "prompt",
                    "token ids do not extend this session's exact tokens (prompt, completions, appended "
                    "tokens): the session never re-tokenizes edited history",
                    code="session_history_mismatch",
                )
            env_ids = prompt[len(held) :]
            return TurnPlan(list(prompt), env_ids, new_text=tokenizer.decode(env_ids))
        if len(prompt) <= len(session.text) or not prompt.startswith(session.text):
            raise SessionRefused(
                "conflict",
                "prompt",
                "does not extend this session's text (its first prompt, then each completion as "
                "returned): the session never re-tokenizes edited history",
                code="session_history_mismatch",
            )
        suffix = prompt[len(session.text) :]
        env_ids = [int(t) for t in tokenizer.encode(suffix, add_special_tokens=False)]
        return TurnPlan([*session.all_ids(), *env_ids], env_ids, new_text=suffix)

    @staticmethod
    def commit(
        session: Session,
        plan: TurnPlan,
        result: CompletionResult,
        max_tokens: int,
        tool_parser: ToolParserName = "none",
    ) -> None:
        """Record a successful call: the new messages' tokens (mask 0), then the model's turn. A chat
        session with tools also records the calls `tool_parser` reads in the reply, so that the
        harness may send the reply back as those structured calls."""
        episode = session.episode
        if plan.first:
            episode.prompt_token_ids = list(plan.prompt_ids)
            episode.first_observation = (
                plan.new_messages[-1]["content"] if plan.new_messages else plan.new_text
            )
        elif plan.env_ids:
            start = len(episode.token_ids)
            episode.token_ids += plan.env_ids
            episode.loss_mask += [False] * len(plan.env_ids)
            episode.turns.append(TurnRecord("environment", start, len(episode.token_ids)))
            episode.observations.append(
                "\n".join(m["content"] for m in plan.new_messages) if plan.new_messages else plan.new_text
            )
        start = len(episode.token_ids)
        episode.engine_turns.append(list(result.token_ids))
        episode.token_ids += result.token_ids
        episode.loss_mask += [True] * len(result.token_ids)
        episode.logprobs += result.logprobs
        episode.weight_versions += result.token_weight_versions
        episode.context_versions += result.token_context_versions or result.token_weight_versions
        episode.turns.append(TurnRecord("model", start, len(episode.token_ids), None, result.finish_reason))
        episode.actions.append(result.text)
        if session.kind == "chat":
            content, calls = reply_tool_calls(result.text, session.tools, tool_parser)
            reply = {
                "role": "assistant",
                "content": result.text,
                "sampled_content": content,
                "sampled_calls": calls,
            }
            session.messages += [*plan.new_messages, reply]
        else:
            session.text += plan.new_text + result.text
        session.max_tokens = max(session.max_tokens, max_tokens)

    # -- finishing --------------------------------------------------------------------------------
    def take(self, session_id: str) -> Session:
        """The session to finish (still open: `close` it once its sample is accepted)."""
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._finished:
                raise SessionRefused("conflict", "session_id", f"session {session_id!r} was already finished")
            raise SessionRefused("not_found", "session_id", f"no open session {session_id!r}")
        if session.busy:
            raise SessionRefused("busy", "session_id", f"a call for session {session_id!r} is in flight")
        return session

    def close(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        self._finished[session.session_id] = None
        while len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop sessions idle for longer than the TTL (counted); returns their ids."""
        now = time.monotonic() if now is None else now
        stale = [
            s.session_id
            for s in self.sessions.values()
            if not s.busy and now - s.last_used > self.session_ttl_s
        ]
        for session_id in stale:
            del self.sessions[session_id]
            self.expired += 1
            SESSIONS_EXPIRED.inc()
        return stale


def episode_sample(session: Session, reward: float, end: FinishEnd, tokenizer) -> rollouts_pb2.RolloutSample:
    """The finished session as a RolloutSample (the same fields the actor's episodes carry; its
    rollout id is set by `GroupBook.add`)."""
    episode = session.episode
    episode.reward = reward
    episode.end = end
    model_turns = [t for t in episode.turns if t.role == "model"]
    model_turns[-1].reward = reward  # the episode's return, given in answer to its last model turn
    episode.check_exact()
    drift = retokenization_drift(tokenizer, episode.prompt_token_ids, episode.token_ids)
    metrics.RETOKENIZATION_DRIFT.inc(drift)
    metrics.EPISODES.labels(end=end).inc()
    metrics.EPISODE_TURNS.inc(len(model_turns))
    sample = rollouts_pb2.RolloutSample(
        token_ids=episode.token_ids,
        logprobs=episode.logprobs,
        token_weight_versions=episode.weight_versions,
        token_context_versions=episode.context_versions,
        text=episode.text(tokenizer),
        reward=reward,
        finish_reason=FINISH_REASONS[model_turns[-1].finish_reason],
        loss_mask=episode.loss_mask,
        episode_end=EPISODE_ENDS[end],
        token_mismatches=episode.token_mismatches,
        retokenization_drift=drift,
    )
    for turn in episode.turns:
        proto_turn = sample.turns.add(
            role=rollouts_pb2.TURN_ROLE_MODEL if turn.role == "model" else rollouts_pb2.TURN_ROLE_ENVIRONMENT,
            start=turn.start,
            end=turn.end,
            finish_reason=FINISH_REASONS[turn.finish_reason] if turn.finish_reason else 0,
        )
        if turn.reward is not None:
            proto_turn.reward = turn.reward
    return sample


@dataclass
class PendingGroup:
    key: str  # the harness's group id
    group_id: str  # the published one: unique per service run, so a reused key is never deduped
    size: int
    prompt_token_ids: list[int]
    prompt_text: str
    sampling: SamplingKey
    samples: list[rollouts_pb2.RolloutSample] = field(default_factory=list)
    max_tokens: int = 0
    created: float = field(default_factory=time.monotonic)


class GroupBook:
    """Finished episodes waiting for the rest of their group (module docstring)."""

    def __init__(self, group_timeout_s: float, worker_id: str, task: str, logprobs_mode: int) -> None:
        self.group_timeout_s = group_timeout_s
        self.worker_id = worker_id
        self.task = task
        self.logprobs_mode = logprobs_mode
        self.pending: dict[str, PendingGroup] = {}
        self.dropped = 0
        self._run_id = uuid.uuid4().hex[:8]
        self._counter = itertools.count()

    def new_group_id(self) -> str:
        return f"{self.worker_id}-openai-{self._run_id}-{next(self._counter)}"

    def check(self, key: str, size: int, session: Session) -> None:
        """Refuse (before the session is consumed) an episode that cannot join group `key`."""
        group = self.pending.get(key)
        if not session.episode.turns:
            raise SessionRefused("conflict", "session_id", "the session has no model turn to train on")
        if group is None:
            return
        if size != group.size:
            raise SessionRefused(
                "conflict", "group_size", f"{size} differs from the group's group_size {group.size}"
            )
        if session.episode.prompt_token_ids != group.prompt_token_ids:
            raise SessionRefused(
                "conflict",
                "group_id",
                "this episode's prompt tokens differ from the group's first episode: the episodes of "
                "one group share their prompt (GRPO compares them)",
            )
        if session.sampling != group.sampling:
            raise SessionRefused(
                "conflict",
                "group_id",
                f"this episode's sampling {session.sampling} differs from the group's {group.sampling}",
            )

    def add(
        self, key: str, size: int, session: Session, sample: rollouts_pb2.RolloutSample
    ) -> rollouts_pb2.RolloutGroup | None:
        """Add a finished episode to the group the harness calls `key` (its rollout id is set
        here); the whole group once `size` episodes are in, else None."""
        self.check(key, size, session)
        group = self.pending.get(key)
        if group is None:
            first = session.episode
            group = self.pending[key] = PendingGroup(
                key,
                f"{self.new_group_id()}:{key}"[:200],
                size,
                list(first.prompt_token_ids),
                first.first_observation,
                session.sampling,
            )
        sample.rollout_id = f"{group.group_id}/{len(group.samples)}"
        group.samples.append(sample)
        group.max_tokens = max(group.max_tokens, session.max_tokens)
        if len(group.samples) < group.size:
            return None
        del self.pending[key]
        return self.build(group)

    def build(self, group: PendingGroup) -> rollouts_pb2.RolloutGroup:
        versions = [v for s in group.samples for v in s.token_weight_versions] or [0]
        return rollouts_pb2.RolloutGroup(
            group_id=group.group_id,
            task=self.task,
            prompt_id=group.group_id,
            prompt_token_ids=group.prompt_token_ids,
            prompt_text=group.prompt_text,
            sampling=common_pb2.SamplingParams(
                temperature=group.sampling.temperature,
                top_p=group.sampling.top_p,
                top_k=group.sampling.top_k,
                max_tokens=group.max_tokens,
                n=group.size,
            ),
            samples=group.samples,
            min_weight_version=min(versions),
            max_weight_version=max(versions),
            worker_id=self.worker_id,
            created_at_unix=time.time(),
            logprobs_mode=self.logprobs_mode,
        )

    def expire(self, now: float | None = None) -> list[str]:
        """Drop groups not complete within the timeout (counted, never published); their ids."""
        now = time.monotonic() if now is None else now
        stale = [g.key for g in self.pending.values() if now - g.created > self.group_timeout_s]
        for key in stale:
            del self.pending[key]
            self.dropped += 1
            GROUPS_DROPPED.labels(reason="timeout").inc()
        return stale
