"""The SDK's connection to the tokenizer process: one DEALER socket on its own I/O thread.

Callers encode their messages in their own thread (`encode_request`: an argument the wire cannot
carry is an `InvalidRequest` raised to that caller) and hand the bytes to the I/O thread; replies
go to the sink registered under their rid. No caller ever waits forever:

- an engine silent for `dead_after` seconds while calls wait, or one that announces its death,
  fails every waiting call with `EngineDead`; later calls try again (an engine that comes back
  under its supervisor serves them);
- a lost or reset TCP connection (seen by a socket monitor) fails the calls waiting on it: the
  engine aborted their requests when it could no longer reach this client;
- a failure of the I/O thread itself, or `close()`, fails every waiting call at once.

A graceful shutdown ends with `Closing`; the answer (`ClosingAck`) tells the engine that this
client has read every reply, so it can close the connection without losing any.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from engine.errors import EngineDead, InvalidRequest
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import Codec

log = logging.getLogger("engine.client")

Sink = Callable[[tc.ToClient], None]
PING_EVERY_S = 0.5
POLL_MS = 100
DROP_GRACE_S = 1.0
_ENCODER = msgspec.msgpack.Encoder()
# NOTE: what msgspec raises for a value msgpack cannot carry: a lone surrogate (UnicodeEncodeError,
# a ValueError), an int beyond 64 bits (OverflowError), a numpy array or scalar (TypeError).
_UNENCODABLE = (TypeError, ValueError, OverflowError)


def encode_request(msg: tt.FromClient) -> bytes:
    """Encode in the caller's thread; an argument the wire cannot carry raises `InvalidRequest`
    naming it (a sampling keyword by its own name), instead of failing on the I/O thread."""
    try:
        return _ENCODER.encode(msg)
    except _UNENCODABLE as e:
        raise InvalidRequest(_unencodable_field(msg), f"cannot be sent: {e}") from None


def _unencodable_field(msg: tt.FromClient) -> str:
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if _encodes(value):
            continue
        if isinstance(value, dict):
            return next((str(k) for k, v in value.items() if not _encodes(k, v)), name)
        return name
    return "request"


def _encodes(*values: Any) -> bool:
    try:
        _ENCODER.encode(values)
        return True
    except _UNENCODABLE:
        return False


def register_sink(sinks: dict[str, Sink], rid: str, sink: Sink) -> None:
    """Add `sink` under `rid`; a rid still in use on this client is refused (the first caller
    would otherwise lose its replies to the second and wait forever)."""
    if sinks.setdefault(rid, sink) is not sink:
        raise InvalidRequest("rid", f"{rid!r} is already in use on this client")


class Transport:
    def __init__(self, address: str, dead_after: float = 5.0) -> None:
        self.address = address
        self._core = _Core(address, dead_after)
        self._thread = threading.Thread(target=self._core.run, name="engine-client-io", daemon=True)
        self._thread.start()
        # NOTE: a client dropped without close() still says goodbye and frees its socket.
        self._finalizer = weakref.finalize(self, _Core.stop, self._core, self._thread)

    def register(self, rid: str, sink: Sink) -> None:
        register_sink(self._core.sinks, rid, sink)

    def unregister(self, rid: str) -> None:
        self._core.sinks.pop(rid, None)

    def send(self, msg: tt.FromClient) -> None:
        frame = encode_request(msg)
        if self._core.broken is not None:
            raise EngineDead(self._core.broken)
        self._core.post(frame)

    @property
    def dead(self) -> str | None:
        """Why the last waiting calls failed (None while all is well); informational only."""
        return self._core.broken or self._core.dead

    def close(self) -> None:
        self._finalizer()


class _Core:
    """State shared with the I/O thread; never references the Transport (weakref.finalize)."""

    def __init__(self, address: str, dead_after: float) -> None:
        self.address = address
        self.dead_after = dead_after
        self.sinks: dict[str, Sink] = {}
        self.dead: str | None = None  # the last reason waiting calls failed; not permanent
        self.broken: str | None = None  # closed, or the I/O thread failed: every send fails
        self._outbox: collections.deque[bytes] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._codec: Codec[tc.ToClient] = Codec(tc.ToClient)

    def post(self, frame: bytes) -> None:
        self._outbox.append(frame)
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
        # NOTE: other threads may still wait on this client (a stream, a call): they end now.
        core._fail_all("the client was closed", broken=True)
        core._wake_r.close()
        core._wake_w.close()

    # --- the I/O thread -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # NOTE: whatever kills this thread, no caller waits forever
            log.exception("the SDK's I/O thread failed")
            self._fail_all(f"the client's I/O thread failed: {type(e).__name__}: {e}", True)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 500)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        try:
            self._loop(sock, monitor)
        finally:
            self._send_now(sock, tt.Goodbye())
            sock.disable_monitor()
            monitor.close(0)
            sock.close()
            ctx.term()

    def _loop(self, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._heard = self._pinged = time.monotonic()
        self._dropped: list[tuple[float, set[str]]] = []  # (when to fail, rids waiting then)
        while not self._stopping:
            events = dict(poller.poll(POLL_MS))
            if self._wake_r.fileno() in events:
                self._drain_wake()
            self._flush(sock)
            if sock in events:
                self._receive(sock)
            if monitor in events:
                self._on_monitor(monitor)
            self._fail_dropped()
            self._liveness(sock)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _on_monitor(self, monitor: zmq.Socket) -> None:
        """A dropped connection: the engine gave this client's requests up (their replies had
        nowhere to go), and the reconnected socket has a new identity, so calls waiting on the
        old one would never hear back. They fail DROP_GRACE_S later: what the engine sent just
        before closing (a graceful shutdown's last chunks) can surface after the event."""
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._dropped.append((time.monotonic() + DROP_GRACE_S, set(self.sinks)))

    def _fail_dropped(self) -> None:
        now = time.monotonic()
        while self._dropped and self._dropped[0][0] <= now:
            _, rids = self._dropped.pop(0)
            reason = f"the connection to {self.address} was lost"
            self._fail_all(reason, only=rids)

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            try:
                sock.send(self._outbox[0], zmq.NOBLOCK)
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
        except (msgspec.MsgspecError, RecursionError) as e:
            log.error("dropped a malformed frame from the engine: %s", e)
            return
        rid = getattr(msg, "rid", None)
        sink = self.sinks.get(rid) if rid is not None else None
        if sink is not None:
            _deliver(sink, msg)
        if isinstance(msg, tc.Failure) and msg.kind == "engine_dead" and not msg.rid:
            self._fail_all(msg.message)
        elif isinstance(msg, tc.Closing):
            # NOTE: every reply before it is dispatched; the engine waits for this to close.
            self.post(encode_request(tt.ClosingAck()))

    def _liveness(self, sock: zmq.Socket) -> None:
        now = time.monotonic()
        if not self.sinks:
            self._heard = now  # NOTE: silence only counts while a call waits for an answer
            return
        if now - self._pinged >= PING_EVERY_S:
            self._pinged = now
            self._send_now(sock, tt.Ping())
        if now - self._heard > self.dead_after:
            self._fail_all(f"no answer from {self.address} for {self.dead_after:.1f}s")

    def _send_now(self, sock: zmq.Socket, msg: tt.FromClient) -> None:
        """Send a ping or goodbye if the queue has room; never block the I/O thread on one
        (an engine that reads nothing is declared dead by silence instead)."""
        try:
            sock.send(encode_request(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _fail_all(self, reason: str, broken: bool = False, only: set[str] | None = None) -> None:
        """Fail every waiting call (or those in `only`) with `EngineDead`, once each (their
        sinks are removed)."""
        if broken:
            self.broken = self.broken or reason
        rids = [r for r in self.sinks if only is None or r in only]
        if rids:
            log.error("failing %d waiting call(s): %s", len(rids), reason)
        self.dead = reason
        for rid in rids:
            sink = self.sinks.pop(rid, None)
            try:
                if sink is not None:
                    sink(tc.Failure(rid, "engine_dead", reason))
            except BaseException:  # NOTE: this may run because a sink failed; tell the others
                log.exception("a reply sink failed")


def _deliver(sink: Sink, msg: tc.ToClient) -> None:
    try:
        sink(msg)
    except Exception:  # NOTE: one caller's broken sink must not end everyone's replies
        log.exception("a reply sink failed")
