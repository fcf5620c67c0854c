"""The OpenAI-compatible HTTP API, on the front door's asyncio loop beside the ZMQ endpoint.

aiohttp serves it (docs/http_api.md says why); every request goes through the same front door
(`Frontend.submit`, the core's admission, table and counters) as an SDK request. A client that
disconnects, mid-stream or while waiting for a whole response, has its request aborted.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import EngineConfig
from engine.errors import (
    EngineDead,
    EngineError,
    InvalidRequest,
    Overloaded,
    ShuttingDown,
    Timeout,
    Unauthorized,
)
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.wire_errors import to_exception
from tokenizer_proc import anthropic_api, limits, openai_api, responses_api, tool_calls
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.requests import Entry

log = logging.getLogger("tokenizer.http")

SHUTDOWN_TIMEOUT_S = 2.0
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class BodyTooLarge(InvalidRequest):
    """A request body over `--max-body-bytes`: a 413, not a 400."""


class BodyTooSlow(InvalidRequest):
    """A request body still incomplete after `--client-timeout`: a 408."""


# exception type -> (HTTP status, OpenAI error type, code)
STATUS: dict[type[EngineError], tuple[int, str, str | None]] = {
    InvalidRequest: (400, "invalid_request_error", None),
    BodyTooLarge: (413, "invalid_request_error", "request_too_large"),
    BodyTooSlow: (408, "invalid_request_error", "request_timeout"),
    Unauthorized: (401, "authentication_error", "invalid_api_key"),
    Overloaded: (429, "rate_limit_error", "overloaded"),
    ShuttingDown: (503, "service_unavailable", "shutting_down"),
    EngineDead: (503, "service_unavailable", "engine_dead"),
    Timeout: (504, "timeout", None),
}


class _MalformedHttp(logging.Filter):
    """aiohttp logs every request it cannot parse (answered 400: the client's fault) at ERROR with
    a traceback; a stream of junk would flood the log. One line at DEBUG instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):
            log.debug("malformed HTTP request: %s", str(exc).replace("\n", " "))
            return False
        return True


MALFORMED_HTTP = _MalformedHttp()


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> bytes:
    error = {"message": message, "type": kind, "param": param, "code": code}
    return msgspec.json.encode({"error": error})


# HTTP status -> Anthropic's error type, for the /v1/messages routes
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def status_of(e: EngineError) -> int:
    return STATUS.get(type(e), (500, "server_error", None))[0]


def anthropic_error(message: str, status: int) -> web.Response:
    body = anthropic_api.error_body(message, ANTHROPIC_TYPES.get(status, "api_error"))
    return _json_response(msgspec.json.encode(body), status)


def error_response(e: EngineError) -> web.Response:
    status, kind, code = STATUS.get(type(e), (500, "server_error", None))
    param = e.field if isinstance(e, InvalidRequest) else None
    message = e.message if isinstance(e, InvalidRequest) else str(e)
    return _json_response(error_body(message, kind, param, code), status)


def _json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")


