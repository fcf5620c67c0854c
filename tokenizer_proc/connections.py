"""HTTP connections as a bounded resource: a total and a per-peer cap, and a deadline for a
connection's request headers.

Connections that never finished their headers were never closed (2,000 held for 105 s), and at
1,100 of them the front door ran out of descriptors: HTTP went unanswered for ~40 s and new SDK
clients, whose ZMQ endpoint lives in the same process, got `EngineDead`. Each accepted connection
goes through `_Guarded`, which hands it to aiohttp's own protocol (`HttpApi.runner.server`) or
closes it at once when a cap is reached, and closes one whose first request's headers are not
complete within `--client-timeout`. Idle keep-alive connections are aiohttp's to close
(`--http-keepalive-timeout`). Refusals and closings are logged once per interval, with counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig

log = logging.getLogger("tokenizer.http")

RESERVED_FILES = 512  # NOTE: descriptors kept for the ZMQ endpoint, the pipes, model files
MAX_AUTO = 65536
HEADER_END = b"\r\n\r\n"
MAX_HEADER_BYTES = 64 << 10  # NOTE: aiohttp refuses longer headers itself (a 400)
REPORT_S = 10.0


def max_connections(config: EngineConfig, open_files: int) -> int:
    """`--http-max-connections`, 0 meaning the open-file limit less what else needs files."""
    if config.http_max_connections:
        return config.http_max_connections
    return max(64, min(MAX_AUTO, open_files - RESERVED_FILES))


class ConnectionGuard:
    def __init__(self, total: int, per_peer: int, header_timeout: float) -> None:
        self.total, self.per_peer, self.header_timeout = total, per_peer, header_timeout
        self.open = 0
        self.peers: Counter[str] = Counter()
        self.refused = self.slow = 0  # NOTE: since start (stats), and since the last report
        self._report: dict[str, int] = {"refused": 0, "slow": 0}
        self._reported_at = 0.0

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for `loop.create_server`: each connection through the guard."""
        return lambda: _Guarded(self, make)

    def admit(self, peer: str) -> bool:
        if self.open >= self.total or (self.per_peer and self.peers[peer] >= self.per_peer):
            self.refused += 1
            self._note("refused")
            return False
        self.open += 1
        self.peers[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self.open -= 1
        self.peers[peer] -= 1
        if not self.peers[peer]:
            del self.peers[peer]

    def timed_out(self) -> None:
        self.slow += 1
        self._note("slow")

    def _note(self, what: str) -> None:
        """Count, and log the counts at most once per `REPORT_S` (a flood is one line)."""
        self._report[what] += 1
        now = time.monotonic()
        if now - self._reported_at < REPORT_S:
            return
        self._reported_at = now
        refused, slow = self._report["refused"], self._report["slow"]
        self._report = {"refused": 0, "slow": 0}
        log.warning(
            "HTTP connections: %d refused (cap %d, %d a peer), %d closed without request headers "
            "within %.0f s; %d open",
            refused,
            self.total,
            self.per_peer,
            slow,
            self.header_timeout,
            self.open,
        )


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol behind the caps and the header deadline."""

    def __init__(self, guard: ConnectionGuard, make: Callable[[], asyncio.Protocol]) -> None:
        self.guard, self.make = guard, make
        self.inner: asyncio.Protocol | None = None
        self.peer = ""
        self.head = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self.guard.admit(self.peer):
            transport.abort()
            return
        self.transport = transport
        self.inner = self.make()
        self.inner.connection_made(transport)
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.guard.header_timeout, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.timer is not None:
            # NOTE: only the first request's headers are timed; later ones are aiohttp's
            self.head = (self.head + data)[-MAX_HEADER_BYTES:]
            if HEADER_END in self.head:
                self._stop_timer()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        self._stop_timer()
        self.guard.release(self.peer)
        inner, self.inner = self.inner, None
        inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def _too_slow(self) -> None:
        self.timer = None
        if self.inner is not None:
            self.guard.timed_out()
            self.transport.abort()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.head = b""


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """asyncio logs every refused accept (out of descriptors) with a traceback: 93 MB of log in
    one flood. One line per `REPORT_S` with the count instead; anything else as before."""
    state = {"count": 0, "at": 0.0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system"):
            loop.default_exception_handler(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["at"] >= REPORT_S:
            log.warning(
                "HTTP accept refused %d times (out of open files: %s)",
                state["count"],
                context.get("exception"),
            )
            state["count"], state["at"] = 0, now

    loop.set_exception_handler(handler)
