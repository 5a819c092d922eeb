"""The OpenAI-compatible endpoint of the rollout service, for agent harnesses written against the
OpenAI client (`rollout.openai_port`; off by default). aiohttp, on the gRPC server's event loop.

    POST /v1/chat/completions   messages -> choices, plus per choice `token_ids`, `token_logprobs`,
                                `weight_versions`, `context_versions` (and OpenAI `logprobs`), and
                                `prompt_token_ids` of the whole prompt the engine continued
    POST /v1/completions        the same for a text prompt (or a prompt of token ids)
    POST /v1/sessions/{id}/finish  {"reward", "group_id"?, "group_size"?, "end"?}: the session's
                                exact tokens become one RolloutSample; `group_size` episodes
                                finished under one group_id are published as one RolloutGroup
                                to run.stream (the actor's Redis stream)
    GET  /v1/models

Every token's own logprob is always returned (`logprobs` need not be set). `top_logprobs: K` (chat)
or `logprobs: K` (completions), K <= 20, adds each position's K most likely tokens; like the sampled
token's logprob they are under the distribution sampled from (temperature, top-k, top-p applied),
and tokens that distribution excludes are left out.

A call belongs to an episode session when it names one: the `X-Parity-Session` header, or a
`session_id` body field (the OpenAI client's `extra_body`). Without one a call is stateless and
nothing is recorded. Within a session the server keeps the exact token sequence (rollout/sessions.py):
the harness sends the whole conversation each time, as OpenAI clients do; only the messages after
the model's last reply are rendered (the chat template's delimiters) and tokenized; a conversation
that does not extend the recorded one answers 409 `session_history_mismatch`.

Invariants:
- Auth as the gRPC API: with `rollout.auth_token` set, every request needs
  `Authorization: Bearer <token>` (401 otherwise). Binds `rollout.host` (loopback by default).
- Every refusal is an OpenAI-shaped error `{"error": {"message", "type", "param", "code"}}` that
  names the field; nothing a request carries takes the service down. Bodies are capped at
  `rollout.openai_max_request_bytes` (413), max_tokens, n and the prompt at the gRPC limits.
- The same engine, admission (`max_inflight_requests`, `max_inflight_tokens`), availability
  (503 while not serving) and validation (`rollout.validation.generation_spec`) as Generate.
- `stream: true` is refused (400): responses carry the per-token fields whole.
- Traced as the gRPC API: with tracing on, each request is a server span (`METHOD ROUTE`), the child
  of the caller's W3C `traceparent` header when it sends one.
- Tool calls: when a chat call offers `tools`, calls in the reply (`rollout.openai_tool_parser`,
  rollout/tool_calls.py) come back as the message's `tool_calls` (finish_reason `tool_calls`), and
  the harness may send that message back as it came; the episode keeps the sampled tokens as they
  are, markup included.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import time
import uuid
from pathlib import Path

import grpc
from aiohttp import web

from parity import tracing
from parity.config import ParityConfig
from parity.errors import RequestError, status_for
from parity.v1 import common_pb2, rollout_pb2, rollouts_pb2
from rollout import sessions as session_book
from rollout.engine import CompletionResult
from rollout.sessions import GroupBook, MessageTemplate, SamplingKey, SessionBook, SessionRefused
from rollout.tool_calls import ToolParserName, openai_tool_calls
from rollout.validation import MAX_TOP_LOGPROBS, generation_spec

log = logging.getLogger("parity.rollout.openai")

SESSION_HEADER = "X-Parity-Session"
# finished groups kept in memory while their publish fails; past this a finish is refused (503) and
# its session kept, so that an outage costs the harness a retry, not the service's memory
MAX_UNPUBLISHED_GROUPS = 256
MAX_SESSION_ID_CHARS = 128
SWEEP_S = 1.0
_HTTP_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
}
_HTTP_FOR_REFUSAL = {"invalid": 400, "conflict": 409, "not_found": 404, "busy": 409, "limit": 429}
# Parameters whose non-default values would change what is sampled: refused rather than ignored.
_UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "response_format": None,
    "best_of": 1,
    "suffix": None,
    "echo": False,
    "stream_options": None,
}


def openai_port_file(port_file: str) -> Path:
    """Where the endpoint's bound port is written: beside the gRPC port file (`x.port` -> `x.openai.port`)."""
    path = Path(port_file)
    return path.with_name(f"{path.stem}.openai.port")


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def response(self) -> web.Response:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            self.status,
            "rate_limit_error"
            if self.status == 429
            else "server_error"
            if self.status >= 500
            else "invalid_request_error",
        )
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return web.json_response(body, status=self.status, headers=headers)


