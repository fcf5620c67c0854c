"""The tokenizer process's table of requests in flight: who asked, and where replies go."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.messages.to_client import Chunk


@dataclass
class Entry:
    """One request from admission to its terminal chunk.

    `client` is the ROUTER identity of an SDK client, or None for an internal request (health
    generation) whose chunks go to `chunks` instead.
    """

    client: bytes | None
    chunks: asyncio.Queue[Chunk] | None = None
    sent: bool = False  # forwarded to the scheduler
    aborted: bool = False  # abort asked: do not forward it, or tell the scheduler
    gone: bool = False  # the client went away: nothing more is sent to it
    # NOTE: the request's timeline, recorded here only and logged once when it finishes.
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None


class RequestTable:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._by_client: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def get(self, rid: str) -> Entry | None:
        return self._entries.get(rid)

    def add(self, rid: str, entry: Entry) -> None:
        self._entries[rid] = entry
        if entry.client is not None:
            self._by_client.setdefault(entry.client, set()).add(rid)

    def pop(self, rid: str) -> Entry | None:
        entry = self._entries.pop(rid, None)
        if entry is not None and entry.client is not None:
            rids = self._by_client.get(entry.client, set())
            rids.discard(rid)
            if not rids:
                self._by_client.pop(entry.client, None)
        return entry

    def count(self, client: bytes) -> int:
        return len(self._by_client.get(client, ()))

    def of_client(self, client: bytes) -> list[str]:
        return list(self._by_client.get(client, ()))

    def rids(self) -> list[str]:
        return list(self._entries)
