"""The scheduler loop of a tensor-parallel rank: every rank runs the same steps on the same state.

Each iteration (docs/distributed.md):
1. rank 0 only: heartbeat, take its inbox, decide what time decides (the drain deadline, exit);
   everything that changes the scheduler's state is posted to the broadcast, never applied here;
2. every rank: send or queue the broadcast frame (its step number and state fingerprint in the
   header; over host sockets by default, or as a collective: `Channel`);
3. every rank: one scheduler step;
4. every rank: read the frame (a different step or fingerprint on any rank is fatal) and apply
   its commands in order; `Exit` ends the loop on every rank at the same iteration.

Failure is fatal and fast: any error escapes the loop and ends the process (EXIT_FATAL); a rank
that stops stepping trips its watchdog (EXIT_STALLED); the launcher then stops the engine.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import zmq

from engine.distributed import EXIT_FATAL, Watchdog
from engine.ipc import Endpoints, PullQueue, PushQueue
from engine.messages.admin import AdminCommand
from engine.messages.to_client import Chunk
from engine.messages.to_detokenizer import SchedulerExited, StepOutputs, ToDetokenizer
from engine.messages.to_ranks import Exit, RankCommand
from engine.messages.to_scheduler import Abort, Drain, StatsQuery, TokenizedRequest, ToScheduler
from engine.messages.to_tokenizer import Heartbeat, SchedulerStats
from scheduler_proc import loop_rules
from scheduler_proc.admin import Admin
from scheduler_proc.broadcast import Channel
from scheduler_proc.kv_publisher import open_kv_events
from scheduler_proc.loop_rules import HEARTBEAT_S, IDLE_WAIT_S, Draining

log = logging.getLogger("scheduler")

NAP_AFTER = 20  # idle iterations (~1 s) before a worker naps instead of spinning

# NOTE: what every rank's scheduler must agree on after each step (`Scheduler.state_stats`).
FINGERPRINT_KEYS = (
    "steps_launched",
    "prefill_tokens",
    "generated_tokens",
    "requests_finished",
    "requests_aborted",
    "running",
    "waiting",
    "kv_tokens_in_use",
    "prefix_cache_hit_tokens",
)


class RootLinks:
    """Rank 0's sockets: the scheduler inbox and the link to the detokenizer."""

    def __init__(self, endpoints: Endpoints) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        self.inbox: PullQueue[ToScheduler] = PullQueue(ctx, endpoints.scheduler, ToScheduler)
        self.outbox: PushQueue[ToDetokenizer] = PushQueue(ctx, endpoints.detokenizer, ToDetokenizer)

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


