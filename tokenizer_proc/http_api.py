"""The OpenAI-compatible HTTP API, on the front door's asyncio loop beside the ZMQ endpoint.

aiohttp serves it (docs/http_api.md says why); every request goes through the same front door
(`TokenizerServer.submit`, the core's admission, table and counters) as an SDK request. A client that
disconnects, mid-stream or while waiting for a whole response, has its request aborted.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
import uuid
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from engine.config import EngineConfig
from engine.errors import (
    EngineError,
    InvalidRequest,
)
from engine.messages import to_tokenizer as tt
from tokenizer_proc import (
    admin_api,
    anthropic_api,
    backlog,
    choices,
    connections,
    limits,
    openai_api,
    page,
    responses_api,
    router_api,
)
from tokenizer_proc.core import peer_client
from tokenizer_proc.http_errors import (
    BodyTooLarge,
    BodyTooSlow,
    anthropic_error,
    error_body,
    error_response,
    json_response,
    status_of,
)
from tokenizer_proc.replies import (
    ApiReply,
    MessagesReply,
    Reply,
    ResponsesReply,
    stream_choices,
)
from tokenizer_proc.server import TokenizerServer

log = logging.getLogger("tokenizer.http")

SHUTDOWN_TIMEOUT_S = 2.0
# NOTE: liveness answers without the key: routers and load balancers probe it bare (smg registers
# an engine only after a bare GET /health answered 2xx); it tells nothing but ok or why not
OPEN_PATHS = frozenset({"/health"})
BACKLOG = 1024  # NOTE: pending connections; the kernel may grant fewer (tokenizer_proc/backlog.py)


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


class HttpApi:
    def __init__(self, frontend: TokenizerServer) -> None:
        self.fe = frontend
        self.core = frontend.core
        self.tokenizer = frontend.tokenizer
        proxies = frontend.config.trusted_proxies.split(",")
        self._proxies = frozenset(p.strip() for p in proxies if p.strip())
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
                web.get("/", page.index),
                web.get("/ui/{name}", page.asset),
                *admin_api.AdminApi(
                    self.core, frontend.operations, frontend.config, _json_body
                ).routes(),
                *router_api.RouterApi(frontend).routes(),
            ]
        )
        self.runner: web.AppRunner | None = None
        self.server: asyncio.Server | None = None
        self.guard: connections.ConnectionGuard | None = None

    async def start(self, host: str, port: int) -> None:
        # NOTE: handler_cancellation: a client that disconnects cancels its handler, whose
        # `finally` aborts the request (its KV is free within a step or two).
        config = self.fe.config
        self.runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            keepalive_timeout=config.http_keepalive_timeout,
        )
        await self.runner.setup()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        total = connections.max_connections(config, soft)
        per_peer = config.http_max_connections_per_peer
        self.guard = connections.ConnectionGuard(total, per_peer, config.client_timeout)
        loop = asyncio.get_running_loop()
        connections.quiet_accept_errors(loop)
        factory = self.guard.factory(self.runner.server)  # type: ignore[arg-type]
        self.server = await loop.create_server(
            factory, host, port, reuse_address=True, backlog=BACKLOG
        )
        backlog.warn_if_capped(BACKLOG, sys.platform)
        log.info("HTTP: at most %d connections, %d a peer", total, per_peer)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()  # NOTE: no new connections; the runner closes the open ones
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
            return json_response(error_body(e.reason, kind, None, code), e.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        key = header[7:].strip() if header[:7].lower() == "bearer " else None
        # NOTE: Anthropic's clients send the key as x-api-key
        key = key or request.headers.get("x-api-key")
        if page.is_public(request.path):  # NOTE: the page's files; it asks for the key itself
            return await handler(request)
        if request.path in OPEN_PATHS:
            return await handler(request)
        self.core.check_key(key)
        request["key"] = key  # NOTE: the operator's routes check it again (admin_api.py)
        forwarded = request.headers.get("X-Forwarded-For", "")
        request["client"] = self.core.client_of(
            key, peer_client(request.remote, forwarded, self._proxies)
        )
        return await handler(request)

    # --- OpenAI endpoints -----------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        facts = self.core.settings
        rid = f"http-{uuid.uuid4().hex}"
        req = openai_api.parse(kind, body, rid, facts.max_context, facts.model)
        echo = await self._echo(req)
        if req.best_of > 1:
            return await self._serve_choices(request, req, echo)
        fmt = openai_api.Formatter(req, self.tokenizer)
        reply = Reply(req, fmt, self.tokenizer, markers=self.fe.markers)
        reply.echo = echo
        return await self._serve(request, req.generate, req.renamed, reply, req.stream)

    async def _echo(self, req: openai_api.Request) -> str | None:
        """An `echo` request's prompt text (its token ids decoded, on the pool when long; ids
        beyond the context are refused at admission, so not decoded here)."""
        gen = req.generate
        if not req.echo:
            return None
        if gen.prompt is not None:
            return gen.prompt
        ids = gen.input_ids or []
        return await self.fe.detokenize(ids) if len(ids) <= self.core.settings.max_context else ""

    async def _serve(
        self,
        request: web.Request,
        gen: tt.Generate,
        renamed: dict[str, str],
        reply: ApiReply,
        stream: bool,
    ) -> web.StreamResponse:
        """Submit, then answer whole or streamed; `renamed`: engine field -> the API's name."""
        owner = ("http", gen.rid)
        try:
            entry = await self.fe.submit(gen, owner, request["client"])
            if stream:
                return await reply.stream(request, entry)
            return json_response(msgspec.json.encode(await reply.whole(entry)))
        except InvalidRequest as e:
            # NOTE: also a refusal after admission (the worker pool's: a constraint that does not
            # compile, a long prompt too long), before any byte of the reply was sent
            raise InvalidRequest(renamed.get(e.field, e.field), e.message) from None
        finally:
            if gen.rid in self.core.table:  # NOTE: still running: the client went away
                log.info("rid=%s HTTP client gone; aborting", gen.rid)
                self.fe.abort(gen.rid, owner)

    async def _serve_choices(
        self, request: web.Request, req: openai_api.Request, echo: str | None
    ) -> web.StreamResponse:
        """`n` > 1 or `best_of` > 1: a request per candidate (tokenizer_proc/choices.py), their
        replies merged; a refusal of any refuses the whole, and the rest are aborted."""
        gens = choices.candidates(req.generate, req.best_of)
        ident = openai_api.Formatter(req, self.tokenizer).id
        replies = []
        for i, g in enumerate(gens):
            fmt = openai_api.Formatter(req, self.tokenizer, index=i, ident=ident)
            reply = Reply(req, fmt, self.tokenizer, tail=False, rid=g.rid, markers=self.fe.markers)
            replies.append(reply)
            replies[-1].echo = echo
        try:
            client = request["client"]
            entries = [await self.fe.submit(g, ("http", g.rid), client) for g in gens]
            if req.stream:
                return await stream_choices(request, req, replies, entries)
            wholes = await asyncio.gather(
                *(r.whole(e) for r, e in zip(replies, entries, strict=True))
            )
            scores = [(r.logprob_sum, r.logprob_count) for r in replies]
            merged = choices.merge(list(wholes), choices.best(scores, req.n))
            return json_response(msgspec.json.encode(merged))
        except InvalidRequest as e:
            raise InvalidRequest(req.renamed.get(e.field, e.field), e.message) from None
        finally:
            for g in gens:
                if g.rid in self.core.table:  # NOTE: still running: the client went away
                    self.fe.abort(g.rid, ("http", g.rid))

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        facts = self.core.settings
        rid = f"http-{uuid.uuid4().hex}"
        req = responses_api.parse(body, rid, facts.model, facts.max_context)
        reply = ResponsesReply(req, self.tokenizer, self.fe.markers)
        return await self._serve(request, req.generate, RESPONSES_NAMES, reply, req.stream)

    # --- Anthropic endpoints --------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request, self.fe.config)
        req = anthropic_api.parse(body, f"http-{uuid.uuid4().hex}", self.core.settings.model)
        reply = MessagesReply(req, self.tokenizer, self.fe.markers)
        return await self._serve(request, req.generate, ANTHROPIC_NAMES, reply, req.stream)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        messages, tools = anthropic_api.parse_count(body)
        kwargs = anthropic_api.thinking_kwargs(body)
        count = tt.Generate("count", messages=messages, tools=tools, chat_template_kwargs=kwargs)
        ids = await self.fe.tokenize(count)
        return json_response(msgspec.json.encode({"input_tokens": len(ids)}))

    # --- utility endpoints ----------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        msg, generation_prompt = openai_api.parse_tokenize(body)
        ids = await self.fe.tokenize(msg, generation_prompt)
        reply = {"count": len(ids), "max_model_len": self.core.settings.max_context, "tokens": ids}
        return json_response(msgspec.json.encode(reply))

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.fe.config)
        ids = openai_api.parse_detokenize(body, self.core.settings.vocab_size)
        text = await self.fe.detokenize(ids)
        return json_response(msgspec.json.encode({"prompt": text}))

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.core.settings.model:
            body = error_body(f"no model {name!r} here", "invalid_request_error", "model", None)
            return json_response(body, 404)
        return json_response(msgspec.json.encode(self._model_object()))

    async def _models(self, request: web.Request) -> web.Response:
        body = {"object": "list", "data": [self._model_object()]}
        return json_response(msgspec.json.encode(body))

    def _model_object(self) -> dict[str, Any]:
        return {
            "id": self.core.settings.model,
            "object": "model",
            "created": 0,
            "owned_by": "mlx-engine",
            "max_model_len": self.core.settings.max_context,
        }

    # --- health and metrics ---------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        healthy, detail = self.core.health()
        paused = self.core.paused
        if healthy and paused is not None:
            # NOTE: a balancer should send new requests elsewhere only when they are refused
            body = {"status": "paused", "detail": detail, "new_requests": paused.new_requests}
            status = 503 if paused.new_requests == "refuse" else 200
            return json_response(msgspec.json.encode(body), status)
        return _health_response(healthy, detail)

    async def _health_generate(self, request: web.Request) -> web.Response:
        return _health_response(*await self.fe.health_generate())

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.core.metrics.render(await self.fe.stats())
        return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _health_response(healthy: bool, detail: str) -> web.Response:
    body = {"status": "ok" if healthy else "unhealthy", "detail": detail}
    return json_response(msgspec.json.encode(body), 200 if healthy else 503)


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


# engine field -> the Messages API's name for it
ANTHROPIC_NAMES = {"stop": "stop_sequences", "think_budget": "thinking.budget_tokens"}
# engine field -> the Responses API's name for it
RESPONSES_NAMES = {
    "max_tokens": "max_output_tokens",
    "json_schema": "text.format",
    "reasoning_effort": "reasoning.effort",
}
