"""The Python SDK (DESIGN.md §3): `EngineClient` and `AsyncEngineClient`.

Both talk to an engine through a transport: the ZeroMQ `Transport` to a launched engine, or the
`InProcessTransport` (engine.inprocess) for tests and benchmarks; the methods are the same.
Every error is a typed exception from engine.errors; a dead engine raises `EngineDead`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from engine.errors import EngineDead, Timeout
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from engine.results import GenerateResult, StreamChunk
from engine.transport import Sink, Transport
from engine.wire_errors import to_exception

DEFAULT_ADDRESS = "tcp://127.0.0.1:30001"
HEALTH_GENERATE_TIMEOUT_S = 40.0
API_KEY_ENV = "MLX_ENGINE_API_KEY"


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


def _generate_msg(
    prompt: str | None,
    messages: list[dict[str, Any]] | None,
    input_ids: list[int] | None,
    rid: str | None,
    sampling: dict[str, Any],
) -> tt.Generate:
    return tt.Generate(_rid(rid), prompt, messages, input_ids, sampling)


def _unwrap(msg: tc.ToClient) -> tc.ToClient:
    if isinstance(msg, tc.Failure):
        raise to_exception(msg)
    return msg


def _chunk(msg: tc.ToClient) -> StreamChunk:
    return StreamChunk.from_wire(_unwrap(msg))  # type: ignore[arg-type]


def _abort_quietly(transport: TransportLike, rid: str) -> None:
    try:
        transport.send(tt.AbortRequest(_rid(), rid))
    except EngineDead:
        pass


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class EngineClient:
    """Blocking client; safe to share between threads (each call has its own reply queue)."""

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
        self.timeout = timeout
        self._key = _api_key(api_key)
        self._t = transport or Transport(address, dead_after)
        try:
            self.info = self._call(tt.Hello(_rid(), PROTOCOL_VERSION, self._key), connect_timeout)
        except Timeout:
            self._t.close()
            raise EngineDead(f"no engine answers at {address}") from None
        except BaseException:
            self._t.close()
            raise

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        msg = _generate_msg(prompt, messages, input_ids, rid, sampling)
        result = GenerateResult(msg.rid)
        for chunk in self._stream(msg, _deadline(timeout)):
            result.add(chunk)
        return result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[StreamChunk]:
        msg = _generate_msg(prompt, messages, input_ids, rid, sampling)
        return self._stream(msg, _deadline(timeout))

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
            self._t.unregister(msg.rid)
            if not finished:  # NOTE: a caller that stops reading frees the engine's work too
                _abort_quietly(self._t, msg.rid)

    def abort(self, rid: str) -> None:
        self._call(tt.AbortRequest(_rid(), rid))

    def health(self) -> bool:
        """True when every process is alive and the scheduler loop ticked recently."""
        try:
            return self._call(tt.HealthCheck(_rid())).healthy  # type: ignore[union-attr]
        except (EngineDead, Timeout):
            return False

    def health_generate(self) -> bool:
        """True when a real one-token generation went through all three processes."""
        try:
            reply = self._call(tt.HealthGenerate(_rid()), HEALTH_GENERATE_TIMEOUT_S)
            return reply.healthy  # type: ignore[union-attr]
        except (EngineDead, Timeout):
            return False

    def stats(self) -> dict[str, float]:
        return self._call(tt.GetStats(_rid(), self._key)).stats  # type: ignore[union-attr]

    def shutdown(self) -> None:
        """Ask the engine to shut down gracefully (as SIGTERM does)."""
        self._call(tt.ShutdownEngine(_rid(), self._key))

    def close(self) -> None:
        self._t.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------------

    def _call(self, msg: Any, timeout: float | None = None) -> tc.ToClient:
        replies: queue.SimpleQueue[tc.ToClient] = queue.SimpleQueue()
        self._t.register(msg.rid, replies.put)
        try:
            self._t.send(msg)
            return _unwrap(self._get(replies, _deadline(timeout or self.timeout)))
        finally:
            self._t.unregister(msg.rid)

    def _get(self, replies: queue.SimpleQueue[tc.ToClient], deadline: float | None) -> tc.ToClient:
        try:
            return replies.get(timeout=_remaining(deadline))
        except queue.Empty:
            raise Timeout("no answer from the engine within the deadline") from None


class AsyncEngineClient:
    """The same calls as coroutines and async iterators, for asyncio programs."""

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
        self.timeout = timeout
        self._key = _api_key(api_key)
        self.connect_timeout = connect_timeout
        self.address = address
        self._t = transport or Transport(address, dead_after)
        self.info: tc.Welcome | None = None

    async def connect(self) -> AsyncEngineClient:
        """Check the protocol version (done by the first call when not called explicitly)."""
        if self.info is None:
            try:
                self.info = await self._call(  # type: ignore[assignment]
                    tt.Hello(_rid(), PROTOCOL_VERSION, self._key), self.connect_timeout, hello=False
                )
            except Timeout:
                raise EngineDead(f"no engine answers at {self.address}") from None
        return self

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> GenerateResult:
        msg = _generate_msg(prompt, messages, input_ids, rid, sampling)
        result = GenerateResult(msg.rid)
        async for chunk in self._stream(msg, _deadline(timeout)):
            result.add(chunk)
        return result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        rid: str | None = None,
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[StreamChunk]:
        msg = _generate_msg(prompt, messages, input_ids, rid, sampling)
        return self._stream(msg, _deadline(timeout))

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
            self._t.unregister(msg.rid)
            if not finished:  # NOTE: a caller that stops reading frees the engine's work too
                _abort_quietly(self._t, msg.rid)

    async def abort(self, rid: str) -> None:
        await self._call(tt.AbortRequest(_rid(), rid))

    async def health(self) -> bool:
        try:
            return (await self._call(tt.HealthCheck(_rid()))).healthy  # type: ignore[union-attr]
        except (EngineDead, Timeout):
            return False

    async def health_generate(self) -> bool:
        try:
            reply = await self._call(tt.HealthGenerate(_rid()), HEALTH_GENERATE_TIMEOUT_S)
            return reply.healthy  # type: ignore[union-attr]
        except (EngineDead, Timeout):
            return False

    async def stats(self) -> dict[str, float]:
        return (await self._call(tt.GetStats(_rid(), self._key))).stats  # type: ignore[union-attr]

    async def shutdown(self) -> None:
        await self._call(tt.ShutdownEngine(_rid(), self._key))

    async def close(self) -> None:
        self._t.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- plumbing -------------------------------------------------------------------------------

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
        self, msg: Any, timeout: float | None = None, hello: bool = True
    ) -> tc.ToClient:
        if hello:
            await self.connect()
        replies = self._register(msg.rid)
        try:
            self._t.send(msg)
            return _unwrap(await self._get(replies, _deadline(timeout or self.timeout)))
        finally:
            self._t.unregister(msg.rid)

    async def _get(
        self, replies: asyncio.Queue[tc.ToClient], deadline: float | None
    ) -> tc.ToClient:
        try:
            return await asyncio.wait_for(replies.get(), _remaining(deadline))
        except asyncio.TimeoutError:
            raise Timeout("no answer from the engine within the deadline") from None
