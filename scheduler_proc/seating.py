"""Who holds a row: waiting requests seated with their pages, and rows given back.

Requests wait in `WaitingQueue` (fair across clients) and run in `RunningTable`'s rows, their KV
in `KVManager`'s pages. `Seating` moves them between the two, while no step is in flight:
it seats what fits (a cached prefix shared, one page kept free per decoding request for its
growth), gives the newest row back when decode runs out of pages, and takes one row a step from
the client most above its share for a client below it that got none. While a decode step is in
flight it may seat too (`seat(in_flight=True)`), into free rows and pages only. A request that
gives its row back waits at the front of the queue with its stream open, and is recomputed from
prompt + tokens so far when it is seated again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from scheduler_proc.kv_manager import KVManager
from scheduler_proc.prefix_cache import PendingPrompts
from scheduler_proc.request import Req, State
from scheduler_proc.running import RunningTable
from scheduler_proc.waiting import WaitingQueue

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Seating:
    waiting: WaitingQueue
    running: RunningTable
    kv: KVManager
    # NOTE: requests that ended while being seated (their grammar failed to build), for the
    # scheduler to report. A list, not a callback into the scheduler: a bound method held here
    # made a reference cycle, so a dropped Scheduler's KV pool waited for the cyclic collector.
    ended: list[Req] = field(default_factory=list)
    seatings: int = 0  # NOTE: `Req.seated` orders the rows: the newest gives its row first
    preempted: int = 0

    def seat(self, in_flight: bool = False) -> bool:
        """Seat what fits, fairly across clients (scheduler_proc/waiting.py). A client below
        its share of rows that gets none takes one from the client most above it (one a step,
        so a flood is rebalanced without thrashing).

        `in_flight`: a step is in flight, so no row is given back and the pool does not grow
        (`KVManager.seat`); returns whether a request waits that either would seat."""
        blocked = self._seat_waiting(in_flight)
        victim = self._fair_victim(blocked) if blocked is not None else None
        if in_flight:
            grow = blocked is not None and self.kv.pool.pages < self.kv.pool.capacity
            return victim is not None or grow
        if victim is not None:
            self.preempt(victim, "its client holds more than its share of rows")
            self._seat_waiting()
        return False

    def seatable(self) -> bool:
        """Whether the next waiting request could be seated now (a slot, and pages by a cheap
        estimate: free pages and what the prefix cache could give up), or a row given back for
        it (`_fair_victim`)."""
        if not self.waiting:
            return False
        req = self.waiting.peek(self.running.rows_of)
        if self.running.free_slots > 0 and self.kv.could_free(
            self.kv.pool.pages_for(req.fill_len) + self.running.n_decode
        ):
            return True
        return self._fair_victim(req) is not None

    def make_room(self) -> None:
        """Every decoding request gets the page its next token needs; when none is left, the
        newest running request gives its pages back and waits to be recomputed."""
        for req in self.running.decoding():
            while req.slot is not None and not self.kv.grow(req):
                self.preempt(self.running.newest(self.running.heaviest()), "out of KV pages")

    def retract(self) -> int:
        """Every running request gives its row back, the newest first, so that they wait in
        the order they were seated."""
        running = sorted(self.running.reqs, key=lambda r: r.seated, reverse=True)
        for req in running:
            self.preempt(req, "generation paused (retract)")
        return len(running)

    def preempt(self, req: Req, why: str) -> None:
        log.info("%s preempted: %s (%d tokens recomputed later)", req.rid, why, req.kv_len)
        self.kv.release(req)
        self.running.release(req)
        req.preempt()
        self.waiting.appendleft(req)
        self.preempted += 1

    def _fair_victim(self, req: Req) -> Req | None:
        """The row to give back so `req`'s client, below its share of the running rows (the rows
        in use split among the clients running or waiting), gets one: the newest of the client
        most above it. None when no client is above its share."""
        rows = self.running.rows_of
        clients = set(self.waiting.clients()) | set(self.running.clients())
        share = max(1, len(self.running.reqs) // len(clients))
        if rows(req.client) >= share or not self.running.reqs:
            return None
        heavy = self.running.heaviest()
        return self.running.newest(heavy) if rows(heavy) > share else None

    def _seat_waiting(self, in_flight: bool = False) -> Req | None:
        """Seat what fits; returns the request that found no slot or pages (None: all were
        seated or are deferred)."""
        pending = PendingPrompts(r.fill_ids for r in self.running.prefilling())
        with self.kv.one_pass():
            return self._seat_each(pending, in_flight)

    def _seat_each(self, pending: PendingPrompts, in_flight: bool) -> Req | None:
        deferred: list[Req] = []
        rows = self.running.rows_of
        try:
            while self.waiting:
                if self.running.free_slots == 0:
                    return self.waiting.peek(rows)
                req = self.waiting.popleft(rows)
                if self._defer(req, pending, in_flight):
                    if not req.finished:
                        deferred.append(req)
                    continue
                if not self._take_pages(req, in_flight):
                    return req
                req.state = State.PREFILLING
                pending.add(req.fill_ids)
                self.seatings += 1
                req.seated = self.seatings
                self.waiting.served(req.client)
            return None
        finally:  # NOTE: a failed seating must not drop the requests deferred before it
            for req in reversed(deferred):
                self.waiting.appendleft(req)

    def _defer(self, req: Req, pending: PendingPrompts, in_flight: bool) -> bool:
        """Whether `req` waits a step: its grammar is still building, its prompt's blocks load
        from disk (`DiskTier.waits`), or a running prompt is about to cache the prefix it would
        share (`PrefixCache.should_wait`)."""
        if req.building is not None and not self._matcher_ready(req):
            return True
        if self.kv.disk is not None and self.kv.disk.waits(req, in_flight):
            return True
        prefix = self.kv.prefix
        return (
            prefix is not None
            and not req.wants_prompt_logprobs
            and prefix.should_wait(req, pending)
        )

    def _matcher_ready(self, req: Req) -> bool:
        """Whether a constrained request's matcher is built (a failed build ends it)."""
        if not req.building.done():
            return False
        building, req.building = req.building, None
        try:
            req.matcher = building.result()
        except Exception as e:  # NOTE: the grammar thread's error is this request's alone
            req.finish("error", f"{type(e).__name__}: {e}")
            req.state = State.FINISHED
            self.ended.append(req)
            return False
        return True

    def _take_pages(self, req: Req, in_flight: bool) -> bool:
        """A slot and pages for `req`; refused (or failed), it waits at the front, holding none."""
        self.running.add(req)
        seated = False
        try:
            seated = self.kv.seat(req, reserve=self.running.n_decode, in_flight=in_flight)
        finally:
            if not seated:
                self.running.release(req)
                self.waiting.appendleft(req)
        return seated