def _translate(exc: BaseException, prompt_param: str) -> ApiError | None:
    """A RequestError / vLLM error / session refusal as an OpenAI error naming the request's field."""
    if isinstance(exc, SessionRefused):
        return ApiError(_HTTP_FOR_REFUSAL[exc.kind], str(exc), exc.param, exc.code or exc.kind)
    refusal = status_for(exc)
    if refusal is None:
        return None
    status, _ = _HTTP_FOR_CODE.get(refusal.code, (500, "server_error"))
    param = refusal.field.removeprefix("sampling.")
    if param in ("prompt_text", "prompt_token_ids"):
        param = prompt_param
    code = refusal.code.name.lower()
    if "max_model_len" in refusal.details:
        code = "context_length_exceeded"
    return ApiError(status, refusal.details.replace("sampling.", ""), param, code, refusal.retry_after_s)


def _number(body: dict, name: str, kind: type, default, low=None, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name}: must be {'a number' if kind is float else 'an integer'}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise ApiError(400, f"{name}: must be in [{low}, {high}] (got {value})", name)
    return kind(value)


def chat_message(
    text: str, finish_reason: str, tools: list | None, parser: ToolParserName, call_ids: str
) -> tuple[dict, str]:
    """A chat choice's (message, finish_reason): the reply as text, or, when the call offered tools
    and the reply holds calls, the calls as `tool_calls` (ids `call_<call_ids>_<i>`) beside the text
    outside them, finishing `tool_calls`. The reply's tokens are the same either way."""
    content, calls = session_book.reply_tool_calls(text, tools, parser)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": openai_tool_calls(calls, call_ids),
    }
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _named_rows(tokenizer, rows: list[list[tuple[int, float]]]) -> list[list[tuple[str, float]]]:
    """Each position's top logprobs as (token text, logprob), most likely first."""
    named = []
    for row in rows:
        names = tokenizer.convert_ids_to_tokens([token_id for token_id, _ in row])
        named.append([(name, logprob) for name, (_, logprob) in zip(names, row, strict=True)])
    return named


