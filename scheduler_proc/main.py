"""The scheduler process: drives `Scheduler` with messages, sends its token ids to the detokenizer.

The loop (docs/scheduler.md, docs/processes.md): check the exit flag first, tick the heartbeat,
take messages (block briefly only when idle), enforce the drain deadline, run one scheduler step,
send its outputs.

NOTE: no input/output threads here. libzmq already moves bytes on its own I/O thread, so a send is
an enqueue of a few microseconds; Python threads would only add GIL hand-offs next to the step.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from engine import child
from engine.config import EngineConfig
from engine.ipc import Endpoints, PullQueue, PushQueue
from engine.messages.admin import AdminCommand
from engine.messages.to_client import Chunk
from engine.messages.to_detokenizer import (
    SchedulerExited,
    StepOutputs,
    ToDetokenizer,
)
from engine.messages.to_launcher import SchedulerFacts
from engine.messages.to_scheduler import Abort, Drain, StatsQuery, TokenizedRequest, ToScheduler
from engine.messages.to_tokenizer import Heartbeat, SchedulerStats
from scheduler_proc import loop_rules
from scheduler_proc.loop_rules import HEARTBEAT_S, IDLE_WAIT_S, Draining, IdleClock
from scheduler_proc.startup import load_draft, load_model, scheduler_facts

if TYPE_CHECKING:  # NOTE: imported at run time only after the BLAS set-up (see _create)
    from scheduler_proc.scheduler import Scheduler

if TYPE_CHECKING:
    from engine.distributed import RankPlan

log = logging.getLogger("scheduler")


def run(
    config: EngineConfig, endpoints: Endpoints, parent_pid: int, plan: RankPlan | None = None
) -> None:
    """One scheduler process; with `plan`, one tensor-parallel rank (rank > 0: a worker with no
    sockets but the launcher's)."""
    name = "scheduler" if plan is None or plan.rank == 0 else f"scheduler-{plan.rank}"
    child.setup(name, config.log_level)
    me = child.Child(name, endpoints.launcher, parent_pid)
    facts: SchedulerFacts | None
    with me.starting():
        if plan is None:
            loop, facts = _create(config, endpoints, me.orphaned)
        else:
            from scheduler_proc.rank import create_rank

            loop, facts = create_rank(config, endpoints, me.orphaned, plan, name)
    me.ready(facts)
    loop.run()
    me.close()


def _create(
    config: EngineConfig, endpoints: Endpoints, orphaned: threading.Event
) -> tuple[SchedulerLoop, SchedulerFacts]:
    from engine.cpu_backend import setup_cpu_backend

    # NOTE: before anything imports mlx.core in this process (a BLAS preload only works then).
    setup_cpu_backend(config)
    from scheduler_proc.scheduler import Scheduler

    model_dir, model, eos, times = load_model(config)
    draft = load_draft(config, model_dir) if config.spec == "draft" else None
    tokenizer = model_dir / "tokenizer.json"
    scheduler = Scheduler(config, model, eos, tokenizer_file=tokenizer, draft=draft)
    facts = scheduler_facts(model_dir, scheduler, config, times)
    return SchedulerLoop(scheduler, endpoints, orphaned, model_dir), facts


class SchedulerLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        endpoints: Endpoints,
        orphaned: threading.Event,
        model_dir: Path,
    ) -> None:
        from scheduler_proc.admin import Admin
        from scheduler_proc.kv_publisher import open_kv_events

        ctx: zmq.Context = zmq.Context.instance()
        self.sched = scheduler
        self.orphaned = orphaned
        self.inbox: PullQueue[ToScheduler] = PullQueue(ctx, endpoints.scheduler, ToScheduler)
        self.outbox: PushQueue[ToDetokenizer] = PushQueue(ctx, endpoints.detokenizer, ToDetokenizer)
        self.admin = Admin(scheduler, scheduler.config, model_dir, self.outbox.put)
        self.kv_events = open_kv_events(scheduler.config, scheduler.kv)
        self.drain = Draining()
        self._last_tick = 0.0
        self.idle = IdleClock()

    def run(self) -> None:
        while True:
            if self._should_exit():  # NOTE: first each iteration: a shutdown waits for no step
                break
            self._heartbeat()
            self._receive()
            self._enforce_drain()
            if self.sched.has_work():
                self._send(self.sched.step())
                self.idle.busy()
            else:
                self.idle.idle(self.sched)
            self.admin.poll()  # NOTE: after the step's outputs: an answer follows them
            if self.kv_events is not None:  # NOTE: after the step is queued: the device runs it
                self.kv_events.publish()
        self._exit()

    def _should_exit(self) -> bool:
        if self.orphaned.is_set():
            return True
        return bool(self.drain.exit_reason(self.sched, time.monotonic()))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= HEARTBEAT_S:
            self._last_tick = now
            self.outbox.put(Heartbeat(time.time()))

    def _receive(self) -> None:
        first = self.inbox.get_nowait() if self.sched.has_work() else self.inbox.get(IDLE_WAIT_S)
        if first is None:
            return
        for msg in [first, *self.inbox.drain()]:
            self._handle(msg)

    def _handle(self, msg: ToScheduler | None) -> None:
        if isinstance(msg, TokenizedRequest):
            self._submit(msg)
        elif isinstance(msg, Abort):
            self.sched.abort(msg.rid)
        elif isinstance(msg, StatsQuery):
            stats = {k: float(v) for k, v in self.sched.stats().items()}
            self.outbox.put(SchedulerStats(msg.rid, stats | self.admin.stats()))
        elif isinstance(msg, AdminCommand):
            self.admin.submit(msg)
        elif isinstance(msg, Drain):
            self._begin_drain(msg.grace)

    def _submit(self, msg: TokenizedRequest) -> None:
        loop_rules.submit(self.sched, msg, self.drain.active, self.outbox.put)

    def _begin_drain(self, grace: float) -> None:
        if self.drain.begin(grace, len(self.sched.in_flight())):
            self.admin.on_drain()

    def _enforce_drain(self) -> None:
        for rid in self.drain.due(self.sched, time.monotonic()):
            self.sched.abort(rid)

    def _send(self, outputs: list[Chunk]) -> None:
        if outputs:
            self.outbox.put(StepOutputs(outputs))

    def _exit(self) -> None:
        import mlx.core as mx

        self._send(self.sched.last_outputs())
        mx.synchronize()
        self.outbox.put(SchedulerExited())
        if self.kv_events is not None:
            self.kv_events.close()
        self.inbox.close()
        self.outbox.close()
        log.info("scheduler loop exited; stats: %s", self.sched.stats())
