"""The front door: client ROUTER endpoint, admission, tokenization, and routing replies back.

Everything runs on one asyncio loop; long tokenizations go to a thread pool so one huge prompt
never delays other clients' chunks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest, Overloaded, ShuttingDown
from engine.ipc import HWM, LINGER_MS, AsyncPullQueue, Endpoints, PushQueue
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.messages.to_scheduler import Abort, StatsQuery, TokenizedRequest, ToScheduler
from engine.protocol import PROTOCOL_VERSION, Codec
from engine.wire_errors import to_failure
from tokenizer_proc import limits, prepare
from tokenizer_proc.requests import Entry, RequestTable
from tokenizer_proc.trim import Trimmer

log = logging.getLogger("tokenizer")

HEALTHY_WITHIN_S = 5.0  # the scheduler loop must have ticked this recently
HEALTH_GENERATE_TIMEOUT_S = 30.0
# NOTE: short inputs tokenize in tens of microseconds; a thread hop would cost more than it saves.
INLINE_CHARS = 2048
HEARTBEAT_IVL_MS = 1000
YIELD_EVERY_S = 0.005
_CLIENT_TYPES = {cls.__name__: cls for cls in tt.FromClient.__args__}


class Frontend:
    def __init__(
        self,
        config: EngineConfig,
        endpoints: Endpoints,
        tokenizer: Any,
        facts: dict[str, Any],
        request_shutdown: Callable[[str], None],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = int(facts["vocab_size"])
        self.max_context = int(facts["max_context"])
        self.model = str(facts.get("model", ""))
        self.request_shutdown = request_shutdown
        self.table = RequestTable()
        self.counters: Counter[str] = Counter()
        self.draining = False
        self.dead = False
        self.last_tick = time.monotonic()
        self.done = asyncio.Event()
        self._stats_calls: dict[str, bytes] = {}
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self._trimmer = Trimmer(self._pool)
        self._tasks: set[asyncio.Task[None]] = set()
        self._client_codec: Codec[tt.FromClient] = Codec(tt.FromClient)
        self._reply_codec: Codec[tc.ToClient] = Codec(tc.ToClient)
        self._open_sockets(endpoints)

    def _open_sockets(self, endpoints: Endpoints) -> None:
        self._actx = zmq.asyncio.Context()
        self.router = self._actx.socket(zmq.ROUTER)
        # NOTE: with ROUTER_MANDATORY a send to a client that went away fails instead of vanishing,
        # which is how a lost client's requests get aborted.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, HWM)
        # NOTE: frames beyond max_frame_bytes get a typed error; far beyond, libzmq drops the
        # connection from the declared size, before buffering gigabytes.
        self.router.setsockopt(zmq.MAXMSGSIZE, 4 * self.config.max_frame_bytes)
        # NOTE: ZMTP heartbeats, answered by the peer's libzmq thread: only a client that is
        # gone without closing (stopped, unplugged) misses them; its connection is dropped, the
        # next send to it fails, and its requests are aborted.
        timeout_ms = int(self.config.client_timeout * 1000)
        self.router.setsockopt(zmq.HEARTBEAT_IVL, min(HEARTBEAT_IVL_MS, max(1, timeout_ms // 2)))
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        self.router.setsockopt(zmq.LINGER, LINGER_MS)
        self.router.bind(endpoints.client)
        self.inbox: AsyncPullQueue[tt.FromEngine] = AsyncPullQueue(
            self._actx, endpoints.tokenizer, tt.FromEngine
        )
        self._sctx = zmq.Context()
        self.to_scheduler: PushQueue[ToScheduler] = PushQueue(
            self._sctx, endpoints.scheduler, ToScheduler
        )

    # --- lifecycle ------------------------------------------------------------------------------

    async def serve(self, orphaned: threading.Event) -> None:
        tasks = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._engine_loop()),
            asyncio.create_task(_wait_event(orphaned, self.done)),
        ]
        await self.done.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.router.close()
        self.inbox.close()
        self.to_scheduler.close()
        # NOTE: term() waits (up to the sockets' linger) until queued replies are on the wire;
        # pyzmq skips it at interpreter exit, so without it the last chunks of a graceful
        # shutdown could be lost with the process (seen under load: streams got EngineDead).
        self._actx.term()
        self._sctx.term()

    # --- client side ----------------------------------------------------------------------------

    async def _client_loop(self) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.time()
        while True:
            frames = await self.router.recv_multipart()
            try:
                await self._on_client_frame(frames[0], frames[-1])
            except Exception:  # NOTE: one bad client never takes the front door down
                log.exception("error handling a client message")
            # NOTE: awaiting a frame that is already there does not yield to the event loop, so
            # a flood of frames would keep the engine side from delivering chunks; give the
            # other tasks a turn every few milliseconds of back-to-back frames.
            if loop.time() - turn > YIELD_EVERY_S:
                await asyncio.sleep(0)
                turn = loop.time()

    async def _on_client_frame(self, client: bytes, frame: bytes) -> None:
        self._trimmer.saw(len(frame))
        try:
            limits.check_frame(len(frame), self.config)
            msg = self._client_codec.decode(frame)
        except (InvalidRequest, RecursionError) as e:
            self.counters["bad_frames"] += 1
            error = e if isinstance(e, InvalidRequest) else limits.nesting_error(self.config)
            await self._send(client, to_failure(limits.peek_rid(frame), error))
            return
        except msgspec.MsgspecError as e:
            self.counters["bad_frames"] += 1
            await self._send(client, _bad_frame_failure(frame, e))
            return
        await self._on_client(client, msg)

    async def _on_client(self, client: bytes, msg: tt.FromClient) -> None:
        if isinstance(msg, tt.Generate):
            await self._on_generate(client, msg)
        elif isinstance(msg, tt.Ping):
            await self._send(client, tc.Pong())
        elif isinstance(msg, tt.Goodbye):
            self._client_gone(client)
        elif isinstance(msg, tt.AbortRequest):
            self._abort(msg.target)
            await self._send(client, tc.Ack(msg.rid))
        else:
            await self._on_call(client, msg)

    async def _on_call(self, client: bytes, msg: tt.FromClient) -> None:
        if isinstance(msg, tt.Hello):
            await self._send(client, self._welcome(msg))
        elif isinstance(msg, tt.HealthCheck):
            await self._send(client, tc.HealthReply(msg.rid, *self._health()))
        elif isinstance(msg, tt.HealthGenerate):
            asyncio.create_task(self._reply_health_generate(client, msg.rid))
        elif isinstance(msg, tt.GetStats):
            self._stats_calls[msg.rid] = client
            self.to_scheduler.put(StatsQuery(msg.rid))
        elif isinstance(msg, tt.ShutdownEngine):
            self._begin_shutdown("shutdown() from a client")
            await self._send(client, tc.Ack(msg.rid))

    def _welcome(self, msg: tt.Hello) -> tc.Welcome | tc.Failure:
        if msg.version == PROTOCOL_VERSION:
            return tc.Welcome(msg.rid, PROTOCOL_VERSION, self.model, self.max_context)
        text = f"client speaks protocol v{msg.version}, this engine v{PROTOCOL_VERSION}"
        return tc.Failure(msg.rid, "protocol", text + "; use a matching mlx-engine client")

    def _health(self) -> tuple[bool, str]:
        if self.dead or self.draining:
            return False, "engine dead" if self.dead else "shutting down"
        age = time.monotonic() - self.last_tick
        if age > HEALTHY_WITHIN_S:
            return False, f"scheduler loop silent for {age:.1f}s"
        return True, ""

    def _begin_shutdown(self, reason: str) -> None:
        if not self.draining:
            self.draining = True
            self.request_shutdown(reason)

    # --- admission ------------------------------------------------------------------------------

    async def _on_generate(self, client: bytes, msg: tt.Generate) -> None:
        try:
            await self._admit(msg, Entry(client))
        except EngineError as e:
            self.counters["requests_rejected"] += 1
            await self._send(client, to_failure(msg.rid, e))

    async def _admit(self, msg: tt.Generate, entry: Entry) -> None:
        """The one path of every request, health generations included (same counters)."""
        self.counters["requests_received"] += 1
        self._check_admission(msg.rid)
        chars = limits.check_generate(msg, self.config, self.max_context)
        if entry.client is not None:
            limits.check_share(self.table.count(entry.client), self.config)
        params = prepare.sampling_params(msg.params, self.vocab_size)
        limits.check_stop(params, self.config)
        self.table.add(msg.rid, entry)
        args = (msg, self.tokenizer, self.vocab_size, self.max_context)
        if _needs_pool(msg, chars):
            # NOTE: a task, not awaited: the client loop goes on reading every other client's
            # frames while the pool works (awaiting it here stalled all clients, ~0.7 s per
            # 1M-character prompt).
            task = asyncio.create_task(self._admit_pooled(msg, entry, params, args, chars))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        try:
            ids = prepare.token_ids(*args)
        except Exception as e:
            self.table.pop(msg.rid)
            raise _typed(msg.rid, e) from e
        self._forward(msg.rid, entry, ids, params)

    async def _admit_pooled(
        self, msg: tt.Generate, entry: Entry, params: Any, args: tuple, chars: int
    ) -> None:
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, prepare.token_ids, *args
            )
        except Exception as e:
            if self.table.pop(msg.rid) is entry:
                self.counters["requests_rejected"] += 1
                await self._deliver(to_failure(msg.rid, _typed(msg.rid, e)), entry)
            return
        finally:
            self._trimmer.saw(4 * chars)  # NOTE: up to 4 bytes per character
        if self.table.get(msg.rid) is entry:  # NOTE: else it was ended meanwhile (shutdown)
            self._forward(msg.rid, entry, ids, params)

    def _check_admission(self, rid: str) -> None:
        if self.dead:
            raise EngineDead("an engine process died")
        if self.draining:
            raise ShuttingDown("the engine is shutting down")
        if not isinstance(rid, str) or not rid or rid in self.table:
            raise InvalidRequest("rid", f"must be a unique non-empty id, got {rid!r}")
        if len(self.table) >= self.config.max_running_requests + self.config.max_queued_requests:
            raise Overloaded(f"{len(self.table)} requests in flight; retry later")

    def _forward(self, rid: str, entry: Entry, ids: list[int], params: Any) -> None:
        if entry.aborted:
            self.table.pop(rid)
            self._deliver_later(tc.Chunk(rid, finish_reason="abort"), entry)
            return
        self.to_scheduler.put(TokenizedRequest(rid, ids, params))
        entry.sent = True
        log.debug("rid=%s admitted: %d prompt tokens", rid, len(ids))

    def _deliver_later(self, chunk: tc.Chunk, entry: Entry) -> None:
        asyncio.create_task(self._deliver(chunk, entry))

    # --- aborts and lost clients ----------------------------------------------------------------

    def _abort(self, rid: str) -> None:
        entry = self.table.get(rid)
        if entry is None:
            return
        if entry.sent:
            self.to_scheduler.put(Abort(rid))
        entry.aborted = True

    def _client_gone(self, client: bytes) -> None:
        rids = self.table.of_client(client)
        if rids:
            log.info("client gone; aborting %d request(s): %s", len(rids), rids[:4])
        for rid in rids:
            self.table.get(rid).gone = True  # type: ignore[union-attr]
            self._abort(rid)

    # --- engine side ----------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                await self._on_engine(msg)
            except Exception:
                log.exception("error handling an engine message")

    async def _on_engine(self, msg: tt.FromEngine | None) -> None:
        if isinstance(msg, tt.Chunks):
            for chunk in msg.chunks:
                await self._route(chunk)
        elif isinstance(msg, tt.Heartbeat):
            self.last_tick = time.monotonic()
        elif isinstance(msg, tt.RequestFailed):
            await self._on_failed(msg)
        elif isinstance(msg, tt.SchedulerStats):
            await self._on_stats(msg)
        elif isinstance(msg, tt.Control):
            await self._on_control(msg)
        elif isinstance(msg, tt.PipelineDrained):
            await self._end_all("abort")
            self.done.set()

    async def _route(self, chunk: tc.Chunk) -> None:
        entry = self.table.get(chunk.rid)
        if entry is None:
            return
        if entry.first_token_at is None and chunk.token_ids:
            entry.first_token_at = time.monotonic()
        if chunk.finish_reason is not None:
            self.table.pop(chunk.rid)
            self.counters["requests_answered"] += 1
            self.counters[f"finish_{chunk.finish_reason}"] += 1
            _log_finished(chunk, entry)
        await self._deliver(chunk, entry)

    async def _deliver(self, msg: tc.Chunk | tc.Failure, entry: Entry) -> None:
        if entry.client is None:
            entry.chunks.put_nowait(msg)  # type: ignore[union-attr]
        elif not entry.gone and not await self._send(entry.client, msg):
            self._client_gone(entry.client)

    async def _on_failed(self, msg: tt.RequestFailed) -> None:
        entry = self.table.pop(msg.rid)
        if entry is not None:
            self.counters["requests_rejected"] += 1
            await self._deliver(tc.Failure(msg.rid, msg.kind, msg.message, msg.field), entry)

    async def _on_stats(self, msg: tt.SchedulerStats) -> None:
        client = self._stats_calls.pop(msg.rid, None)
        if client is not None:
            stats = {**msg.stats, **{k: float(v) for k, v in self.counters.items()}}
            stats["requests_in_flight"] = float(len(self.table))
            await self._send(client, tc.StatsReply(msg.rid, stats))

    async def _on_control(self, msg: tt.Control) -> None:
        log.info("control from the launcher: %s %s", msg.action, msg.reason)
        if msg.action == "drain":
            self.draining = True
        elif msg.action == "fail":
            self.dead = True
            await self._end_all("engine_dead", msg.reason)
            self.done.set()  # NOTE: the launcher stops the engine; the ROUTER's linger flushes

    async def _end_all(self, kind: str, reason: str = "") -> None:
        """Give every request still in the table its terminal message."""
        for rid in self.table.rids():
            entry = self.table.pop(rid)
            if kind == "abort":
                final: tc.Chunk | tc.Failure = tc.Chunk(rid, finish_reason="abort")
            else:
                final = tc.Failure(rid, kind, f"an engine process died: {reason}")
            await self._deliver(final, entry)  # type: ignore[arg-type]

    # --- health generation ----------------------------------------------------------------------

    async def _reply_health_generate(self, client: bytes, rid: str) -> None:
        healthy, detail = await self._health_generate()
        await self._send(client, tc.HealthReply(rid, healthy, detail))

    async def _health_generate(self) -> tuple[bool, str]:
        rid = f"health-{uuid.uuid4().hex}"
        entry = Entry(None, chunks=asyncio.Queue())
        msg = tt.Generate(rid, input_ids=[0], params={"max_tokens": 1, "temperature": 0.0})
        try:
            await self._admit(msg, entry)
            return await asyncio.wait_for(_until_final(entry), HEALTH_GENERATE_TIMEOUT_S)
        except EngineError as e:
            return False, str(e)
        except asyncio.TimeoutError:
            self._abort(rid)
            return False, f"no token within {HEALTH_GENERATE_TIMEOUT_S}s"

    # --- sending --------------------------------------------------------------------------------

    async def _send(self, client: bytes, msg: tc.ToClient) -> bool:
        """Send to one client; False when it is gone (or so slow its queue is full)."""
        try:
            await self.router.send_multipart([client, self._reply_codec.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False


def _log_finished(chunk: tc.Chunk, entry: Entry) -> None:
    now = time.monotonic()
    first = entry.first_token_at or now
    log.info(
        "rid=%s finish=%s prompt=%d completion=%d ttft=%.1fms total=%.1fms",
        chunk.rid,
        chunk.finish_reason,
        chunk.prompt_tokens,
        chunk.completion_tokens,
        (first - entry.admitted_at) * 1e3,
        (now - entry.admitted_at) * 1e3,
    )


async def _until_final(entry: Entry) -> tuple[bool, str]:
    tokens = 0
    while True:
        msg = await entry.chunks.get()  # type: ignore[union-attr]
        if isinstance(msg, tc.Failure):
            return False, f"{msg.kind}: {msg.message}"
        tokens += len(msg.token_ids)
        if msg.finish_reason is not None:
            ok = msg.finish_reason in ("stop", "length") and tokens > 0
            return ok, "" if ok else f"finish_reason={msg.finish_reason}, {tokens} tokens"


async def _wait_event(event: threading.Event, done: asyncio.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.2)
    done.set()


def _needs_pool(msg: tt.Generate, chars: int) -> bool:
    # NOTE: every string counts (a huge value outside `content` templates as slowly), and each
    # message costs the template a loop turn.
    work = chars + 64 * len(msg.messages or ())
    return msg.input_ids is None and work >= INLINE_CHARS


def _typed(rid: str, error: Exception) -> EngineError:
    if isinstance(error, EngineError):
        return error
    # NOTE: as in the scheduler: an unexpected failure fails this request alone, typed.
    log.error("rid=%s tokenization failed", rid, exc_info=error)
    return EngineError(f"{type(error).__name__}: {error}")


def _bad_frame_failure(frame: bytes, error: Exception) -> tc.Failure:
    """A typed error for a frame that is not a valid client message, naming what is wrong."""
    raw: Any = None
    try:
        raw = msgspec.msgpack.decode(frame)
    except RecursionError:  # NOTE: too deep to decode without a type to stop it early
        return tc.Failure(limits.peek_rid(frame), "invalid_request", str(error), "frame")
    except msgspec.MsgspecError:
        return tc.Failure("", "invalid_request", f"not a msgpack frame: {error}", "frame")
    rid = raw[1] if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str) else ""
    cls = (
        _CLIENT_TYPES.get(raw[0])
        if isinstance(raw, list) and raw and isinstance(raw[0], str)
        else None
    )
    fields = cls.__struct_fields__ if cls is not None else ()
    return tc.Failure(
        rid, "invalid_request", str(error), prepare.error_field(str(error), "frame", fields)
    )
