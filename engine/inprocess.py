"""The in-process engine behind the SDK: scheduler, tokenizer and detokenizer on one thread.

`EngineClient(transport=InProcessTransport(model))` has exactly the methods and the errors of a
client of a launched engine, so one contract test suite runs against both, and benchmarks can
measure what the process boundary costs. All MLX work stays on the engine thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detokenizer_proc.detokenizer import Detokenizer
from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest, ShuttingDown
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from engine.transport import Sink, encode_request, register_sink
from engine.wire_errors import to_failure
from tokenizer_proc import prepare

log = logging.getLogger("engine.inprocess")

IDLE_WAIT_S = 0.05
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


class InProcessTransport:
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
        # NOTE: the same InvalidRequest as over the wire for an argument it cannot carry.
        encode_request(msg)
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
        from mlx_lm.utils import load_tokenizer

        from engine.models import resolve_model_dir
        from engine.offline import load_for_scheduler
        from scheduler_proc.scheduler import Scheduler

        model_dir = resolve_model_dir(self.config.model)
        model, eos = load_for_scheduler(str(model_dir), self.config)
        self.sched = Scheduler(self.config, model, eos)
        self.tokenizer = load_tokenizer(Path(model_dir))
        self.detok = Detokenizer(self.tokenizer)
        self.model_name = model_dir.name
        self.max_context = int(self.sched.stats()["kv_row_len"])
        self.counters: Counter[str] = Counter()
        self.live: set[str] = set()
        self.draining = False

    def _loop(self) -> None:
        while True:
            wait = None if self.sched.has_work() else IDLE_WAIT_S
            for msg in self._take(wait):
                if msg is _STOP:
                    return
                self._handle(msg)
            if self.sched.has_work():
                self._on_outputs(self.sched.step())

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
        if isinstance(msg, tt.Generate):
            self._generate(msg)
        elif isinstance(msg, tt.AbortRequest):
            self.sched.abort(msg.target)
            self._reply(tc.Ack(msg.rid))
        elif isinstance(msg, tt.Hello):
            self._reply(self._welcome(msg))
        elif isinstance(msg, tt.HealthCheck):
            self._reply(tc.HealthReply(msg.rid, not self.draining))
        elif isinstance(msg, tt.HealthGenerate):
            self._health_generate(msg.rid)
        elif isinstance(msg, tt.GetStats):
            self._reply(tc.StatsReply(msg.rid, self._stats()))
        elif isinstance(msg, tt.ShutdownEngine):
            self.draining = True
            self._reply(tc.Ack(msg.rid))

    def _welcome(self, msg: tt.Hello) -> tc.ToClient:
        if msg.version != PROTOCOL_VERSION:
            return tc.Failure(
                msg.rid, "protocol", f"protocol v{msg.version} != v{PROTOCOL_VERSION}"
            )
        return tc.Welcome(msg.rid, PROTOCOL_VERSION, self.model_name, self.max_context)

    def _generate(self, msg: tt.Generate) -> None:
        """Same validation and counters as the tokenizer process (tokenizer_proc.prepare)."""
        self.counters["requests_received"] += 1
        try:
            self._admit(msg)
        except EngineError as e:
            self._refuse(msg.rid, e)
        except Exception as e:  # NOTE: as in the scheduler process: one bad request fails alone
            log.exception("rid=%s submit failed", msg.rid)
            self._refuse(msg.rid, EngineError(f"{type(e).__name__}: {e}"))

    def _refuse(self, rid: str, error: EngineError) -> None:
        self.counters["requests_rejected"] += 1
        self._reply(to_failure(rid, error))

    def _admit(self, msg: tt.Generate) -> None:
        if self.draining:
            raise ShuttingDown("the engine is shutting down")
        if not msg.rid or msg.rid in self.live:
            raise InvalidRequest("rid", f"must be a unique non-empty id, got {msg.rid!r}")
        vocab = int(self.sched.vocab)
        params = prepare.sampling_params(msg.params, vocab)
        ids = prepare.token_ids(msg, self.tokenizer, vocab, self.max_context)
        self.sched.submit(msg.rid, ids, params)
        self.detok.register(msg.rid, list(params.stop))
        self.live.add(msg.rid)

    def _on_outputs(self, outputs: list[Any]) -> None:
        chunks, stopped = self.detok.process(outputs)
        for rid in stopped:
            self.sched.abort(rid)
        for chunk in chunks:
            if chunk.finish_reason is not None:
                self.live.discard(chunk.rid)
                self.counters["requests_answered"] += 1
                self.counters[f"finish_{chunk.finish_reason}"] += 1
            self._reply(chunk)

    def _health_generate(self, caller: str) -> None:
        rid = f"health-{uuid.uuid4().hex}"

        def done(msg: tc.ToClient) -> None:
            finish = getattr(msg, "finish_reason", "error")
            if finish is not None:
                self.sinks.pop(rid, None)
                self._reply(tc.HealthReply(caller, finish in ("stop", "length")))

        self.sinks[rid] = done
        self._generate(
            tt.Generate(rid, input_ids=[0], params={"max_tokens": 1, "temperature": 0.0})
        )

    def _stats(self) -> dict[str, float]:
        stats = {k: float(v) for k, v in self.sched.stats().items()}
        stats.update({k: float(v) for k, v in self.counters.items()})
        stats["requests_in_flight"] = float(len(self.live))
        return stats

    def _reply(self, msg: tc.ToClient) -> None:
        sink = self.sinks.get(getattr(msg, "rid", ""))
        if sink is not None:
            sink(msg)