class HttpApi:
    def __init__(self, frontend: Frontend) -> None:
        self.fe = frontend
        self.core = frontend.core
        self.tokenizer = frontend.tokenizer
        logging.getLogger("aiohttp.server").addFilter(MALFORMED_HTTP)  # NOTE: once: one object
        self.app = web.Application(
            client_max_size=frontend.config.max_body_bytes, middlewares=[self._errors, self._auth]
        )
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completion),
                web.post("/v1/responses", self._responses),
                web.post("/v1/messages", self._messages),
                web.post("/v1/messages/count_tokens", self._count_tokens),
                web.get("/v1/models", self._models),
                web.get("/v1/models/{model}", self._model),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/health", self._health),
                web.get("/health_generate", self._health_generate),
                web.get("/metrics", self._metrics),
            ]
        )
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        # NOTE: handler_cancellation: a client that disconnects cancels its handler, whose
        # `finally` aborts the request (its KV is free within a step or two).
        self.runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- middleware -----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every error in its API's format (Anthropic's on /v1/messages, else OpenAI's); bad
        input is never a 500."""
        anthropic = request.path.startswith("/v1/messages")
        try:
            return await handler(request)
        except EngineError as e:
            if anthropic:
                return anthropic_error(str(e), status_of(e))
            return error_response(e)
        except web.HTTPException as e:  # 404, 405, 413 raised by aiohttp itself
            if anthropic:
                return anthropic_error(e.reason, e.status)
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            code = "request_too_large" if e.status == 413 else None
            return _json_response(error_body(e.reason, kind, None, code), e.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        # NOTE: Anthropic's clients send the key as x-api-key
        self.core.check_key(key or request.headers.get("x-api-key"))
        return await handler(request)

    # --- OpenAI endpoints -----------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        facts = self.core.limits
        rid = f"http-{uuid.uuid4().hex}"
        req = openai_api.parse(kind, body, rid, facts.max_context, facts.model)
        reply = Reply(req, openai_api.Formatter(req, self.tokenizer), self.tokenizer)
        return await self._serve(request, req.generate, req.renamed, reply, req.stream)

    async def _serve(
        self,
        request: web.Request,
        gen: tt.Generate,
        renamed: dict[str, str],
        reply: _Reply,
        stream: bool,
    ) -> web.StreamResponse:
        """Submit, then answer whole or streamed; `renamed`: engine field -> the API's name."""
        owner = ("http", gen.rid)
        try:
            entry = await self.fe.submit(gen, owner)
            if stream:
                return await reply.stream(request, entry)
            return _json_response(msgspec.json.encode(await reply.whole(entry)))
        except InvalidRequest as e:
            # NOTE: also a refusal after admission (the worker pool's: a constraint that does not
            # compile, a long prompt too long), before any byte of the reply was sent
            raise InvalidRequest(renamed.get(e.field, e.field), e.message) from None
        finally:
            if gen.rid in self.core.table:  # NOTE: still running: the client went away
                log.info("rid=%s HTTP client gone; aborting", gen.rid)
                self.fe.abort(gen.rid, owner)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        facts = self.core.limits
        rid = f"http-{uuid.uuid4().hex}"
        req = responses_api.parse(body, rid, facts.model, facts.max_context)
        reply = ResponsesReply(req, self.tokenizer)
        return await self._serve(request, req.generate, RESPONSES_NAMES, reply, req.stream)

    # --- Anthropic endpoints --------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        req = anthropic_api.parse(body, f"http-{uuid.uuid4().hex}", self.core.limits.model)
        reply = MessagesReply(req, self.tokenizer)
        return await self._serve(request, req.generate, ANTHROPIC_NAMES, reply, req.stream)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        messages, tools = anthropic_api.parse_count(body)
        ids = await self.fe.tokenize(tt.Generate("count", messages=messages, tools=tools))
        return _json_response(msgspec.json.encode({"input_tokens": len(ids)}))

    # --- utility endpoints ----------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        msg, generation_prompt = openai_api.parse_tokenize(body)
        ids = await self.fe.tokenize(msg, generation_prompt)
        reply = {"count": len(ids), "max_model_len": self.core.limits.max_context, "tokens": ids}
        return _json_response(msgspec.json.encode(reply))

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        ids = openai_api.parse_detokenize(body, self.core.limits.vocab_size)
        text = await self.fe.detokenize(ids)
        return _json_response(msgspec.json.encode({"prompt": text}))

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.core.limits.model:
            body = error_body(f"no model {name!r} here", "invalid_request_error", "model", None)
            return _json_response(body, 404)
        return _json_response(msgspec.json.encode(self._model_object()))

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [self._model_object()]}
        return _json_response(msgspec.json.encode(body))

    def _model_object(self) -> dict[str, Any]:
        return {
            "id": self.core.limits.model,
            "object": "model",
            "created": 0,
            "owned_by": "mlx-engine",
            "max_model_len": self.core.limits.max_context,
        }

    # --- health and metrics ---------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return _health_response(*self.core.health())

    async def _health_generate(self, request: web.Request) -> web.Response:
        return _health_response(*await self.fe.health_generate())

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.core.metrics.render(await self.fe.stats())
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _health_response(healthy: bool, detail: str) -> web.Response:
    body = {"status": "ok" if healthy else "unhealthy", "detail": detail}
    return _json_response(msgspec.json.encode(body), 200 if healthy else 503)


