"""What the SDK and `OfflineEngine` return: stream chunks and whole results (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.messages.to_client import Chunk, FinishReason, TokenLogprob


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class StreamChunk:
    """A delta of one request; `finish_reason` (stop, length, abort, error) only on the last."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # completed in this delta
    # NOTE: with `prompt_logprobs`, on the first delta: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    reasoning: str = ""  # a thinking model's thought (chats), out of `text`

    @classmethod
    def from_wire(cls, c: Chunk) -> StreamChunk:
        """From a `Chunk` (straight from the scheduler in `OfflineEngine`: no text)."""
        usage = Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        return cls(
            c.rid,
            c.text,
            c.token_ids,
            c.finish_reason,
            usage,
            c.logprobs,
            c.error,
            c.tool_calls,
            c.prompt_logprobs,
            c.reasoning,
        )


@dataclass
class GenerateResult:
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    reasoning: str = ""  # a thinking model's thought (chats), out of `text`

    def add(self, chunk: StreamChunk) -> None:
        self.prompt_logprobs += chunk.prompt_logprobs
        self.text += chunk.text
        self.reasoning += chunk.reasoning
        self.tool_calls += chunk.tool_calls
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.finish_reason, self.usage, self.error = chunk.finish_reason, chunk.usage, chunk.error
