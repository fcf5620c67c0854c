"""Token ids to text for every running request (no sockets here: see detokenizer_proc.main)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import msgspec

from detokenizer_proc.stream import TextStream
from engine.messages.to_client import Chunk, FinishReason

log = logging.getLogger("detokenizer")


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        # NOTE: building a BPE streaming detokenizer maps the whole vocabulary (~50 ms for 49k
        # tokens); a shallow copy of one prototype shares that map: ~4 us per request
        # (docs/architecture.md, "Decisions").
        self._proto = tokenizer.detokenizer
        # NOTE: every token that ends a turn is no text either: a model's config may name stop
        # tokens its tokenizer does not call special (Llama 3.1's <|eom_id|>, gpt-oss's <|call|>)
        stops = getattr(tokenizer, "eos_token_ids", None) or ()
        self._skip = frozenset(getattr(tokenizer, "all_special_ids", ())) | frozenset(stops)
        self._streams: dict[str, TextStream] = {}

    def register(self, rid: str, stop: list[str]) -> None:
        detok = copy.copy(self._proto)
        detok.reset()
        self._streams[rid] = TextStream(detok, stop, self._skip)

    def drop(self, rid: str) -> None:
        self._streams.pop(rid, None)

    def __len__(self) -> int:
        return len(self._streams)

    def process(self, outputs: list[Chunk]) -> tuple[list[Chunk], list[str]]:
        """Chunks for the client, and the rids ended here, by a stop string or an error (the
        scheduler must abort them)."""
        chunks: list[Chunk] = []
        ended: list[str] = []
        for out in outputs:
            try:
                chunk = self._one(out)
            except Exception as e:  # NOTE: a bad request ends alone; the batch's others still go
                chunk = self._failed(out, e)
            if chunk is None:
                continue
            chunks.append(chunk)
            if chunk.finish_reason is not None and out.finish_reason is None:
                ended.append(out.rid)
        return chunks, ended

    def _one(self, out: Chunk) -> Chunk | None:
        stream = self._streams.get(out.rid)
        if stream is None:
            # NOTE: a request already ended by a stop string still has a step or two in flight.
            return None
        stream.add(out.token_ids)
        text, stop = stream.take(final=out.finish_reason is not None)
        finish: FinishReason | None = "stop" if stop is not None else out.finish_reason
        if finish is not None:
            del self._streams[out.rid]
        return _chunk(out, text, finish, stop=stop)

    def _failed(self, out: Chunk, error: Exception) -> Chunk:
        log.exception("rid=%s detokenization failed", out.rid)
        self._streams.pop(out.rid, None)
        return _chunk(out, "", "error", f"detokenizer: {type(error).__name__}: {error}")


def _chunk(
    out: Chunk,
    text: str,
    finish: FinishReason | None,
    error: str | None = None,
    stop: str | None = None,
) -> Chunk:
    """The scheduler's chunk with its text (and how it ended, when that changed here: a stop
    string names itself)."""
    error = error or out.error
    return msgspec.structs.replace(out, text=text, finish_reason=finish, error=error, stop=stop)
