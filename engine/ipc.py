"""The only code that touches internal ZeroMQ sockets: typed PUSH/PULL queues and the endpoints.

Each queue owns its socket and its codec, so a process reads and writes Python messages only.
The stable side (the receiver) binds; senders connect.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.protocol import Codec

T = TypeVar("T")
log = logging.getLogger(__name__)

# NOTE: senders bound their queues by request admission (--max-queued-requests), so the socket
# high-water marks only need to be large enough never to block a step's burst of messages.
HWM = 100_000
LINGER_MS = 2_000


@dataclass(frozen=True)
class Endpoints:
    """Every address of one engine, derived from its config and a private per-launch directory."""

    client: str
    tokenizer: str
    scheduler: str
    detokenizer: str
    launcher: str

    @classmethod
    def create(cls, config: EngineConfig, run_dir: Path) -> Endpoints:
        """`run_dir` is the launcher's private directory (it removes it at exit)."""
        return cls(
            client=f"tcp://{config.host}:{config.zmq_port}",
            tokenizer=f"ipc://{run_dir}/tokenizer",
            scheduler=f"ipc://{run_dir}/scheduler",
            detokenizer=f"ipc://{run_dir}/detokenizer",
            launcher=f"ipc://{run_dir}/launcher",
        )


def _socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, HWM)
    sock.bind(addr) if bind else sock.connect(addr)
    return sock


class PushQueue(Generic[T]):
    """Send side of one internal link."""

    def __init__(self, ctx: zmq.Context, addr: str, union: Any, bind: bool = False) -> None:
        self._sock = _socket(ctx, zmq.PUSH, addr, bind)
        self._codec: Codec[T] = Codec(union)

    def put(self, msg: T) -> None:
        self._sock.send(self._codec.encode(msg), copy=False)

    def close(self, linger_ms: int | None = None) -> None:
        self._sock.close(linger_ms)


class PullQueue(Generic[T]):
    """Receive side of one internal link; a malformed frame is logged and skipped, never raised."""

    def __init__(self, ctx: zmq.Context, addr: str, union: Any, bind: bool = True) -> None:
        self.socket = _socket(ctx, zmq.PULL, addr, bind)
        self._codec: Codec[T] = Codec(union)

    def get(self, timeout: float | None = None) -> T | None:
        """The next message, or None when nothing valid arrived within `timeout` seconds."""
        ms = None if timeout is None else int(timeout * 1000)
        if not self.socket.poll(ms):
            return None
        return self._decode(self.socket.recv(copy=False).buffer)

    def get_nowait(self) -> T | None:
        try:
            frame = self.socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self._decode(frame.buffer)

    def drain(self) -> list[T]:
        """Every message waiting now, without blocking."""
        out: list[T] = []
        while (msg := self.get_nowait()) is not None:
            out.append(msg)
        return out

    def _decode(self, frame: memoryview) -> T | None:
        try:
            return self._codec.decode(frame)
        except msgspec.MsgspecError as e:
            log.error("dropped a malformed internal frame (%d bytes): %s", len(frame), e)
            return None

    def close(self) -> None:
        self.socket.close()


class AsyncPullQueue(Generic[T]):
    """`PullQueue` for an asyncio process (the tokenizer)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, union: Any, bind: bool = True) -> None:
        self._sock = _socket(ctx, zmq.PULL, addr, bind)
        self._codec: Codec[T] = Codec(union)

    async def get(self) -> T | None:
        """The next message; None for a malformed frame (logged)."""
        # NOTE: pyzmq's stubs give zmq.asyncio's recv the blocking socket's return type.
        frame = await self._sock.recv(copy=False)  # type: ignore[misc]
        try:
            return self._codec.decode(frame.buffer)
        except msgspec.MsgspecError as e:
            log.error("dropped a malformed internal frame: %s", e)
            return None

    def close(self) -> None:
        self._sock.close()
