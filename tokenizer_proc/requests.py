"""The front door's table of requests in flight: who asked, and where replies go."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizer_proc.reply_split import ReplySplit


@dataclass
class Entry:
    """One request from admission to its terminal chunk.

    `owner` names the connection that sent it (a ZMQ ROUTER identity, an HTTP connection, the
    in-process transport); only its owner may abort it. A request whose replies go to a queue
    (HTTP, health generation) has a `reply_queue`; a ZMQ client's replies go to its identity instead.
    """

    owner: Hashable | None
    reply_queue: asyncio.Queue[Any] | None = None
    # NOTE: the unit of fair admission (an API key's client, an HTTP peer address, an SDK
    # connection); None for requests outside it (health generations, the in-process engine)
    client: str | None = None
    sent: bool = False  # forwarded to the scheduler
    aborted: bool = False  # abort asked: do not forward it, or tell the scheduler
    gone: bool = False  # the client went away: nothing more is sent to it
    # NOTE: an SDK request's reasoning and tool-call split (`reply_split.for_sdk`)
    split: ReplySplit | None = None
    thinking: bool = False  # its prompt left the model inside a thought (`reasoning.py`)
    # NOTE: the request's timeline, recorded here only: logged once and fed to the latency
    # histograms when it finishes.
    admitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def replies(self) -> asyncio.Queue[Any]:
        """The queue of a request whose replies go to one (HTTP, health generation)."""
        assert self.reply_queue is not None, "a ZMQ client's replies go to its ROUTER identity"
        return self.reply_queue


class RequestTable:
    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._by_owner: dict[Hashable, set[str]] = {}
        self._by_client: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, rid: str) -> bool:
        return rid in self._entries

    def get(self, rid: str) -> Entry | None:
        return self._entries.get(rid)

    def add(self, rid: str, entry: Entry) -> None:
        self._entries[rid] = entry
        if entry.owner is not None:
            self._by_owner.setdefault(entry.owner, set()).add(rid)
        if entry.client is not None:
            self._by_client[entry.client] += 1

    def pop(self, rid: str) -> Entry | None:
        entry = self._entries.pop(rid, None)
        if entry is not None and entry.owner is not None:
            rids = self._by_owner.get(entry.owner, set())
            rids.discard(rid)
            if not rids:
                self._by_owner.pop(entry.owner, None)
        if entry is not None and entry.client is not None:
            self._by_client[entry.client] -= 1
            if self._by_client[entry.client] <= 0:
                del self._by_client[entry.client]
        return entry

    def count(self, client: str) -> int:
        """Requests in flight of one client (the unit of fair admission, `Entry.client`)."""
        return self._by_client.get(client, 0)

    def clients(self) -> int:
        """Clients with requests in flight."""
        return len(self._by_client)

    def of_owner(self, owner: Hashable) -> list[str]:
        return list(self._by_owner.get(owner, ()))

    def rids(self) -> list[str]:
        return list(self._entries)
