"""The front door: the client ROUTER endpoint, tokenization, and routing replies back, around the
I/O-free core (tokenizer_proc.core); the HTTP API (tokenizer_proc.http_api) runs beside it.

Everything runs on one asyncio loop; long tokenizations go to a thread pool so one huge prompt
never delays other clients' chunks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine import control_token
from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest, ShuttingDown
from engine.ipc import HWM, LINGER_MS, AsyncPullQueue, Endpoints, PushQueue
from engine.messages import admin as ops
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.messages.to_launcher import SchedulerFacts
from engine.messages.to_scheduler import Abort, StatsQuery, TokenizedRequest, ToScheduler
from engine.protocol import Codec, error_field
from engine.wire_errors import to_failure
from tokenizer_proc import limits, prepare, reasoning
from tokenizer_proc.admission import INLINE_CHARS, Admission, Admitted, slow_text
from tokenizer_proc.core import FrontDoor, HealthProbe, door_settings, paused_detail, unauthorized
from tokenizer_proc.farewell import Farewell
from tokenizer_proc.operations import Operations
from tokenizer_proc.requests import Entry
from tokenizer_proc.trim import Trimmer

log = logging.getLogger("tokenizer")

STATS_TIMEOUT_S = 5.0
HEARTBEAT_IVL_MS = 1000
YIELD_EVERY_S = 0.005
_CLIENT_TYPES = {cls.__name__: cls for cls in tt.FromClient.__args__}


class TokenizerServer:
    def __init__(
        self,
        config: EngineConfig,
        endpoints: Endpoints,
        tokenizer: Any,
        facts: SchedulerFacts,
        request_shutdown: Callable[[str], None],
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        slots = facts.running_slots or config.max_running_requests
        self.core = FrontDoor(
            door_settings(
                config,
                (facts.model, facts.vocab_size, facts.max_context, slots),
                control_token=os.environ.get(control_token.ENV),
                snapshot_hits=facts.snapshot_hits,
            )
        )
        self.table = self.core.table
        self.request_shutdown = request_shutdown
        self.done = asyncio.Event()
        self._stats_calls: dict[str, asyncio.Future[dict[str, float]]] = {}
        # NOTE: ZMQ identity -> its client (tokenizer_proc/core.py `client_of`), for those
        # whose Hello carried the key
        self._welcomed: dict[bytes, str] = {}
        self._farewell = Farewell()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="tokenize")
        self._trimmer = Trimmer(self._pool)
        self._tasks: set[asyncio.Task[None]] = set()
        self._client_codec: Codec[tt.FromClient] = Codec(tt.FromClient)
        self._reply_codec: Codec[tc.ToClient] = Codec(tc.ToClient)
        self._open_sockets(endpoints)
        self.admission = Admission(self.core, config, tokenizer)
        # NOTE: the model's think markers, when its thought is kept apart (`--reasoning-parser`)
        self.markers = self.admission.markers
        self.operations = Operations(self.core, self.to_scheduler.put)

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

    async def serve(
        self, orphaned: threading.Event, extra: Sequence[Coroutine[Any, Any, None]] = ()
    ) -> None:
        """Serve until the pipeline drained or the engine failed; `extra` are coroutines that
        run beside the ZMQ endpoint (the HTTP server) and are cancelled with it."""
        tasks = [
            asyncio.create_task(self._client_loop()),
            asyncio.create_task(self._engine_loop()),
            asyncio.create_task(_wait_event(orphaned, self.done)),
            *(asyncio.create_task(c) for c in extra),
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

    # --- the API every endpoint uses ------------------------------------------------------------

    async def submit(self, msg: tt.Generate, owner: Hashable, client: str) -> Entry:
        """Admit, tokenize and forward one request of `client` (the unit of fair admission)
        whose replies go to the returned entry's queue (HTTP); raises the typed error that
        refused it."""
        entry = Entry(owner, reply_queue=asyncio.Queue(), client=client)
        await self._admit(msg, entry)
        return entry

    async def tokenize(self, msg: tt.Generate, generation_prompt: bool = True) -> list[int]:
        """The prompt tokens `msg` would take (chat template applied), however long: the same
        limits on its size as a request's, the tokenizer pool for long ones."""
        chars = limits.check_generate(msg, self.config, self.core.settings.max_context)
        args = (msg, self.tokenizer, self.core.settings.vocab_size, sys.maxsize, generation_prompt)
        if not slow_text(msg, chars):
            return prepare.token_ids(*args)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, prepare.token_ids, *args)

    async def detokenize(self, ids: list[int]) -> str:
        """Token ids as text (the tokenizer pool for long lists)."""
        if len(ids) < INLINE_CHARS // 4:
            return str(self.tokenizer.decode(ids))
        loop = asyncio.get_running_loop()
        return str(await loop.run_in_executor(self._pool, self.tokenizer.decode, ids))

    def abort(self, rid: str, owner: Hashable | None) -> None:
        if self.core.abort(rid, owner):
            self.to_scheduler.put(Abort(rid))

    async def health_generate(self) -> tuple[bool, str]:
        if self.core.paused is not None:  # NOTE: no generation runs until the operator says so
            return False, paused_detail(self.core.paused)
        probe = HealthProbe()
        entry = Entry(None, reply_queue=asyncio.Queue())
        try:
            await self._admit(probe.request(), entry)
        except EngineError as e:
            return False, str(e)
        while True:
            remaining = probe.deadline - time.monotonic()
            try:
                msg = await asyncio.wait_for(entry.replies().get(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                self.abort(probe.rid, None)
                return probe.expired() or (False, "health generation timed out")
            verdict = probe.feed(msg)
            if verdict is not None:
                return verdict

    async def stats(self) -> dict[str, float]:
        """The engine's stats: the scheduler's (a round trip) and the front door's own."""
        rid = f"stats-{uuid.uuid4().hex}"
        future: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._stats_calls[rid] = future
        self.to_scheduler.put(StatsQuery(rid))
        try:
            scheduler = await asyncio.wait_for(future, STATS_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("no stats from the scheduler within %.1fs", STATS_TIMEOUT_S)
            scheduler = {}
        finally:
            self._stats_calls.pop(rid, None)
        return self.core.stats(scheduler)

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
            self.core.counters["bad_frames"] += 1
            error = e if isinstance(e, InvalidRequest) else limits.nesting_error(self.config)
            await self._send(client, to_failure(limits.peek_rid(frame), error))
            return
        except msgspec.MsgspecError as e:
            self.core.counters["bad_frames"] += 1
            await self._send(client, _bad_frame_failure(frame, e))
            return
        if not self.core.allows(msg, client in self._welcomed):
            if not isinstance(msg, tt.Goodbye):
                await self._send(client, unauthorized(msg, bool(self.config.api_key)))
            return
        await self._on_client(client, msg)

    async def _on_client(self, client: bytes, msg: tt.FromClient) -> None:
        if isinstance(msg, tt.Generate):
            await self._on_generate(client, msg)
        elif isinstance(msg, tt.Ping):
            await self._send(client, tc.Pong())
        elif isinstance(msg, tt.Goodbye):
            self._client_gone(client)
            self._welcomed.pop(client, None)
            self._farewell.read(client)  # NOTE: a client that leaves waits for nothing more
        elif isinstance(msg, tt.ClosingAck):
            self._farewell.read(client)
        elif isinstance(msg, tt.AbortRequest):
            await self._on_abort(client, msg)
        else:
            await self._on_call(client, msg)

    async def _on_abort(self, client: bytes, msg: tt.AbortRequest) -> None:
        try:
            self.abort(msg.target, client)
        except EngineError as e:
            await self._send(client, to_failure(msg.rid, e))
            return
        await self._send(client, tc.Ack(msg.rid))

    async def _on_call(self, client: bytes, msg: tt.FromClient) -> None:
        if isinstance(msg, tt.Hello):
            reply = self.core.welcome(msg)
            if isinstance(reply, tc.Welcome):
                self._welcomed[client] = self.core.client_of(msg.api_key, _sdk_client(client))
            await self._send(client, reply)
        elif isinstance(msg, tt.HealthCheck):
            await self._send(client, tc.HealthReply(msg.rid, *self.core.health()))
        elif isinstance(msg, tt.HealthGenerate):
            self._spawn(self._reply_health_generate(client, msg.rid))
        elif isinstance(msg, tt.GetStats):
            self._spawn(self._reply_stats(client, msg.rid))
        elif isinstance(msg, tt.ShutdownEngine):
            self.begin_shutdown("shutdown() from a client")
            await self._send(client, tc.Ack(msg.rid))
        elif isinstance(msg, ops.AdminRequest):
            self._spawn(self._reply_operation(client, msg))

    async def _reply_operation(self, client: bytes, msg: ops.AdminRequest) -> None:
        try:
            reply: tc.ToClient = tc.AdminReply(msg.rid, await self.operations.run(msg.op))
        except EngineError as e:
            reply = to_failure(msg.rid, e)
        await self._send(client, reply)

    async def _reply_health_generate(self, client: bytes, rid: str) -> None:
        healthy, detail = await self.health_generate()
        await self._send(client, tc.HealthReply(rid, healthy, detail))

    async def _reply_stats(self, client: bytes, rid: str) -> None:
        await self._send(client, tc.StatsReply(rid, await self.stats()))

    def begin_shutdown(self, reason: str) -> None:
        if not self.core.draining:
            self.core.draining = True
            self.request_shutdown(reason)

    # --- admission ------------------------------------------------------------------------------

    async def _on_generate(self, client: bytes, msg: tt.Generate) -> None:
        entry = Entry(client, client=self._welcomed.get(client) or _sdk_client(client))
        try:
            entry.split = self.admission.splitter(msg)  # NOTE: a bad tool_choice raises here
            await self._admit(msg, entry)
        except EngineError as e:
            await self._send(client, to_failure(msg.rid, e))

    async def _admit(self, msg: tt.Generate, entry: Entry) -> None:
        """The one path of every request, health generations included (tokenizer_proc/
        admission.py: the same as the in-process engine's and OfflineEngine's)."""
        admitted = self.admission.admit(msg, entry)
        if self.admission.pooled(msg, admitted):
            # NOTE: a task, not awaited: the client loop goes on reading every other client's
            # frames while the pool works (awaiting it here stalled all clients, ~0.7 s per
            # 1M-character prompt; a 190 KB schema's compile check 0.36-0.65 s).
            self._spawn(self._admit_pooled(msg, entry, admitted))
            return
        try:
            ids = self.admission.token_ids(msg, admitted.params)
        except Exception as e:
            raise self.admission.fail(msg.rid, e) from e
        self._forward(msg, entry, ids, admitted.params)

    async def _admit_pooled(self, msg: tt.Generate, entry: Entry, admitted: Admitted) -> None:
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, self.admission.token_ids, msg, admitted.params
            )
        except Exception as e:
            if self.core.table.get(msg.rid) is entry:
                error = self.admission.fail(msg.rid, e)
                await self._deliver(to_failure(msg.rid, error), entry)
            return
        finally:
            self._trimmer.saw(4 * admitted.chars)  # NOTE: up to 4 bytes per character
        if self.core.table.get(msg.rid) is entry:  # NOTE: else it was ended meanwhile
            self._forward(msg, entry, ids, admitted.params)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` beside the loops, held until it ends: the event loop keeps only a weak
        reference to a task, and one nobody holds may be collected before it finishes (a reply
        never sent)."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _forward(self, msg: tt.Generate, entry: Entry, prompt: prepare.Prompt, params: Any) -> None:
        ids = prompt.ids
        entry.thinking = reasoning.opens_inside(ids, self.markers)
        if entry.split is not None:
            entry.split.begin(entry.thinking)
        params = self.admission.for_prompt(params, ids)
        if not self.core.forwarded(msg.rid, entry):
            self._spawn(self._deliver(tc.Chunk(msg.rid, finish_reason="abort"), entry))
            return
        request = TokenizedRequest(msg.rid, ids, params, entry.client or "", prompt.shared)
        self.to_scheduler.put(request)
        log.debug("rid=%s admitted: %d prompt tokens", msg.rid, len(ids))

    def _client_gone(self, owner: Hashable) -> None:
        rids = self.core.owner_gone(owner)
        if rids:
            log.warning("a client cannot be reached: aborting its %d request(s)", len(rids))
        for rid in rids:
            self.to_scheduler.put(Abort(rid))

    # --- engine side ----------------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                await self._on_engine(msg)
            except Exception:
                log.exception("error handling an engine message")
            # NOTE: a zmq.asyncio recv with a message waiting never suspends, so a backlog would
            # run to its end before any HTTP handler writes the chunks queued for it; yield.
            await asyncio.sleep(0)

    async def _on_engine(self, msg: tt.FromEngine | None) -> None:
        if isinstance(msg, tt.Chunks):
            for chunk in msg.chunks:
                entry = self.core.on_chunk(chunk)
                if entry is not None:
                    await self._deliver(chunk, entry)
        elif isinstance(msg, tt.Heartbeat):
            self.core.tick()
        elif isinstance(msg, tt.RequestFailed):
            entry = self.core.on_failed(msg.failure.rid)
            if entry is not None:
                await self._deliver(msg.failure, entry)
        elif isinstance(msg, tt.SchedulerStats):
            future = self._stats_calls.get(msg.rid)
            if future is not None and not future.done():
                future.set_result(dict(msg.stats))
        elif isinstance(msg, ops.AdminDone):
            self.operations.done(msg)
        elif isinstance(msg, tt.Control):
            await self._on_control(msg)
        elif isinstance(msg, tt.PipelineDrained):
            self.operations.fail_all(ShuttingDown("the engine shut down"))
            await self._end_all("abort")
            await self._farewell.run(self._welcomed, self._send)  # NOTE: clients still served
            self.done.set()

    async def _deliver(self, msg: tc.Chunk | tc.Failure, entry: Entry) -> None:
        if entry.reply_queue is not None:
            entry.reply_queue.put_nowait(msg)
            return
        if entry.split is not None and isinstance(msg, tc.Chunk):
            msg = entry.split.sdk_chunk(msg)
        if not entry.gone and not await self._send(entry.owner, msg):  # type: ignore[arg-type]
            self._client_gone(entry.owner)

    async def _on_control(self, msg: tt.Control) -> None:
        log.info("control from the launcher: %s %s", msg.action, msg.reason)
        if msg.action == "drain":
            self.core.draining = True
        elif msg.action == "fail":
            self.core.dead = True
            self.operations.fail_all(EngineDead(f"an engine process died: {msg.reason}"))
            await self._end_all("engine_dead", msg.reason)
            self.done.set()  # NOTE: the launcher stops the engine; the ROUTER's linger flushes

    async def _end_all(self, kind: str, reason: str = "") -> None:
        for entry, final in self.core.end_all(kind, reason):
            await self._deliver(final, entry)

    # --- sending --------------------------------------------------------------------------------

    async def _send(self, client: bytes, msg: tc.ToClient) -> bool:
        """Send to one client; False when it is gone (or so slow its queue is full)."""
        try:
            await self.router.send_multipart([client, self._reply_codec.encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False


def _sdk_client(identity: bytes) -> str:
    return "sdk:" + identity.hex()


async def _wait_event(event: threading.Event, done: asyncio.Event) -> None:
    while not event.is_set():
        await asyncio.sleep(0.2)
    done.set()


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
    return tc.Failure(rid, "invalid_request", str(error), error_field(str(error), "frame", fields))
