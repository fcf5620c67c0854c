"""Each API's reply to one request: text and tool calls chunk by chunk, whole or as SSE events,
and the choices of an `n` / `best_of` request interleaved in one stream."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import msgspec
from aiohttp import web

from engine.errors import EngineError, InvalidRequest, ShuttingDown
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.wire_errors import to_exception
from tokenizer_proc import anthropic_api, choices, openai_api, responses_api
from tokenizer_proc.http_errors import ANTHROPIC_TYPES, STATUS, error_body, status_of
from tokenizer_proc.reasoning import Markers
from tokenizer_proc.reply_split import Piece, ReplySplit
from tokenizer_proc.requests import Entry

log = logging.getLogger("tokenizer.http")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Whole(NamedTuple):
    """A whole reply: its answer, last chunk, tool calls and reasoning."""

    text: str
    final: tc.Chunk
    calls: list[dict[str, Any]]
    reasoning: str


class ApiReply:
    """What both APIs' replies share: reasoning, text and tool calls chunk by chunk (the
    reasoning split when the model thinks, the tool-call parser when tools were offered), and
    the SSE stream; each API's subclass says what its stream opens with (`_opening`) and what one
    engine message adds (`_events`)."""

    def __init__(
        self, gen: tt.Generate, tokenizer: Any, markers: Markers | None = None, rid: str = ""
    ) -> None:
        """`gen`: the request (its tools, and whether a forced call takes the generic JSON form,
        `tool_choice.generic_form`); `rid`: this reply's, when not `gen`'s (a choice of `n`)."""
        self.rid = rid or gen.rid
        self.split = ReplySplit(gen, tokenizer, markers)

    @property
    def calls(self) -> int:
        return self.split.calls

    @property
    def reasoning_tokens(self) -> int:
        return self.split.reasoning_tokens

    def begin(self, entry: Entry) -> None:
        """Before its first chunk: the split starts inside a thought when the prompt opened one
        (`Entry.thinking`)."""
        self.split.begin(entry.thinking)

    async def whole(self, entry: Entry) -> dict[str, Any]:
        raise NotImplementedError

    async def _collect(self, entry: Entry, each: Any = None) -> Whole:
        """The whole reply; `each` sees every chunk."""
        self.begin(entry)
        text, reasoning, calls = [], [], []
        while True:
            chunk = _chunk(await entry.replies().get())
            piece = self._text(chunk)
            text.append(piece.text)
            reasoning.append(piece.reasoning)
            calls += piece.calls
            if each is not None:
                each(chunk)
            if chunk.finish_reason is not None:
                _check_finish(chunk)
                return Whole("".join(text), chunk, calls, "".join(reasoning))

    def _opening(self, first: tc.Chunk) -> bytes:
        return b""

    def _events(self, msg: tc.Chunk | tc.Failure, out: bytearray) -> bool:
        """Append the SSE events of one engine message; True when it ends the stream."""
        raise NotImplementedError

    async def stream(self, request: web.Request, entry: Entry) -> web.StreamResponse:
        queue = entry.replies()
        self.begin(entry)
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

    def _text(self, chunk: tc.Chunk) -> Piece:
        return self.split.piece(chunk)


class Reply(ApiReply):
    """One request's replies (one choice's), turned into OpenAI objects: whole, or streamed as
    SSE. `tail`: it ends its stream (usage, [DONE]); a choice of several leaves that to
    `choices.stream`. `echo`: the prompt's text, written before the reply's (`echo: true`)."""

    def __init__(
        self,
        req: openai_api.Request,
        fmt: openai_api.Formatter,
        tokenizer: Any,
        tail: bool = True,
        rid: str = "",
        markers: Markers | None = None,
    ) -> None:
        # NOTE: completions are raw text: only a chat's reply splits its reasoning out
        think = markers if req.kind == "chat" else None
        super().__init__(req.generate, tokenizer, think, rid)
        self.req, self.fmt, self.tail = req, fmt, tail
        self.echo: str | None = None
        self.final: tc.Chunk | None = None
        self.failed = False
        self.logprob_sum, self.logprob_count = 0.0, 0  # NOTE: best_of ranks by their mean

    async def whole(self, entry: Entry) -> dict[str, Any]:
        logprobs: list[dict[str, Any]] = []

        def keep(chunk: tc.Chunk) -> None:
            self._score(chunk)
            if self.echo is not None and (lp := self.fmt.prompt_logprobs(chunk)) is not None:
                logprobs.append(lp)
            if (lp := self.fmt.logprobs(chunk)) is not None:
                logprobs.append(lp)

        text, final, calls, reasoning = await self._collect(entry, keep)
        text = (self.echo or "") + text
        return self.fmt.whole(text, final, logprobs, calls, reasoning, self.reasoning_tokens)

    def _score(self, chunk: tc.Chunk) -> None:
        self.logprob_sum += sum(lp.logprob for lp in chunk.logprobs)
        self.logprob_count += len(chunk.logprobs)

    def _opening(self, first: tc.Chunk) -> bytes:
        if self.req.kind == "chat":
            return _event(self.fmt.stream_chunk(role=True))
        if self.echo is not None:
            return _event(self.fmt.stream_chunk(self.echo, self.fmt.prompt_logprobs(first)))
        return b""

    def _events(self, msg: tc.Chunk | tc.Failure, out: bytearray) -> bool:
        if isinstance(msg, tc.Failure):
            self.failed = True
            out += _error_event(to_exception(msg))
            out += DONE if self.tail else b""
            return True
        self.final = msg
        text, reasoning, calls = self._text(msg)
        logprobs = self.fmt.logprobs(msg)
        if text or calls or reasoning or (logprobs and msg.token_ids):
            chunk = self.fmt.stream_chunk(text, logprobs, tool_calls=calls, reasoning=reasoning)
            out += _event(chunk)
        if msg.finish_reason is None:
            return False
        if msg.finish_reason in ("stop", "length"):
            reason = openai_api.finish_reason(msg.finish_reason, self.calls > 0)
            out += _event(self.fmt.stream_chunk(finish=reason))
        else:
            self.failed = True
            out += _error_event(_finish_error(msg))
        if self.tail:
            if self.req.include_usage:
                out += _event(self.fmt.usage_chunk(msg, self.reasoning_tokens))
            out += DONE
        return True


class _EventReply(ApiReply):
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
        text, reasoning, calls = self._text(msg)
        out += self.events.reasoning(reasoning)
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

    def __init__(
        self, req: anthropic_api.Request, tokenizer: Any, markers: Markers | None = None
    ) -> None:
        super().__init__(req.generate, tokenizer, markers)
        self.req = req
        self.fmt = anthropic_api.Formatter(req)
        self.events = anthropic_api.Events(self.fmt)

    def _opening(self, first: tc.Chunk) -> bytes:
        return self.events.start(first)

    def _error(self, e: EngineError) -> bytes:
        return _anthropic_error_event(e)


class ResponsesReply(_EventReply):
    """One /v1/responses request's replies: a response object, or its stream of events."""

    def __init__(
        self, req: responses_api.Request, tokenizer: Any, markers: Markers | None = None
    ) -> None:
        super().__init__(req.generate, tokenizer, markers)
        self.fmt = responses_api.Formatter(req)
        self.events = responses_api.Events(self.fmt)

    def _opening(self, first: tc.Chunk) -> bytes:
        return self.events.start()

    def _text(self, chunk: tc.Chunk) -> Piece:
        piece = super()._text(chunk)
        self.fmt.reasoning_tokens = self.reasoning_tokens
        return piece

    def _error(self, e: EngineError) -> bytes:
        return _responses_error_event(self.events, e)