async def _json_body(request: web.Request, config: EngineConfig) -> Any:
    try:
        # NOTE: a declared size over the limit is refused before any of the body is read.
        limits.check_body(request.content_length, config)
        # NOTE: a client that stops sending mid-body would hold its connection and handler
        # for good; it gets the time a silent SDK client gets.
        raw = await asyncio.wait_for(request.read(), config.client_timeout)
    except InvalidRequest as e:
        raise BodyTooLarge(e.field, e.message) from None
    except asyncio.TimeoutError:
        timeout = config.client_timeout
        what = f"incomplete after {timeout:g}s"
        raise BodyTooSlow(
            "body", f"{what} (client_timeout={timeout:g}, --client-timeout)"
        ) from None
    except web.HTTPRequestEntityTooLarge:  # NOTE: read() stops past client_max_size
        error = limits.body_error(f"more than {config.max_body_bytes} bytes", config)
        raise BodyTooLarge(error.field, error.message) from None
    except web.RequestPayloadError as e:  # NOTE: a body that does not decode (Content-Encoding)
        raise InvalidRequest("body", f"unreadable: {e}") from None
    except ConnectionResetError:
        # NOTE: the client hung up mid-body. Its handler is being cancelled, but Python 3.11's
        # wait_for hands back the read's own error instead; the answer goes nowhere, quietly.
        raise InvalidRequest("body", "the client hung up before sending all of it") from None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise InvalidRequest("body", f"invalid JSON: {e}") from None
    except RecursionError:  # NOTE: msgspec raises it, not a DecodeError, for ~1000 levels
        raise limits.nesting_error(config, "body") from None