class OpenAIServer:
    """The HTTP endpoint around one RolloutServicer (module docstring)."""

    def __init__(self, run_config: ParityConfig, servicer) -> None:
        self.run_config = run_config
        self.config = config = run_config.rollout
        self.servicer = servicer
        self.sessions = SessionBook(config.openai_max_sessions, config.openai_session_ttl_s)
        self.groups = GroupBook(
            config.openai_group_timeout_s,
            worker_id=config.worker_id or f"worker{config.worker_index}",
            task="openai",  # the episodes' source; the run's task does not make them
            logprobs_mode=common_pb2.LOGPROBS_MODE_PROCESSED
            if config.logprobs_mode == "processed"
            else common_pb2.LOGPROBS_MODE_RAW,
        )
        self._template: MessageTemplate | None = None
        self._template_tokenizer = None
        self._queue = None
        # whole groups whose publish failed (Redis out longer than its outage limit, a wrong key):
        # published first, in order, by the next finish
        self._unpublished: list[rollouts_pb2.RolloutGroup] = []
        self._publishing = asyncio.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="openai-render")
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task | None = None
        self._expected_auth = f"Bearer {config.auth_token}".encode() if config.auth_token else b""
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.openai_max_request_bytes,
            middlewares=[self._traced, self._boundary],
        )
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/sessions/{session_id}/finish", self.finish)
        app.router.add_get("/v1/models", self.models)
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.openai_port)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # the bound port when 0 was asked
        if self.config.port_file:
            path = openai_port_file(self.config.port_file)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(str(self.port))
            tmp.replace(path)
        self._sweeper = asyncio.create_task(self._sweep())
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._queue is not None:
            self._queue.close()
        self._thread.shutdown(wait=False)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            for key in self.groups.expire():
                log.warning(
                    "OpenAI group %r dropped: group_size not reached within rollout.openai_group_timeout_s",
                    key,
                )
            if expired := self.sessions.expire():
                log.warning("%d OpenAI sessions expired unfinished", len(expired))

    # -- tracing --------------------------------------------------------------------------------------
    @web.middleware
    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:
        """With tracing on, each request is a server span named `METHOD ROUTE` (the OpenTelemetry
        HTTP conventions), the child of the caller's W3C `traceparent` header when it sends one, so
        a harness's own trace holds the turns it asked for and the publish of its finished groups.
        A 5xx answer marks the span failed. Off, nothing is done."""
        if not tracing.enabled():
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        attrs = {
            "http.request.method": request.method,
            "http.route": route,
            "url.path": request.path,
            "server.port": self.port,
        }
        parent = request.headers.get("traceparent", "")
        with tracing.span(
            f"{request.method} {route}", attrs, kind="server", parent_traceparent=parent
        ) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                tracing.fail(f"HTTP {response.status}")
            return response

    # -- the error boundary ---------------------------------------------------------------------------
    @web.middleware
    async def _boundary(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if self._expected_auth:
                given = request.headers.get("Authorization", "").encode()
                if not hmac.compare_digest(given, self._expected_auth):
                    raise ApiError(
                        401,
                        "missing or wrong 'Authorization: Bearer <token>' header",
                        None,
                        "invalid_api_key",
                    )
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(
                413,
                f"request body larger than rollout.openai_max_request_bytes={self.config.openai_max_request_bytes}",
                None,
                "request_too_large",
            ).response()
        except web.HTTPException as exc:  # 404 / 405 from the router
            return ApiError(
                exc.status, f"{request.method} {request.path}: {exc.reason}", None, None
            ).response()
        except Exception as exc:
            api = _translate(exc, "messages")
            if api is not None:
                return api.response()
            trace_id = uuid.uuid4().hex
            log.error("bug in %s (trace id %s): %r", request.path, trace_id, exc, exc_info=exc)
            return ApiError(500, f"internal error (trace id {trace_id})", None, "internal_error").response()

    @staticmethod
    async def _body(request: web.Request) -> dict:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
        return body

    # -- generation ------------------------------------------------------------------------------------
    def _session_id(self, request: web.Request, body: dict) -> str:
        header = request.headers.get(SESSION_HEADER, "")
        field = body.get("session_id", "")
        if not isinstance(field, str):
            raise ApiError(400, "session_id: must be a string", "session_id")
        if header and field and header != field:
            raise ApiError(
                400, f"session_id: {field!r} differs from the {SESSION_HEADER} header", "session_id"
            )
        session_id = header or field
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise ApiError(400, f"session_id: longer than {MAX_SESSION_ID_CHARS} characters", "session_id")
        if session_id:
            tracing.set_attributes({"parity.session_id": session_id})  # on the request's span
        return session_id

    def _sampling(self, body: dict, kind: str) -> common_pb2.SamplingParams:
        if body.get("stream"):
            raise ApiError(
                400,
                "stream: streaming is not supported; call without stream (the response carries every "
                "token's id, logprob and weight version)",
                "stream",
            )
        for name, default in _UNSUPPORTED.items():
            if body.get(name, default) not in (default, None):
                raise ApiError(400, f"{name}: not supported by this endpoint (leave it unset)", name)
        if body.get("tool_choice") not in (None, "auto", "none"):
            raise ApiError(
                400,
                "tool_choice: only auto or none (the model decides; calls are read from its reply, never "
                "forced by constraining what it samples)",
                "tool_choice",
            )
        # the K most likely tokens per position, under the distribution sampled from (processed
        # logprobs): chat's `top_logprobs`, the legacy completions API's integer `logprobs`
        if kind == "chat":
            if not isinstance(body.get("logprobs", False), (bool, type(None))):
                raise ApiError(400, "logprobs: must be a boolean", "logprobs")
            top_logprobs = _number(body, "top_logprobs", int, 0, 0, MAX_TOP_LOGPROBS)
        else:
            if body.get("top_logprobs") is not None:
                raise ApiError(
                    400, "top_logprobs: a chat field; the completions API takes `logprobs: K`", "top_logprobs"
                )
            top_logprobs = _number(body, "logprobs", int, 0, 0, MAX_TOP_LOGPROBS)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "stop: must be a string or an array of strings", "stop")
        seed = _number(body, "seed", int, 0, 0, 2**63 - 1)
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "ignore_eos: must be a boolean", "ignore_eos")
        return common_pb2.SamplingParams(
            temperature=_number(body, "temperature", float, 1.0, 0.0),
            top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
            top_k=_number(body, "top_k", int, 0, 0),
            max_tokens=0
            if max_tokens is None
            else _number({"max_tokens": max_tokens}, "max_tokens", int, 0, 1),
            n=_number(body, "n", int, 1, 1),
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            top_logprobs=top_logprobs,
        )

    def _template_for(self, tokenizer) -> MessageTemplate:
        if self._template is None or self._template_tokenizer is not tokenizer:
            self._template = MessageTemplate(tokenizer)
            self._template_tokenizer = tokenizer
        return self._template

    async def _generate(self, ids: list[int], sampling: common_pb2.SamplingParams, prompt_param: str):
        """Validate as Generate does, then run on the engine under admission; completions by index."""
        servicer = self.servicer
        if not sampling.max_tokens:  # default: as much as fits
            room = servicer.engine.max_model_len - len(ids)
            sampling.max_tokens = max(1, min(self.config.effective_max_tokens, room))
        try:
            spec = generation_spec(
                rollout_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling), None, servicer.limits
            )
        except RequestError as exc:
            raise _translate(exc, prompt_param) from None
        with servicer.admission.admit(servicer.cost_tokens(spec)):
            results = [r async for r in servicer.run_group(spec)]
        return spec, sorted(results, key=lambda r: r.index)

    async def _call(self, request: web.Request, kind: str) -> web.Response:
        body = await self._body(request)
        prompt_param = "messages" if kind == "chat" else "prompt"
        sampling = self._sampling(body, kind)
        session_id = self._session_id(request, body)
        servicer = self.servicer
        servicer.check_available()
        servicer.admission.precheck()
        tokenizer = servicer.engine.tokenizer
        loop = asyncio.get_running_loop()
        tools, parser = None, "none"  # completions: text in, text out
        if kind == "chat":
            messages = session_book.normalize_messages(body.get("messages"))
            tools = body.get("tools") or None
            if tools is not None and not isinstance(tools, list):
                raise ApiError(400, "tools: must be an array", "tools")
            parser = "none" if body.get("tool_choice") == "none" else self.config.openai_tool_parser
            template = self._template_for(tokenizer)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if not (
                (isinstance(prompt, str) and prompt)
                or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt))
            ):
                raise ApiError(400, "prompt: must be a non-empty string or array of token ids", "prompt")
            if isinstance(prompt, str) and len(prompt.encode()) > self.config.max_prompt_bytes:
                raise ApiError(400, "prompt: larger than rollout.max_prompt_bytes", "prompt")
        if not session_id:  # stateless: nothing recorded
            if kind == "chat":
                ids = await loop.run_in_executor(self._thread, template.first_ids, messages, tools)
            elif isinstance(prompt, str):
                ids = await loop.run_in_executor(self._thread, servicer.engine.encode, prompt, False)
            else:
                ids = list(prompt)
            spec, results = await self._generate(ids, sampling, prompt_param)
            return self._response(kind, spec, results, tokenizer, "", tools, parser)
        if sampling.n > 1:
            raise ApiError(400, "n: a session follows one conversation; n must be 1 within a session", "n")
        key = SamplingKey(sampling.temperature, sampling.top_p or 1.0, sampling.top_k)
        session = self.sessions.acquire(session_id, kind, key)
        try:
            if kind == "chat":
                plan = await loop.run_in_executor(
                    self._thread, SessionBook.plan_chat, session, messages, tools, template
                )
                if plan.first:
                    session.tools = tools
            else:
                plan = await loop.run_in_executor(
                    self._thread, SessionBook.plan_completion, session, prompt, tokenizer
                )
            spec, results = await self._generate(plan.prompt_ids, sampling, prompt_param)
            SessionBook.commit(session, plan, results[0], spec.max_tokens, parser)
        finally:
            self.sessions.release(session)
        return self._response(kind, spec, results, tokenizer, session_id, session.tools, parser)

    def _response(
        self,
        kind: str,
        spec,
        results: list[CompletionResult],
        tokenizer,
        session_id: str,
        tools: list | None = None,
        parser: ToolParserName = "none",
    ) -> web.Response:
        choices = []
        for r in results:
            tokens = tokenizer.convert_ids_to_tokens(r.token_ids)
            choice = {
                "index": r.index,
                "finish_reason": r.finish_reason,
                "token_ids": r.token_ids,
                "token_logprobs": r.logprobs,
                "weight_versions": r.token_weight_versions,
                "context_versions": r.token_context_versions or r.token_weight_versions,
            }
            # per position, (token, logprob) of the most likely tokens, when the request asked
            tops = _named_rows(tokenizer, r.top_logprobs) or [[] for _ in tokens]
            if kind == "chat":
                choice["message"], choice["finish_reason"] = chat_message(
                    r.text, r.finish_reason, tools, parser, f"{spec.request_id}_{r.index}"
                )
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": t,
                            "logprob": lp,
                            "bytes": None,
                            "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": None} for tt, tlp in top],
                        }
                        for t, lp, top in zip(tokens, r.logprobs, tops, strict=True)
                    ]
                }
            else:
                choice["text"] = r.text
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": r.logprobs,
                    "top_logprobs": [dict(top) for top in tops] if r.top_logprobs else None,
                    "text_offset": None,
                }
            choices.append(choice)
        completion_tokens = sum(len(r.token_ids) for r in results)
        body = {
            "id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{spec.request_id}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "model": self.run_config.model.name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(spec.prompt_token_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(spec.prompt_token_ids) + completion_tokens,
            },
            "prompt_token_ids": spec.prompt_token_ids,
            "session_id": session_id or None,
        }
        return web.json_response(body)

    async def chat_completions(self, request: web.Request) -> web.Response:
        return await self._call(request, "chat")

    async def completions(self, request: web.Request) -> web.Response:
        return await self._call(request, "completion")

    async def models(self, request: web.Request) -> web.Response:
        name = self.run_config.model.name
        return web.json_response(
            {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "parity"}]}
        )

    # -- finishing -------------------------------------------------------------------------------------
    async def finish(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        tracing.set_attributes({"parity.session_id": session_id[:MAX_SESSION_ID_CHARS]})
        body = await self._body(request)
        unknown = set(body) - {"reward", "group_id", "group_size", "end"}
        if unknown:
            raise ApiError(400, f"{sorted(unknown)[0]}: unknown field", sorted(unknown)[0])
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward:
            raise ApiError(400, "reward: required, a finite number", "reward")
        if abs(reward) == float("inf"):
            raise ApiError(400, "reward: required, a finite number", "reward")
        key = body.get("group_id")
        if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_SESSION_ID_CHARS):
            raise ApiError(
                400, f"group_id: a non-empty string of at most {MAX_SESSION_ID_CHARS} characters", "group_id"
            )
        default_size = self.run_config.task.group_size if key else 1
        size = _number(body, "group_size", int, default_size, 1, self.config.max_n * 16)
        if key is None and size != 1:
            raise ApiError(
                400,
                "group_size: needs a group_id (an episode without one is a group of its own)",
                "group_size",
            )
        end = body.get("end", "done")
        if end not in session_book.EPISODE_ENDS:
            raise ApiError(400, f"end: one of {sorted(session_book.EPISODE_ENDS)} (got {end!r})", "end")
        if not self.run_config.run.redis_url:
            raise ApiError(
                503, "run.redis_url is not set: a finished episode has no stream to go to", None, "no_stream"
            )
        if len(self._unpublished) >= MAX_UNPUBLISHED_GROUPS:  # Redis out: hold no more in memory
            raise ApiError(
                503,
                f"publish: {len(self._unpublished)} finished groups wait for the stream (Redis is out); "
                "the session is kept: finish it again later",
                None,
                "publish_backlog_full",
            )
        session = self.sessions.take(session_id)
        key = key or f"session:{session_id}"
        self.groups.check(key, size, session)
        sample = session_book.episode_sample(session, float(reward), end, self.servicer.engine.tokenizer)
        if sample.token_mismatches:  # cannot happen unless the bookkeeping is wrong: never train on it
            self.sessions.close(session)
            session_book.GROUPS_DROPPED.labels(reason="token_mismatch").inc()
            self.groups.pending.pop(key, None)
            raise ApiError(500, "the session's tokens differ from the engine's; its group was dropped")
        group = self.groups.add(key, size, session, sample)
        self.sessions.close(session)
        published = await self._publish_whole_groups(group)
        pending = self.groups.pending.get(key)
        return web.json_response(
            {
                "session_id": session_id,
                "rollout_id": sample.rollout_id,
                "group_id": group.group_id if group is not None else pending.group_id,
                "episodes_in_group": len(group.samples) if group is not None else len(pending.samples),
                "group_size": size,
                "published": bool(published),
                "stream_entry_id": published or None,
                "tokens": len(sample.token_ids),
                "model_tokens": sum(sample.loss_mask),
            }
        )

    async def _publish_whole_groups(self, group: rollouts_pb2.RolloutGroup | None) -> str:
        """Publish the groups kept from failed publishes, then `group` (when this finish completed
        one); the stream entry id of `group`, or "". A publish that fails keeps the group and its
        successors for the next finish, and answers 503 saying so: a finished group is never lost."""
        if group is not None:
            self._unpublished.append(group)
        published = ""
        async with self._publishing:
            while self._unpublished:
                head = self._unpublished[0]
                try:
                    entry = await self._publish(head)
                except Exception as exc:  # answered below; the groups are kept
                    log.warning(
                        "OpenAI group %s not published (kept for the next finish): %s", head.group_id, exc
                    )
                    raise ApiError(
                        503,
                        f"publish: {type(exc).__name__}: {exc}; {len(self._unpublished)} finished group(s) "
                        "kept, published with the next finish",
                        None,
                        "publish_failed",
                    ) from exc
                self._unpublished.pop(0)
                if head is group:
                    published = entry
        return published

    async def _publish(self, group) -> str:
        from parity.rollout_queue import RolloutQueue

        run = self.run_config.run
        if self._queue is None:
            self._queue = await asyncio.to_thread(RolloutQueue, run.redis_url, run.stream)
        attrs = {"parity.group_id": group.group_id, "parity.weight_version": group.max_weight_version}
        with tracing.span("publish", attrs, kind="producer"):
            entry_id = await asyncio.to_thread(self._queue.publish, group, tracing.current_traceparent())
        session_book.GROUPS_PUBLISHED.inc()
        log.info(
            "OpenAI group %s published (%d episodes, versions %d..%d)",
            group.group_id,
            len(group.samples),
            group.min_weight_version,
            group.max_weight_version,
        )
        return entry_id


async def start_openai_server(run_config: ParityConfig, servicer) -> OpenAIServer:
    server = OpenAIServer(run_config, servicer)
    await server.start()
    return server
