"""One reply's text split as it streams: the model's reasoning, its answer, and its tool calls.

The same split for every way a reply leaves the engine: the HTTP APIs' replies (`replies.py`)
and the SDK's chunks (`sdk_chunk`: `Chunk.reasoning`, `Chunk.tool_calls`). A thinking model's
thought is cut out by its think markers (`reasoning.ReasoningStream`) before the tool-call parser
reads the answer (`tool_calls.for_request`); a model that speaks harmony has its reply parsed by
channel instead, reasoning and calls at once (`harmony.HarmonyStream`), unless a forced call
holds it to the generic JSON form.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from tokenizer_proc import harmony, tool_calls, tool_choice
from tokenizer_proc.harmony import HarmonyStream
from tokenizer_proc.reasoning import Markers, ReasoningStream


class Piece(NamedTuple):
    """What one engine chunk adds to a reply: answer text, reasoning text, tool calls."""

    text: str
    reasoning: str
    calls: list[dict[str, Any]]


class ReplySplit:
    """`begin` once the prompt is known (whether it opened a thought), then `piece` per chunk;
    `calls` and `reasoning_tokens` count what came so far."""

    def __init__(self, gen: tt.Generate, tokenizer: Any, markers: Markers | None) -> None:
        """`gen`: the request (its tools, and whether a forced call takes the generic JSON
        form); `markers`: the model's think markers (None: no reasoning split)."""
        self.tools = tool_calls.for_request(tokenizer, gen)
        self.offered = bool(gen.tools)
        self.markers = markers
        # NOTE: a forced call held to harmony's own syntax (`tool_choice._native`) is read by
        # channel whatever `--reasoning-parser` says (`none` gives no markers)
        self.channels = (markers is not None and markers.harmony) or _harmony_call(gen, tokenizer)
        self.calls = 0
        self.reasoning_tokens = 0
        self.reasoner: ReasoningStream | None = None
        self.harmony: HarmonyStream | None = None

    def begin(self, thinking: bool) -> None:
        """Before the first chunk; `thinking`: the prompt left the model inside a thought."""
        m = self.markers
        if self.channels:
            if not isinstance(self.tools, tool_calls.JsonCalls):
                self.harmony = HarmonyStream(thinking, self.offered)
        elif m is not None:
            self.reasoner = ReasoningStream(m, thinking)

    def piece(self, chunk: tc.Chunk) -> Piece:
        """The chunk's answer, reasoning and tool calls (the parsers hold back marker text);
        a chunk with reasoning in it, or a marker, counts its tokens as reasoning tokens."""
        if self.harmony is not None:
            return self._channels(self.harmony, chunk)
        text, reasoning, end = chunk.text, "", chunk.finish_reason is not None
        if self.reasoner is not None:
            inside = self.reasoner.inside
            reasoning, text = self.reasoner.feed(text)
            if end:
                more, rest = self.reasoner.finish()
                reasoning, text = reasoning + more, text + rest
            if inside or self.reasoner.inside or reasoning:
                self.reasoning_tokens += len(chunk.token_ids)
        if self.tools is None:
            return Piece(text, reasoning, [])
        text, calls = self.tools.feed(text)
        if end:
            rest, more_calls = self.tools.finish()
            text, calls = text + rest, calls + more_calls
        self.calls += len(calls)
        return Piece(text, reasoning, calls)

    def sdk_chunk(self, chunk: tc.Chunk) -> tc.Chunk:
        """An SDK chunk with its text split as the chat route splits it."""
        text, reasoning, calls = self.piece(chunk)
        return msgspec.structs.replace(chunk, text=text, reasoning=reasoning, tool_calls=calls)

    def _channels(self, stream: HarmonyStream, chunk: tc.Chunk) -> Piece:
        """A harmony reply's chunk, parsed by channel (`HarmonyStream` counts its reasoning
        tokens)."""
        parts = stream.feed(chunk.text, len(chunk.token_ids))
        if chunk.finish_reason is not None:
            parts = parts.then(stream.finish())
        self.reasoning_tokens = stream.reasoning_tokens
        self.calls += len(parts.calls)
        return Piece(parts.answer, parts.reasoning, parts.calls)


def _harmony_call(gen: tt.Generate, tokenizer: Any) -> bool:
    """Whether the request forces a call on a chat with a model that speaks harmony: in its
    syntax unless the call takes the generic form, whose parser (`JsonCalls`, from
    `tool_calls.for_request`) `begin` keeps."""
    return gen.messages is not None and tool_choice.forced(gen) and harmony.speaks(tokenizer)


def for_sdk(gen: tt.Generate, tokenizer: Any, markers: Markers | None) -> ReplySplit | None:
    """An SDK request's split: a chat's on a thinking model (as the chat route), or any request
    with tools; None when there is nothing to split."""
    think = markers if gen.messages is not None else None
    if think is None and not gen.tools:
        return None
    return ReplySplit(gen, tokenizer, think)
