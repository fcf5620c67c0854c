"""The requests waiting for a row, served fairly across clients.

First come, first served let one client with hundreds of queued long requests keep every other
client waiting behind them. Each client (`Req.client`: an API key's client, an HTTP peer, an SDK
connection; tokenizer_proc/core.py `client_of`) has a line of its own; the next request is the
oldest of the client holding the fewest running rows, ties to the client served least recently.
With one client this is arrival order. Every choice follows insertion order, never a hash, so
tensor-parallel ranks replaying the same messages choose alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from scheduler_proc.request import Req

Rows = Callable[[str], int]  # a client's running rows


class WaitingQueue:
    def __init__(self) -> None:
        self._lines: dict[str, deque[Req]] = {}
        self._served: dict[str, int] = {}  # client -> the turn it last got a row
        self._turn = 0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Req]:
        for line in self._lines.values():
            yield from line

    def clients(self) -> list[str]:
        return list(self._lines)

    def append(self, req: Req) -> None:
        """A new request: last in its client's line."""
        self._lines.setdefault(req.client, deque()).append(req)
        self._n += 1

    def appendleft(self, req: Req) -> None:
        """A request put back (deferred, refused pages, preempted): first in its client's line."""
        self._lines.setdefault(req.client, deque()).appendleft(req)
        self._n += 1

    def peek(self, rows: Rows) -> Req:
        return self._lines[self._next_client(rows)][0]

    def popleft(self, rows: Rows) -> Req:
        client = self._next_client(rows)
        req = self._lines[client].popleft()
        self._n -= 1
        self._drop_if_empty(client)
        return req

    def remove(self, req: Req) -> None:
        self._lines[req.client].remove(req)
        self._n -= 1
        self._drop_if_empty(req.client)

    def served(self, client: str) -> None:
        """`client`'s request got a row: others go before it at equal rows."""
        self._turn += 1
        if client in self._lines:
            self._served[client] = self._turn

    def _next_client(self, rows: Rows) -> str:
        served = self._served
        return min(self._lines, key=lambda c: (rows(c), served.get(c, 0)))

    def _drop_if_empty(self, client: str) -> None:
        if not self._lines[client]:
            del self._lines[client]
            # NOTE: forgotten with its line, so weeks of short-lived connections leave nothing
            self._served.pop(client, None)
