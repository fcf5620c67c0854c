"""The Python SDK: `EngineClient` and `AsyncEngineClient`.

Both talk to an engine through a transport: the ZeroMQ `Transport` to a launched engine, or an
`InProcessEngine` (mlx_engine.inprocess: its own transport) for tests and benchmarks; same methods.
Every error is a typed exception from engine.errors; a dead engine raises `EngineDead`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from engine import control_token
from engine.client_operations import Operations, wait_for
from engine.errors import EngineDead, EngineError, Timeout
from engine.generate_options import GenerateOptions, generate_message
from engine.messages import admin as ops
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from engine.results import GenerateResult, StreamChunk
from engine.transport import Sink, Transport
from engine.wire_errors import to_exception

if TYPE_CHECKING:
    from typing_extensions import Unpack  # NOTE: typing's own from Python 3.11; only for checking

DEFAULT_ADDRESS = "tcp://127.0.0.1:30001"
HEALTH_GENERATE_WAIT_S = tt.HEALTH_GENERATE_TIMEOUT_S + tt.REPLY_SLACK_S
API_KEY_ENV = "MLX_ENGINE_API_KEY"
R = TypeVar("R", bound=tc.ToClient)
S = TypeVar("S", Iterator[StreamChunk], AsyncIterator[StreamChunk])
# NOTE: every client call but Ping / Goodbye (the transport's own) carries a rid to answer to.
Call = (
    tt.Hello
    | tt.Generate
    | tt.AbortRequest
    | tt.HealthCheck
    | tt.HealthGenerate
    | tt.GetStats
    | tt.ShutdownEngine
    | ops.AdminRequest
)


class TransportLike(Protocol):
    def register(self, rid: str, sink: Sink) -> None: ...
    def unregister(self, rid: str) -> None: ...
    def send(self, msg: tt.FromClient) -> None: ...
    def close(self) -> None: ...


def _api_key(key: str | None) -> str | None:
    """The engine's API key: the argument, else $MLX_ENGINE_API_KEY, else none."""
    return key or os.environ.get(API_KEY_ENV) or None


def _rid(rid: str | None = None) -> str:
    return rid or uuid.uuid4().hex


def _request(prompt: str | None, options: GenerateOptions) -> tuple[tt.Generate, float | None]:
    return generate_message(prompt, options, _rid()), _deadline(options.get("timeout"))


def _expect(msg: tc.ToClient, reply: type[R]) -> R:
    """The reply a call expects; a `Failure` raises its typed exception."""
    if isinstance(msg, tc.Failure):
        raise to_exception(msg)
    if not isinstance(msg, reply):
        raise EngineError(f"the engine answered {type(msg).__name__}, not {reply.__name__}")
    return msg


def _chunk(msg: tc.ToClient) -> StreamChunk:
    return StreamChunk.from_wire(_expect(msg, tc.Chunk))


def _abort_quietly(transport: TransportLike, rid: str) -> None:
    try:
        transport.send(tt.AbortRequest(_rid(), rid))
    except EngineDead:
        pass


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class _Client(Generic[S]):
    """What both clients share: settings, the transport, every call's message and reply, and
    `stream` (S: its iterator, blocking or async)."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        dead_after: float = 5.0,
        transport: TransportLike | None = None,
        api_key: str | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._key = _api_key(api_key)
        self._t = transport or Transport(address, dead_after)
        self._started()

    def _started(self) -> None:
        """Called at the end of __init__ (the blocking client says hello there)."""

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> S:
        """The request's chunks as they come (`options`: `GenerateOptions`); a caller that stops
        reading aborts the request."""
        return self._stream(*_request(prompt, options))

    def _stream(self, msg: tt.Generate, deadline: float | None) -> S:
        raise NotImplementedError

    def _ended(self, rid: str, finished: bool) -> None:
        """A stream is closed: its replies go nowhere now, and a caller that stopped reading
        before the last chunk frees the engine's work too."""
        self._t.unregister(rid)
        if not finished:
            _abort_quietly(self._t, rid)

    def _hello(self) -> tt.Hello:
        return tt.Hello(_rid(), PROTOCOL_VERSION, self._key)

    def _stats(self) -> tt.GetStats:
        return tt.GetStats(_rid(), self._control_key())

    def _shutdown(self) -> tt.ShutdownEngine:
        return tt.ShutdownEngine(_rid(), self._control_key())

    def _admin(self, op: ops.AdminOp) -> ops.AdminRequest:
        return ops.AdminRequest(_rid(), op, self._control_key())

    def _control_key(self) -> str | None:
        """The owner's token for this address when this user has one (engine/control_token.py),
        else the API key: an engine with client keys (--api-keys-file) and no --api-key takes
        only its owner's token, whatever key the client connected with."""
        return control_token.for_address(self.address) or self._key

    def _no_engine(self) -> EngineDead:
        return EngineDead(f"no engine answers at {self.address}")


