"""The SDK's connection to the tokenizer process: one DEALER socket on its own I/O thread.

Callers hand messages to `send` from any thread; replies go to the sink registered under their
rid. The I/O thread pings while calls are pending; an engine that stays silent for `dead_after`
seconds, or announces its death, fails every pending call with `EngineDead`, so no caller hangs.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable

import msgspec
import zmq

from engine.errors import EngineDead
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import Codec

log = logging.getLogger("engine.client")

Sink = Callable[[tc.ToClient], None]
PING_EVERY_S = 0.5
POLL_MS = 100


class Transport:
    def __init__(self, address: str, dead_after: float = 5.0) -> None:
        self.address = address
        self._core = _Core(address, dead_after)
        self._thread = threading.Thread(target=self._core.run, name="engine-client-io", daemon=True)
        self._thread.start()
        # NOTE: a client dropped without close() still says goodbye and frees its socket.
        self._finalizer = weakref.finalize(self, _Core.stop, self._core, self._thread)

    def register(self, rid: str, sink: Sink) -> None:
        self._core.sinks[rid] = sink

    def unregister(self, rid: str) -> None:
        self._core.sinks.pop(rid, None)

    def send(self, msg: tt.FromClient) -> None:
        if self._core.dead is not None:
            raise EngineDead(self._core.dead)
        self._core.post(msg)

    @property
    def dead(self) -> str | None:
        return self._core.dead

    def close(self) -> None:
        self._finalizer()


class _Core:
    """State shared with the I/O thread; never references the Transport (weakref.finalize)."""

    def __init__(self, address: str, dead_after: float) -> None:
        self.address = address
        self.dead_after = dead_after
        self.sinks: dict[str, Sink] = {}
        self.dead: str | None = None
        self._outbox: collections.deque[tt.FromClient] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._codec: Codec[tc.ToClient] = Codec(tc.ToClient)
        self._encode = msgspec.msgpack.Encoder().encode

    def post(self, msg: tt.FromClient) -> None:
        self._outbox.append(msg)
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # NOTE: a full pipe already guarantees a wake-up

    @staticmethod
    def stop(core: _Core, thread: threading.Thread) -> None:
        core._stopping = True
        core._wake()
        thread.join(5.0)
        core._wake_r.close()
        core._wake_w.close()

    # --- the I/O thread -------------------------------------------------------------------------

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(self.address)
        try:
            self._loop(sock)
        finally:
            self._send_now(sock, tt.Goodbye())
            sock.close()
            ctx.term()

    def _loop(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._heard = self._pinged = time.monotonic()
        while not self._stopping:
            events = dict(poller.poll(POLL_MS))
            if self._wake_r.fileno() in events:
                self._drain_wake()
            self._flush(sock)
            if sock in events:
                self._receive(sock)
            self._liveness(sock)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            try:
                sock.send(self._encode(self._outbox[0]), zmq.NOBLOCK)
            except zmq.Again:
                return  # NOTE: never block the I/O thread; liveness still runs and may fail calls
            self._outbox.popleft()

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._heard = time.monotonic()
            self._dispatch(frame.buffer)

    def _dispatch(self, frame: memoryview) -> None:
        try:
            msg = self._codec.decode(frame)
        except msgspec.MsgspecError as e:
            log.error("dropped a malformed frame from the engine: %s", e)
            return
        rid = getattr(msg, "rid", None)
        sink = self.sinks.get(rid) if rid is not None else None
        if sink is not None:
            sink(msg)
        if isinstance(msg, tc.Failure) and msg.kind == "engine_dead" and not msg.rid:
            self._declare_dead(msg.message)

    def _liveness(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        if not self.sinks:
            self._heard = now  # NOTE: silence only counts while a call waits for an answer
            return
        if now - self._pinged >= PING_EVERY_S:
            self._pinged = now
            self._send_now(sock, tt.Ping())
        if now - self._heard > self.dead_after:
            self._declare_dead(f"no answer from {self.address} for {self.dead_after:.1f}s")

    def _send_now(self, sock: zmq.Socket, msg: tt.FromClient) -> None:
        """Send a ping or goodbye if the queue has room; never block the I/O thread on one
        (an engine that reads nothing is declared dead by silence instead)."""
        try:
            sock.send(self._encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _declare_dead(self, reason: str) -> None:
        if self.dead is None:
            log.error("engine dead: %s", reason)
        self.dead = reason
        for rid, sink in list(self.sinks.items()):
            sink(tc.Failure(rid, "engine_dead", reason))