class ReplicatedLoop:
    def __init__(
        self,
        scheduler: Any,
        bcast: Channel,
        watchdog: Watchdog,
        step_timeout: float,
        links: RootLinks | None,
        orphaned: threading.Event,
        model_dir: Path | None = None,
    ) -> None:
        self.sched = scheduler
        self.sched.contain_errors = False  # NOTE: a failed step must not be absorbed on one rank
        self.bcast = bcast
        self.rank = bcast.rank
        self.dog, self.step_timeout = watchdog, step_timeout
        self.links = links  # rank 0 only
        self.orphaned = orphaned
        self.drain = Draining()
        self.exit_posted = False
        self.iteration = 0
        self._tokens = 0  # crc of every token emitted, part of the fingerprint
        self._wait_s = 0.0  # time blocked on frames after the step: what the broadcast costs
        self._last_tick = 0.0
        self._idle = 0  # idle iterations in a row
        # NOTE: every rank runs the operations (they change state); rank 0 alone answers.
        model = model_dir or Path(scheduler.config.model or "")
        self.admin = Admin(scheduler, scheduler.config, model, self._tell, tp_size=bcast.size)
        # NOTE: every rank holds the same prefix cache: rank 0 alone publishes its events.
        self.kv_events = open_kv_events(scheduler.config, scheduler.kv) if links else None

    def run(self) -> None:
        self.dog.arm("a step", self.step_timeout)
        try:
            while not self._iterate():
                pass
            self._exit()
        except Exception:
            # NOTE: a lost peer, a diverged rank, a failed step: nothing can be trusted; the
            # launcher sees this rank die and takes the engine down (clients are told there).
            log.exception("rank %d: fatal error at iteration %d", self.rank, self.iteration)
            logging.shutdown()
            os._exit(EXIT_FATAL)
        self.dog.disarm()

    def _iterate(self) -> bool:
        """One iteration on every rank; True when the ranks are to exit."""
        self.dog.beat()
        idle = not self.sched.has_work() and not self.bcast.busy()
        self._idle = self._idle + 1 if idle else 0
        if self.links is not None:
            self._heartbeat()
            self._receive(idle)
            self._decide()
        elif self._idle > NAP_AFTER and self.bcast.polls:
            # NOTE: rank 0 waits up to IDLE_WAIT_S on its inbox; a worker in the collective
            # meanwhile spins a core (the ring busy-polls: 94 % of a core measured). Only after
            # a while idle, so back-to-back requests never wait for a nap; a worker on host
            # sockets sleeps in recv instead.
            time.sleep(IDLE_WAIT_S)
        self.iteration += 1
        self.bcast.start(self.iteration, self._fingerprint())
        if self.sched.has_work():
            self._send(self.sched.step())
        t0 = time.perf_counter()
        cmds = self.bcast.finish()
        self._wait_s += time.perf_counter() - t0
        exit_now = self._apply(cmds)
        self.admin.poll()  # NOTE: on every rank after the same commands: the same state
        if self.kv_events is not None:
            self.kv_events.publish()
        return exit_now

    # -- rank 0: inbox and time --------------------------------------------------------------
    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= HEARTBEAT_S:
            self._last_tick = now
            self._tell(Heartbeat(time.time()))

    def _receive(self, idle: bool) -> None:
        assert self.links is not None
        inbox = self.links.inbox
        first = inbox.get(IDLE_WAIT_S) if idle else inbox.get_nowait()
        if first is None:
            return
        for msg in [first, *inbox.drain()]:
            if isinstance(msg, StatsQuery):  # NOTE: reads state only: answered here, not sent
                self._tell(SchedulerStats(msg.rid, self._stats()))
            elif msg is not None:
                self.bcast.post(msg)

    def _stats(self) -> dict[str, float]:
        stats = {k: float(v) for k, v in self.sched.stats().items()} | self.admin.stats()
        stats |= {
            "tp_size": float(self.bcast.size),
            "tp_iterations": float(self.iteration),
            "tp_broadcast_wait_s": round(self._wait_s, 6),
            "tp_broadcast_bytes": float(self.bcast.bytes_sent),
        }
        return stats

    def _decide(self) -> None:
        """What depends on rank 0's clock becomes a command: aborts after the grace, exit."""
        if self.exit_posted:
            return
        now = time.monotonic()
        for rid in self.drain.due(self.sched, now):
            self.bcast.post(Abort(rid))
        reason = self._exit_reason(now)
        if reason:
            self.bcast.post(Exit(reason))
            self.exit_posted = True

    def _exit_reason(self, now: float) -> str:
        if self.orphaned.is_set():
            return "launcher gone"
        return self.drain.exit_reason(self.sched, now, busy=self.bcast.busy())

    # -- every rank: apply the broadcast -------------------------------------------------------
    def _apply(self, cmds: list[RankCommand]) -> bool:
        for cmd in cmds:
            if isinstance(cmd, TokenizedRequest):
                self._submit(cmd)
            elif isinstance(cmd, Abort):
                self.sched.abort(cmd.rid)
            elif isinstance(cmd, AdminCommand):
                self.admin.submit(cmd)
            elif isinstance(cmd, Drain):
                if self.drain.begin(cmd.grace, len(self.sched.in_flight())):
                    self.admin.on_drain()
            elif isinstance(cmd, Exit):
                log.info(
                    "rank %d: exit at iteration %d (%s)", self.rank, self.iteration, cmd.reason
                )
                return True
        return False

    def _submit(self, msg: TokenizedRequest) -> None:
        loop_rules.submit(self.sched, msg, self.drain.active, self._tell)

    def _send(self, outputs: list[Chunk]) -> None:
        for out in outputs:
            if out.token_ids:
                self._tokens = zlib.crc32(
                    struct.pack(f"<{len(out.token_ids)}q", *out.token_ids), self._tokens
                )
        if outputs:
            self._tell(StepOutputs(outputs))

    def _fingerprint(self) -> int:
        stats = self.sched.state_stats()  # NOTE: not stats(): that costs ms a call
        values = [int(stats.get(k, 0)) for k in FINGERPRINT_KEYS] + [
            self._tokens,
            len(self.sched.in_flight()),
        ]
        return zlib.crc32(struct.pack(f"<{len(values)}q", *values))

    def _tell(self, msg: ToDetokenizer) -> None:
        if self.links is not None:
            self.links.outbox.put(msg)

    def _exit(self) -> None:
        self._send(self.sched.last_outputs())
        mx.synchronize()
        self._tell(SchedulerExited())
        self.bcast.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.links is not None:
            self.links.close()
        log.info("rank %d: scheduler loop exited", self.rank)
