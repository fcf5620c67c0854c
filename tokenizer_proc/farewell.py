"""The front door's last step of a graceful shutdown: tell each SDK client that it has been sent
everything (`Closing`), and close only once each has read up to there (`ClosingAck`), or after
CLOSE_WAIT_S.

NOTE: why not close at once. The sockets' linger only waits until replies are in the kernel's
buffers, not until the client has read them. The process then exits with them unread (a starved
client takes seconds), and the first frame the client sends after that (a liveness ping, a
heartbeat's answer) reaches a closed socket: the kernel resets the connection, and what was still
buffered on either side is dropped (measured: streams of a starved client lost their last
thousands of chunks and ended `EngineDead`). Only the client can say what it has read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from engine.messages import to_client as tc

log = logging.getLogger("tokenizer")

# NOTE: within the launcher's EXIT_SLACK_S (10 s), with the ROUTER's 2 s linger after it.
CLOSE_WAIT_S = 5.0
Send = Callable[[bytes, tc.ToClient], Awaitable[bool]]


class Farewell:
    def __init__(self) -> None:
        self._waiting: set[bytes] = set()
        self._all_read = asyncio.Event()

    async def run(
        self, clients: Iterable[bytes], send: Send, timeout: float = CLOSE_WAIT_S
    ) -> None:
        """Send `Closing` to each client and wait until each answered or `timeout` passed (a
        client that does not speak this, or reads nothing, costs the shutdown `timeout`)."""
        for client in list(clients):
            self._waiting.add(client)
            if not await send(client, tc.Closing()):  # NOTE: gone; nothing left to read
                self._waiting.discard(client)
        if not self._waiting:
            return
        self._all_read.clear()  # NOTE: the first clients may have answered while others were told
        n, started = len(self._waiting), time.monotonic()
        log.info(
            "shutdown: waiting up to %.1fs for %d client(s) to read their last replies", timeout, n
        )
        try:
            await asyncio.wait_for(self._all_read.wait(), timeout)
        except asyncio.TimeoutError:
            log.warning("%d client(s) did not confirm their last replies", len(self._waiting))
            return
        log.info("every client read its last replies in %.2fs", time.monotonic() - started)

    def read(self, client: bytes) -> None:
        """`client` answered `Closing`: it has read everything sent to it."""
        if client in self._waiting:
            self._waiting.discard(client)
            if not self._waiting:
                self._all_read.set()