class EngineClient(_Client[Iterator[StreamChunk]], Operations[dict[str, Any]]):
    """Blocking client; safe to share between threads (each call has its own reply queue)."""

    def _started(self) -> None:
        try:
            self.info = self._call(self._hello(), tc.Welcome, self.connect_timeout)
        except Timeout:
            self._t.close()
            raise self._no_engine() from None
        except BaseException:
            self._t.close()
            raise

    def generate(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        """One request to completion; `options` are `GenerateOptions` (engine/generate_options.py)."""
        msg, deadline = _request(prompt, options)
        result = GenerateResult(msg.rid)
        for chunk in self._stream(msg, deadline):
            result.add(chunk)
        return result

    def _stream(self, msg: tt.Generate, deadline: float | None) -> Iterator[StreamChunk]:
        replies: queue.SimpleQueue[tc.ToClient] = queue.SimpleQueue()
        self._t.register(msg.rid, replies.put)
        finished = False
        try:
            self._t.send(msg)
            while not finished:
                chunk = _chunk(self._get(replies, deadline))
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._ended(msg.rid, finished)

    def abort(self, rid: str) -> None:
        self._call(tt.AbortRequest(_rid(), rid), tc.Ack)

    def health(self) -> bool:
        """True when every process is alive and the scheduler loop ticked recently."""
        return self._healthy(tt.HealthCheck(_rid()), None)

    def health_generate(self) -> bool:
        """True when a real one-token generation went through all three processes."""
        return self._healthy(tt.HealthGenerate(_rid()), HEALTH_GENERATE_WAIT_S)

    def stats(self) -> dict[str, float]:
        return self._call(self._stats(), tc.StatsReply).stats

    def shutdown(self) -> None:
        """Ask the engine to shut down gracefully (as SIGTERM does)."""
        self._call(self._shutdown(), tc.Ack)

    def _operate(self, op: ops.AdminOp, timeout: float | None) -> dict[str, Any]:
        return dict(self._call(self._admin(op), tc.AdminReply, wait_for(timeout)).info)

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------------

    def _healthy(self, msg: tt.HealthCheck | tt.HealthGenerate, timeout: float | None) -> bool:
        try:
            return self._call(msg, tc.HealthReply, timeout).healthy
        except (EngineDead, Timeout):
            return False

    def _call(self, msg: Call, reply: type[R], timeout: float | None = None) -> R:
        replies: queue.SimpleQueue[tc.ToClient] = queue.SimpleQueue()
        self._t.register(msg.rid, replies.put)
        try:
            self._t.send(msg)
            return _expect(self._get(replies, _deadline(timeout or self.timeout)), reply)
        finally:
            self._t.unregister(msg.rid)

    def _get(self, replies: queue.SimpleQueue[tc.ToClient], deadline: float | None) -> tc.ToClient:
        try:
            return replies.get(timeout=_remaining(deadline))
        except queue.Empty:
            raise Timeout("no answer from the engine within the deadline") from None


class AsyncEngineClient(_Client[AsyncIterator[StreamChunk]], Operations[Awaitable[dict[str, Any]]]):
    """The same calls as coroutines and async iterators, for asyncio programs."""

    info: tc.Welcome | None = None

    async def connect(self) -> AsyncEngineClient:
        """Check the protocol version (done by the first call when not called explicitly)."""
        if self.info is None:
            try:
                self.info = await self._call(
                    self._hello(), tc.Welcome, self.connect_timeout, hello=False
                )
            except Timeout:
                raise self._no_engine() from None
        return self

    async def generate(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerateResult:
        msg, deadline = _request(prompt, options)
        result = GenerateResult(msg.rid)
        async for chunk in self._stream(msg, deadline):
            result.add(chunk)
        return result

    async def _stream(self, msg: tt.Generate, deadline: float | None) -> AsyncIterator[StreamChunk]:
        await self.connect()
        replies = self._register(msg.rid)
        finished = False
        try:
            self._t.send(msg)
            while not finished:
                chunk = _chunk(await self._get(replies, deadline))
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._ended(msg.rid, finished)

    async def abort(self, rid: str) -> None:
        await self._call(tt.AbortRequest(_rid(), rid), tc.Ack)

    async def health(self) -> bool:
        return await self._healthy(tt.HealthCheck(_rid()), None)

    async def health_generate(self) -> bool:
        return await self._healthy(tt.HealthGenerate(_rid()), HEALTH_GENERATE_WAIT_S)

    async def stats(self) -> dict[str, float]:
        return (await self._call(self._stats(), tc.StatsReply)).stats

    async def shutdown(self) -> None:
        await self._call(self._shutdown(), tc.Ack)

    async def _operate_async(self, op: ops.AdminOp, timeout: float | None) -> dict[str, Any]:
        return dict((await self._call(self._admin(op), tc.AdminReply, wait_for(timeout))).info)

    def _operate(self, op: ops.AdminOp, timeout: float | None) -> Awaitable[dict[str, Any]]:
        return self._operate_async(op, timeout)

    async def close(self) -> None:
        self._t.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- plumbing -------------------------------------------------------------------------------

    async def _healthy(
        self, msg: tt.HealthCheck | tt.HealthGenerate, timeout: float | None
    ) -> bool:
        try:
            return (await self._call(msg, tc.HealthReply, timeout)).healthy
        except (EngineDead, Timeout):
            return False

    def _register(self, rid: str) -> asyncio.Queue[tc.ToClient]:
        loop = asyncio.get_running_loop()
        replies: asyncio.Queue[tc.ToClient] = asyncio.Queue()

        def sink(msg: tc.ToClient) -> None:
            # NOTE: called on the transport's I/O thread; hand over to the caller's loop.
            try:
                loop.call_soon_threadsafe(replies.put_nowait, msg)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody waits for this reply

        self._t.register(rid, sink)
        return replies

    async def _call(
        self, msg: Call, reply: type[R], timeout: float | None = None, hello: bool = True
    ) -> R:
        if hello:
            await self.connect()
        replies = self._register(msg.rid)
        try:
            self._t.send(msg)
            return _expect(await self._get(replies, _deadline(timeout or self.timeout)), reply)
        finally:
            self._t.unregister(msg.rid)

    async def _get(
        self, replies: asyncio.Queue[tc.ToClient], deadline: float | None
    ) -> tc.ToClient:
        try:
            return await asyncio.wait_for(replies.get(), _remaining(deadline))
        except asyncio.TimeoutError:
            raise Timeout("no answer from the engine within the deadline") from None