def _responses_error_event(events: responses_api.Events, e: EngineError) -> bytes:
    return events.error(str(e), STATUS.get(type(e), (500, "server_error", None))[1])


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


async def stream_choices(
    request: web.Request, req: openai_api.Request, replies: list[Reply], entries: list[Entry]
) -> web.StreamResponse:
    """The choices' SSE events interleaved as they come (each chunk names its index), one usage
    and one [DONE] at the end; a failed choice ends the stream (the caller aborts the rest).

    NOTE: every choice's first answer comes before any byte, so a refusal after admission
    still gets its HTTP status."""
    firsts = [_chunk(await e.replies().get()) for e in entries]
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    out, ended = bytearray(), set()
    for i, first in enumerate(firsts):
        replies[i].begin(entries[i])
        out += replies[i]._opening(first)
        if replies[i]._events(first, out):
            ended.add(i)
    try:
        if not any(r.failed for r in replies):
            async for i, msg in choices.interleaved(entries, ended):
                await resp.write(bytes(out))
                out = bytearray()
                if replies[i]._events(msg, out) and replies[i].failed:
                    break
        await resp.write(bytes(out) + _choices_tail(req, replies))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("rid=%s HTTP client gone mid-stream", req.generate.rid)
    return resp


def _choices_tail(req: openai_api.Request, replies: list[Reply]) -> bytes:
    finals = [r.final for r in replies if r.final is not None]
    if not req.include_usage or len(finals) < len(replies) or any(r.failed for r in replies):
        return DONE
    usage = choices.total_usage(
        [openai_api.usage(r.final, r.reasoning_tokens) for r in replies if r.final is not None]
    )
    return _event({**replies[0].fmt.usage_chunk(finals[0]), "usage": usage}) + DONE
