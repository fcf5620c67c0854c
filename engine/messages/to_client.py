"""Messages an SDK client receives from the tokenizer process (its DEALER socket)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from engine.protocol import Message

# NOTE: the one spelling of why a request ended, on every layer (scheduler, wire, SDK, HTTP).
FinishReason = Literal["stop", "length", "abort", "error"]


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One generated token's logprob and the top-n (id, logprob) pairs of its distribution."""

    logprob: float
    top: list[tuple[int, float]] = []


class Welcome(Message):
    """Answer to `Hello`: the engine speaks the client's protocol version."""

    rid: str
    version: int
    model: str = ""
    max_context: int = 0


class Chunk(Message):
    """One request's result of one step: its new token ids (the scheduler fills those and the
    counts) and their text (the detokenizer fills it in). `finish_reason` is set on the request's
    last chunk only. The one record of a step's result, from the scheduler to the SDK."""

    rid: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    # NOTE: `prompt_logprobs` requests, on their first chunk: one per prompt token, the first
    # None (nothing before it), and the prompt's token ids
    prompt_logprobs: list[TokenLogprob | None] = []
    prompt_ids: list[int] = []
    error: str | None = None  # why, when finish_reason is "error"
    # NOTE: the request's own field at fault, when the error is its input's (a grammar that gives
    # out mid-output: llguidance's limits); the HTTP API answers it as a 400 naming the field
    invalid: str | None = None
    stop: str | None = None  # the stop string that ended the text (finish_reason "stop")
    # NOTE: SDK requests with tools: the calls this chunk completed, parsed as over HTTP (OpenAI's
    # shape); their text is not in `text`
    tool_calls: list[dict[str, Any]] = []
    # NOTE: SDK chats on a thinking model: the thought this chunk added, out of `text` (as the
    # chat route's `reasoning_content`)
    reasoning: str = ""


class Failure(Message):
    """A typed error for one request or call; `kind` names the exception (see engine.wire_errors)."""

    rid: str
    kind: str
    message: str
    field: str = ""


class HealthReply(Message):
    rid: str
    healthy: bool
    detail: str = ""


class StatsReply(Message):
    rid: str
    stats: dict[str, float] = {}


class AdminReply(Message):
    """An operation on the running engine succeeded (engine/messages/admin.py); what it did."""

    rid: str
    info: dict[str, Any] = {}


class Ack(Message):
    """A call without a payload (abort, shutdown) was accepted."""

    rid: str


class Pong(Message):
    """Answer to `Ping`: the tokenizer process is alive (SDK liveness detection)."""


class Closing(Message):
    """The engine is shutting down and sent this connection its last reply; the SDK answers
    `ClosingAck` once it has read everything before this (the front door closes after that)."""


ToClient = Welcome | Chunk | Failure | HealthReply | StatsReply | AdminReply | Ack | Pong | Closing