class _Reply:
    """What both APIs' replies share: text and tool calls chunk by chunk (the tool-call parser
    when tools were offered), and the SSE stream; each API's subclass says what its stream opens
    with (`_opening`) and what one engine message adds (`_events`)."""

    def __init__(self, rid: str, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
        self.rid = rid
        self.tools = tool_calls.for_request(tokenizer, tools)
        self.calls = 0

    async def whole(self, entry: Entry) -> dict[str, Any]:
        raise NotImplementedError

    async def _collect(
        self, entry: Entry, each: Any = None
    ) -> tuple[str, tc.Chunk, list[dict[str, Any]]]:
        """(text, last chunk, tool calls) of a whole reply; `each` sees every chunk."""
        text, calls = [], []
        while True:
            chunk = _chunk(await entry.replies().get())
            piece, new_calls = self._text(chunk)
            text.append(piece)
            calls += new_calls
            if each is not None:
                each(chunk)
            if chunk.finish_reason is not None:
                _check_finish(chunk)
                return "".join(text), chunk, calls

    def _opening(self, first: tc.Chunk) -> bytes:
        return b""

    def _events(self, msg: tc.Chunk | tc.Failure, out: bytearray) -> bool:
        """Append the SSE events of one engine message; True when it ends the stream."""
        raise NotImplementedError

    async def stream(self, request: web.Request, entry: Entry) -> web.StreamResponse:
        queue = entry.replies()
        # NOTE: nothing is sent before the engine's first answer, so a refusal after admission
        # (the scheduler's own queue bound, a drain that began) still gets its HTTP status.
        first = _chunk(await queue.get())
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        out = bytearray(self._opening(first))
        try:
            await self._send_events(resp, queue, self._events(first, out), out)
        except ConnectionResetError:
            # NOTE: the client left and its stream went on (it ended, or the handler was not
            # cancelled yet); the caller's `finally` aborts what is still running.
            log.info("rid=%s HTTP client gone mid-stream", self.rid)
        return resp

    async def _send_events(
        self, resp: web.StreamResponse, queue: asyncio.Queue[Any], done: bool, out: bytearray
    ) -> None:
        while True:
            # NOTE: one write for everything that arrived meanwhile (one syscall per batch)
            while not done and not queue.empty():
                done = self._events(queue.get_nowait(), out)
            await resp.write(bytes(out))
            if done:
                break
            out = bytearray()
            done = self._events(await queue.get(), out)
        await resp.write_eof()

    def _text(self, chunk: tc.Chunk) -> tuple[str, list[dict[str, Any]]]:
        """The chunk's content and tool calls (the tool-call parser holds back marker text)."""
        if self.tools is None:
            return chunk.text, []
        text, calls = self.tools.feed(chunk.text)
        if chunk.finish_reason is not None:
            rest, more = self.tools.finish()
            text, calls = text + rest, calls + more
        self.calls += len(calls)
        return text, calls


class Reply(_Reply):
    """One request's replies, turned into OpenAI objects: whole, or streamed as SSE."""

    def __init__(self, req: openai_api.Request, fmt: openai_api.Formatter, tokenizer: Any) -> None:
        super().__init__(req.generate.rid, tokenizer, req.generate.tools)
        self.req = req
        self.fmt = fmt

    async def whole(self, entry: Entry) -> dict[str, Any]:
        logprobs: list[dict[str, Any]] = []

        def keep(chunk: tc.Chunk) -> None:
            if (lp := self.fmt.logprobs(chunk)) is not None:
                logprobs.append(lp)

        text, final, calls = await self._collect(entry, keep)
        return self.fmt.whole(text, final, logprobs, calls)

    def _opening(self, first: tc.Chunk) -> bytes:
        return _event(self.fmt.stream_chunk(role=True)) if self.req.kind == "chat" else b""

    def _events(self, msg: tc.Chunk | tc.Failure, out: bytearray) -> bool:
        if isinstance(msg, tc.Failure):
            out += _error_event(to_exception(msg))
            out += DONE
            return True
        text, calls = self._text(msg)
        logprobs = self.fmt.logprobs(msg)
        if text or calls or (logprobs and msg.token_ids):
            out += _event(self.fmt.stream_chunk(text, logprobs, tool_calls=calls))
        if msg.finish_reason is None:
            return False
        if msg.finish_reason in ("stop", "length"):
            reason = openai_api.finish_reason(msg.finish_reason, self.calls > 0)
            out += _event(self.fmt.stream_chunk(finish=reason))
        else:
            out += _error_event(_finish_error(msg))
        if self.req.include_usage:
            out += _event(self.fmt.usage_chunk(msg))
        out += DONE
        return True


class _EventReply(_Reply):
    """A reply whose stream is typed events from one formatter (Anthropic's Messages, OpenAI's
    Responses): text deltas, an event per tool call, then the finish or an error event. Each
    subclass says how its API writes an error (`_error`)."""

    fmt: Any
    events: Any

    async def whole(self, entry: Entry) -> dict[str, Any]:
        return self.fmt.whole(*await self._collect(entry))

    def _error(self, e: EngineError) -> bytes:
        raise NotImplementedError

    def _events(self, msg: tc.Chunk | tc.Failure, out: bytearray) -> bool:
        if isinstance(msg, tc.Failure):
            out += self._error(to_exception(msg))
            return True
        text, calls = self._text(msg)
        out += self.events.delta(text)
        for call in calls:
            out += self.events.tool_call(call)
        if msg.finish_reason is None:
            return False
        if msg.finish_reason in ("stop", "length"):
            out += self.events.finish(msg)
        else:
            out += self._error(_finish_error(msg))
        return True


class MessagesReply(_EventReply):
    """One /v1/messages request's replies: a message object, or its stream of events."""

    def __init__(self, req: anthropic_api.Request, tokenizer: Any) -> None:
        super().__init__(req.generate.rid, tokenizer, req.generate.tools)
        self.req = req
        self.fmt = anthropic_api.Formatter(req)
        self.events = anthropic_api.Events(self.fmt)

    def _opening(self, first: tc.Chunk) -> bytes:
        return self.events.start(first)

    def _error(self, e: EngineError) -> bytes:
        return _anthropic_error_event(e)


class ResponsesReply(_EventReply):
    """One /v1/responses request's replies: a response object, or its stream of events."""

    def __init__(self, req: responses_api.Request, tokenizer: Any) -> None:
        super().__init__(req.generate.rid, tokenizer, req.generate.tools)
        self.fmt = responses_api.Formatter(req)
        self.events = responses_api.Events(self.fmt)

    def _opening(self, first: tc.Chunk) -> bytes:
        return self.events.start()

    def _error(self, e: EngineError) -> bytes:
        return _responses_error_event(self.events, e)


def _responses_error_event(events: responses_api.Events, e: EngineError) -> bytes:
    return events.error(str(e), STATUS.get(type(e), (500, "server_error", None))[1])


# engine field -> the Messages API's name for it
ANTHROPIC_NAMES = {"stop": "stop_sequences"}
# engine field -> the Responses API's name for it
RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "json_schema": "text.format"}


def _anthropic_error_event(e: EngineError) -> bytes:
    kind = ANTHROPIC_TYPES.get(status_of(e), "api_error")
    return anthropic_api.event("error", anthropic_api.error_body(str(e), kind))


def _chunk(msg: tc.Chunk | tc.Failure) -> tc.Chunk:
    if isinstance(msg, tc.Failure):
        raise to_exception(msg)
    return msg


def _check_finish(chunk: tc.Chunk) -> None:
    if chunk.finish_reason not in ("stop", "length"):
        raise _finish_error(chunk)


def _finish_error(chunk: tc.Chunk) -> EngineError:
    if chunk.finish_reason == "abort":
        return ShuttingDown("the request was aborted (the engine is shutting down)")
    if chunk.invalid is not None:
        return InvalidRequest(chunk.invalid, chunk.error or "invalid")
    return EngineError(f"generation failed: {chunk.error or chunk.finish_reason}")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def _error_event(e: EngineError) -> bytes:
    status, kind, code = STATUS.get(type(e), (500, "server_error", None))
    return b"data: " + error_body(str(e), kind, None, code or status) + b"\n\n"
