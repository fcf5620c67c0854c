"""The in-process engine behind the SDK: scheduler, tokenizer and detokenizer on one thread.

`EngineClient(transport=InProcessEngine(model))` has exactly the methods and the errors of a
client of a launched engine, so one contract test suite runs against both, and benchmarks can
measure what the process boundary costs. All MLX work stays on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from detokenizer_proc.detokenizer import Detokenizer
from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError
from engine.messages import admin as ops
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.transport import Sink, encode_request, register_sink
from engine.wire_errors import to_failure
from scheduler_proc.loop_rules import IdleClock
from tokenizer_proc import limits
from tokenizer_proc.admission import Admission
from tokenizer_proc.core import FrontDoor, HealthProbe, door_settings, paused_detail, unauthorized
from tokenizer_proc.requests import Entry

log = logging.getLogger("mlx_engine.inprocess")

IDLE_WAIT_S = 0.05
OWNER = "inprocess"  # NOTE: every client of one in-process transport shares it (one process)
_STOP = object()
_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_worker_lock = threading.Lock()
_worker: threading.Thread | None = None


def _on_mlx_thread(job: Callable[[], None]) -> None:
    """Run `job` on the one long-lived MLX thread of this process (engines run one at a time).

    NOTE: MLX can abort the interpreter at exit ("terminate called without an active exception")
    once a thread that ran MLX work has ended (ml-explore/mlx#3126, seen with mlx 0.32.4 on CPU);
    a daemon thread that never ends avoids it.
    """
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_serve_jobs, name="engine-inprocess", daemon=True)
            _worker.start()
    _jobs.put(job)


def _serve_jobs() -> None:
    while True:
        _jobs.get()()


class InProcessEngine:
    """An engine in this process that a client talks to directly: it is its own transport
    (`register` / `unregister` / `send` / `close`, as `engine.transport.Transport`)."""

    def __init__(self, model: str | None = None, **config_overrides: Any) -> None:
        self.config = EngineConfig(model=model, **config_overrides).validate()
        self.sinks: dict[str, Sink] = {}
        self.dead: str | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        _on_mlx_thread(self._run)
        self._ready.wait(self.config.startup_timeout)
        if self.dead is not None:
            raise EngineDead(self.dead)

    # --- the transport interface ----------------------------------------------------------------

    def register(self, rid: str, sink: Sink) -> None:
        register_sink(self.sinks, rid, sink)

    def unregister(self, rid: str) -> None:
        self.sinks.pop(rid, None)

    def send(self, msg: tt.FromClient) -> None:
        # NOTE: the same InvalidRequest as over the wire for an argument it cannot carry, or
        # for a request larger than a frame may be (--max-frame-bytes).
        limits.check_frame(len(encode_request(msg)), self.config)
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._inbox.put(msg)

    def close(self) -> None:
        if self.dead is None:
            self._inbox.put(_STOP)
            self._stopped.wait(30.0)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._start()
        except Exception as e:
            self.dead = f"the in-process engine failed to start: {type(e).__name__}: {e}"
            return
        finally:
            self._ready.set()
        try:
            self._loop()
            self._stop()
        except Exception as e:  # NOTE: the MLX thread is shared; a crash fails clients, not it
            log.exception("the in-process engine loop failed")
            self._fail_waiting(f"the in-process engine failed: {type(e).__name__}: {e}")
        finally:
            self._stopped.set()

    def _fail_waiting(self, reason: str) -> None:
        """Every waiting call gets `EngineDead` now; later calls get it from `send()`."""
        self.dead = reason
        for rid in list(self.sinks):
            self._reply(to_failure(rid, EngineDead(reason)))

    def _start(self) -> None:
        from engine.models import resolve_model_dir, served_name
        from engine.tokenizer_loader import load_tokenizer, tokenizer_defaults
        from scheduler_proc.admin import Admin
        from scheduler_proc.model_loader import load_for_scheduler
        from scheduler_proc.scheduler import Scheduler

        model_dir = resolve_model_dir(self.config.model, self.config.gguf_file)
        model, eos = load_for_scheduler(str(model_dir), self.config)
        self.sched = Scheduler(self.config, model, eos, tokenizer_file=model_dir / "tokenizer.json")
        # NOTE: the tokenizer processes' loader, with the scheduler's model defaults
        self.tokenizer = load_tokenizer(model_dir, tokenizer_defaults(model_dir))
        self.detok = Detokenizer(self.tokenizer)
        slots = self.sched.running.slots
        self.core = FrontDoor(
            door_settings(
                self.config,
                (
                    served_name(self.config.model, model_dir),
                    int(self.sched.vocab),
                    self.sched.max_context,
                    slots,
                ),
                snapshot_hits=self.sched.kv.snapshots is not None,
            )
        )
        self.admission = Admission(self.core, self.config, self.tokenizer)
        self.welcomed = False
        self.probes: dict[str, tuple[HealthProbe, str]] = {}  # probe rid -> (probe, caller rid)
        self.admin = Admin(self.sched, self.config, model_dir, self._operation_done)
        self.operations: dict[str, ops.AdminOp] = {}  # caller rid -> its operation
        self.idle = IdleClock()

    def _loop(self) -> None:
        while True:
            self.core.tick()
            self._expire_probes()
            wait = None if self.sched.has_work() else IDLE_WAIT_S
            for msg in self._take(wait):
                if msg is _STOP:
                    return
                self._handle(msg)
            if self.sched.has_work():
                self._on_outputs(self.sched.step())
                self.idle.busy()
            else:
                self.idle.idle(self.sched)  # NOTE: the pool shrinks, cached buffers go back
            self.admin.poll()

    def _take(self, wait: float | None) -> list[Any]:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            return msgs

    def _stop(self) -> None:
        import mlx.core as mx

        self.sched.shutdown()
        self._on_outputs(self.sched.step())
        mx.synchronize()
        self.dead = "the in-process engine stopped"

    # --- messages -------------------------------------------------------------------------------

    def _handle(self, msg: tt.FromClient) -> None:
        """The same core as the tokenizer process (tokenizer_proc.core): same rules, counters."""
        if not self.core.allows(msg, self.welcomed):
            self._reply(unauthorized(msg))
        elif isinstance(msg, tt.Generate):
            self._generate(msg, OWNER)
        elif isinstance(msg, tt.AbortRequest):
            self._abort(msg)
        elif isinstance(msg, tt.Hello):
            reply = self.core.welcome(msg)
            self.welcomed = self.welcomed or isinstance(reply, tc.Welcome)
            self._reply(reply)
        elif isinstance(msg, tt.HealthCheck):
            self._reply(tc.HealthReply(msg.rid, *self.core.health()))
        elif isinstance(msg, tt.HealthGenerate):
            self._health_generate(msg.rid)
        elif isinstance(msg, tt.GetStats):
            self._reply(tc.StatsReply(msg.rid, self.core.stats(self.sched.stats())))
        elif isinstance(msg, tt.ShutdownEngine):
            self.core.draining = True
            self._reply(tc.Ack(msg.rid))
        elif isinstance(msg, ops.AdminRequest):
            self.operations[msg.rid] = msg.op
            self.core.operation_sent(msg.op)
            self.admin.submit(ops.AdminCommand(msg.rid, msg.op))

    def _operation_done(self, done: ops.AdminDone) -> None:
        op = self.operations.pop(done.rid, None)
        if op is not None:
            self.core.operation_done(op, None if done.failure else done.info)
        self._reply(done.failure or tc.AdminReply(done.rid, done.info))

    def _abort(self, msg: tt.AbortRequest) -> None:
        try:
            if self.core.abort(msg.target, OWNER):
                self.sched.abort(msg.target)
        except EngineError as e:
            self._reply(to_failure(msg.rid, e))
            return
        self._reply(tc.Ack(msg.rid))

    def _generate(self, msg: tt.Generate, owner: str | None) -> None:
        # NOTE: the entry names no client (no fair share): every caller of this engine is one.
        entry = Entry(owner)
        try:
            entry.split = self.admission.splitter(msg)  # NOTE: a bad tool_choice raises here
            admitted = self.admission.admit(msg, entry)
        except EngineError as e:
            self._reply(to_failure(msg.rid, e))
            return
        params = admitted.params
        try:
            ids, shared = self.admission.token_ids(msg, params)
            params = self.admission.for_prompt(params, ids)
            if entry.split is not None:
                entry.split.begin(self.admission.opens_inside(ids))
            self.sched.submit(msg.rid, ids, params, checked=True, shared=shared)
        except Exception as e:  # NOTE: as in the scheduler process: one bad request fails alone
            self._reply(to_failure(msg.rid, self.admission.fail(msg.rid, e)))
            return
        self.core.forwarded(msg.rid, entry)  # NOTE: one thread: no abort can come in between
        self.detok.register(msg.rid, list(params.stop))

    def _on_outputs(self, outputs: list[Any]) -> None:
        chunks, stopped = self.detok.process(outputs)
        for rid in stopped:
            self.sched.abort(rid)
        for chunk in chunks:
            entry = self.core.on_chunk(chunk)
            if entry is not None:
                split = entry.split
                self._reply(chunk if split is None else split.sdk_chunk(chunk))

    # --- health generation ----------------------------------------------------------------------

    def _health_generate(self, caller: str) -> None:
        if self.core.paused is not None:  # NOTE: as the front door: nothing generates now
            self._reply(tc.HealthReply(caller, False, paused_detail(self.core.paused)))
            return
        probe = HealthProbe()

        def sink(msg: tc.ToClient) -> None:
            verdict = probe.feed(msg)
            if verdict is not None:
                self._end_probe(probe, caller, verdict)

        self.probes[probe.rid] = (probe, caller)
        self.sinks[probe.rid] = sink
        self._generate(probe.request(), None)

    def _expire_probes(self) -> None:
        for probe, caller in list(self.probes.values()):
            verdict = probe.expired()
            if verdict is not None:
                if self.core.abort(probe.rid, None):
                    self.sched.abort(probe.rid)
                self._end_probe(probe, caller, verdict)

    def _end_probe(self, probe: HealthProbe, caller: str, verdict: tuple[bool, str]) -> None:
        self.sinks.pop(probe.rid, None)
        self.probes.pop(probe.rid, None)
        self._reply(tc.HealthReply(caller, *verdict))

    def _reply(self, msg: tc.ToClient) -> None:
        sink = self.sinks.get(getattr(msg, "rid", ""))
        if sink is not None:
            sink(msg)
