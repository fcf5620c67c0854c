"""Pages for requests: admission by free pages, a page more as decode grows, release.

The scheduler calls it while no step is in flight, except `grow` for a chained decode step,
which takes a free page and nothing else, and, where a row is its pages alone,
`seat(in_flight=True)`, `release` and `publish` (`Scheduler._move_in_flight`): a page freed or
evicted there is read by no step in flight, and its next owner's writes are queued after them.
Admission asks for the pages of the whole fill (prompt, or prompt + output after a preemption)
less the prefix hit's shared pages, plus a reserve of one page per decoding request so running
requests can grow; when decode still runs out, the scheduler preempts the newest request
(`RunningTable.newest`), whose pages come back here.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from scheduler_proc.disk_cache import DiskCache
from scheduler_proc.disk_tier import DiskTier
from scheduler_proc.kv_cache import KVPool, token_slots
from scheduler_proc.kv_event_log import KVEventLog
from scheduler_proc.pages import PageAllocator
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.request import Req
from scheduler_proc.snapshots import SlotSnapshots

log = logging.getLogger(__name__)


class KVManager:
    def __init__(
        self, pool: KVPool, prefix: bool, snapshots: int = 0, align: int | None = None
    ) -> None:
        """`align`: the lone chunks' width (`--long-prefill-chunk`), to which a hit is cut back
        when the rest of the prompt crosses a multiple of it anyway (`lone_start`)."""
        self.pool, self.align = pool, align
        self.pages = PageAllocator(pool.pages, pool.page_size)
        self.prefix = PrefixCache(self.pages) if prefix else None  # NOTE: None when off
        # NOTE: models with rings or recurrent state: a hit also restores the slot (snapshots).
        slotted = any(r is not None for r in pool.rings) or bool(pool.states)
        self.snapshots = SlotSnapshots(pool, snapshots) if prefix and slotted else None
        self.events: KVEventLog | None = None  # NOTE: --kv-events-endpoint (kv_publisher.py)
        self.disk: DiskTier | None = None  # NOTE: --kv-cache-dir (`attach_disk`)
        # NOTE: token copies (src, dst) held until a seating pass ends (`one_pass`); None: none
        # is running, a seat writes its own at once.
        self._copies: tuple[list[int], list[int]] | None = None

    def attach_disk(self, cache: DiskCache) -> None:
        """The prefix cache's disk tier (`--kv-cache-dir`); with slots, snapshots go too."""
        assert self.prefix is not None, "a disk tier under the prefix cache"
        self.disk = DiskTier(cache, self.pool, self.prefix, self.pages, self.room, self.snapshots)

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        """Seats within it write their prefix hits' copied tokens together, once, at its end.

        NOTE: a copy evaluates its reads, then its writes, on their own (`KVPool.copy_tokens`):
        two waits for the device. One per hit, 196 hits of a wave on the H200 held the step
        after them 1.2 s. What a pass copies from is locked by its hits (never evicted or
        reused within it) and what it copies to is fresh pages, so deferring changes nothing
        a seat reads.
        """
        outer, self._copies = self._copies, ([], [])
        try:
            yield
        finally:
            (src, dst), self._copies = self._copies, outer
            self._copy(src, dst)

    def seat(self, req: Req, reserve: int, in_flight: bool = False) -> bool:
        """Give `req` its pages (a cached prefix shared) if they fit beside `reserve` pages.

        `in_flight`: a step is in flight, so nothing waits for the device: the hit keeps only
        the pages it shares whole (a copy evaluates its reads) and the pool does not grow."""
        assert req.slot is not None, f"{req.rid}: admitted without a slot"
        hit = None
        blocks: list[int | list[int]] = []
        if self.prefix is not None:
            limit = 0 if req.wants_prompt_logprobs else req.fill_len - 1
            hit = self.prefix.acquire(req.fill_ids, limit, self._boundary(req))
            blocks = self.prefix.layout(hit)
            if in_flight:
                blocks = self.prefix.shared_whole(hit, blocks)
            req.snap_at = self._snap_point(req, hit.length)
        total = self.pool.pages_for(req.fill_len)
        shared = sum(isinstance(b, int) for b in blocks)
        # NOTE: in flight the pool cannot grow, and while it could, the seat waits for the break
        # that grows it rather than evict: seats in flight evicted 25k cached tokens of other
        # agents' conversations (64 agents, 4 turns, a pool that had not grown yet), whose next
        # turns then recomputed them (44 % more prompt tokens).
        growable = self.pool.pages < self.pool.capacity
        evict = not (in_flight and growable)
        if not self.room(total - shared + reserve, grow=not in_flight, evict=evict):
            if hit is not None and self.prefix is not None:
                self.prefix.unhit(hit)
            return False
        new = self.pages.alloc(total - shared)
        req.pages = self._table(blocks, new)
        req.hit = hit
        n = hit.length if hit is not None else 0
        req.prefilled = req.kv_len = n
        if req.preemptions == 0:
            req.cached_tokens = n
        if n and self.snapshots is not None:
            self.snapshots.restore(req.slot, req.fill_ids[:n])
        else:
            self.pool.reset_slot(req.slot)
        return True

    def _snap_point(self, req: Req, hit: int) -> int | None:
        """Where the request should snapshot its slot: the end of what it shares with a cached
        prefix beyond its snapshot-bounded hit, so the next request sharing it hits there; else
        the end of what its prompt shares with other conversations (`Req.shared`: a chat's
        system prompt), so the next conversation hits there (with none, every new conversation
        under one system prompt computed it again, a burst of agents each)."""
        if self.snapshots is None or self.prefix is None:
            return None
        body = req.fill_len - 1
        cached = self.prefix.tree.match_prefix(req.fill_ids[:body]).length
        for point in (cached, req.shared):
            if hit < point < body:
                return point
        return None

    def snapshot_at(self, req: Req) -> None:
        """The request's slot holds exactly its first `snap_at` fill tokens: keep a copy (for
        the disk too, once its prompt body is cached: `snap_at` lies within it)."""
        if req.snap_at is not None:
            tokens = req.fill_ids[: req.snap_at]
            snapshot = self._snapshot(req, tokens)
            if self.disk is not None and snapshot is not None:
                req.snap_pending = (tokens, snapshot)
        req.snap_at = None

    def _boundary(self, req: Req):
        snaps, w = self.snapshots, self.align
        if snaps is not None:
            return lambda n: snaps.longest(req.fill_ids, n)
        if w is not None:
            return lambda n: lone_start(n, req.fill_len - 1, w)
        return None

    def _table(self, blocks: list[int | list[int]], new: list[int]) -> list[int]:
        """Shared pages in place, own pages for the rest; copied blocks written now."""
        table, fresh = [], iter(new)
        src: list[int] = []
        dst: list[int] = []
        for block in blocks:
            if isinstance(block, int):
                self.pages.incref(block)
                table.append(block)
                continue
            page = next(fresh)
            src += block
            dst += range(page * self.pool.page_size, page * self.pool.page_size + len(block))
            table.append(page)
        if self._copies is None:
            self._copy(src, dst)
        else:
            self._copies[0].extend(src)
            self._copies[1].extend(dst)
        return table + list(fresh)

    def _copy(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        # NOTE: a page freed and taken again within one pass can be a destination twice: the
        # last copy to a slot is the one its owner holds (one scatter's duplicates are unordered).
        last = dict(zip(dst, src, strict=True))
        src, dst = list(last.values()), list(last)
        self.pool.copy_tokens(src, dst)

    def grow(self, req: Req, evict: bool = True, ahead: int = 1) -> bool:
        """Pages for the request's next `ahead` tokens (a decode: one; a speculating row: its
        input and proposal); False when none is free."""
        while self.pool.pages_for(req.kv_len + ahead) > len(req.pages):
            if not (self.room(1) if evict else self.pages.available >= 1):
                return False
            req.pages += self.pages.alloc(1)
        return True

    def trim(self, req: Req) -> None:
        """Pages wholly past the request's `kv_len` go back (a speculating row's rejected
        tokens: pages `grow` took for them). Only its own pages lie there: a shared or cached
        page holds tokens below `kv_len`."""
        keep = self.pool.pages_for(req.kv_len)
        if len(req.pages) > keep:
            self.pages.release(req.pages[keep:])
            del req.pages[keep:]

    def release(self, req: Req) -> None:
        """Its pages go back (those the prefix cache holds stay); what it computed is cached
        first, unless it ended in an error."""
        if not req.pages:
            raise RuntimeError(f"KV pages: {req.rid} released twice (or never admitted)")
        if self.prefix is not None:
            keep = req.finish_reason != "error" and req.kv_len > 0
            tokens = (req.input_ids + req.output_ids)[: req.kv_len]
            snapshot = self._snapshot(req, tokens) if keep else None
            self.prefix.retire(req, self.slots(req, req.kv_len) if keep else None)
            if keep:
                self._to_disk(tokens, snapshot)
        self.pages.release(req.pages)
        req.pages = []

    def publish(self, req: Req) -> None:
        if self.prefix is not None:
            self.prefix.publish(req, self.slots(req, req.fill_len - 1))
            tokens = req.fill_ids[: req.fill_len - 1]
            snapshot = self._snapshot(req, tokens)
            if snapshot is not None:  # NOTE: pages alone: a finished request writes its blocks
                self._to_disk(tokens, snapshot)
            if req.snap_pending is not None:
                self._to_disk(*req.snap_pending)
                req.snap_pending = None

    def _snapshot(self, req: Req, tokens: list[int]) -> list[mx.array] | None:
        if self.snapshots is not None and req.slot is not None:
            return self.snapshots.take(req.slot, tokens)
        return None

    def _to_disk(self, tokens: list[int], snapshot: list[mx.array] | None) -> None:
        """Cached `tokens` (and the slot's `snapshot` at them) to the disk tier, if any."""
        if self.disk is not None:
            self.disk.retired(tokens, snapshot)

    def flush(self, disk: bool = True) -> int:
        """The prefix cache emptied of what no running request holds, snapshots with it, and
        the disk tier's files of this model (`disk`); returns the tokens dropped (memory)."""
        if self.snapshots is not None:
            self.snapshots.clear()
        if self.disk is not None:
            self.disk.drop_queued()
            if disk:
                log.info("KV disk cache: %d files removed", self.disk.cache.clear())
        return self.prefix.flush() if self.prefix is not None else 0

    def room(self, n: int, grow: bool = True, evict: bool = True) -> bool:
        """Whether `n` pages are free: the pool grows first (doubling, up to its capacity;
        `grow`), then cached spans nobody runs on are evicted (`evict`); nothing is evicted
        when even that could not free enough."""
        short = n - self.pages.available
        if short <= 0:
            return True
        if not self.could_free(n, grow):
            return False
        pool = self.pool
        if grow:
            self.pages.add(pool.grow(max(pool.pages + short, 2 * pool.pages)))
        if self.pages.available >= n:
            return True
        if self.prefix is None or not evict:
            return False
        self.prefix.evict(n)
        return self.pages.available >= n

    def shrink(self) -> int:
        """The pool back to the smallest size its growth steps (doubling from its start) reach
        that holds the highest page in use, by running requests or the prefix cache (nothing is
        evicted); only while no step is in flight. Returns the pages released."""
        pool = self.pool
        size = growth_size(self.pages.highest_in_use(), pool.initial, pool.capacity)
        if size >= pool.pages:
            return 0
        self.pages.shrink(size)
        return pool.shrink(size)

    def could_free(self, n: int, grow: bool = True) -> bool:
        """Whether `n` pages are free or could be: the pool's room to grow (`grow`) and the
        pages only the cache holds count."""
        more = self.pool.capacity - self.pool.pages if grow else 0
        return self.pages.available + more + self.pages.cache_only >= n

    def slots(self, req: Req, n: int) -> list[int]:
        slots: np.ndarray = token_slots(req.pages, 0, n, self.pool.page_size)
        return slots.tolist()

    def stats(self) -> dict[str, int | float]:
        p = self.pages
        out: dict[str, int | float] = {
            "kv_pages_total": self.pool.capacity,
            "kv_pages_allocated": p.size,
            "kv_pages_free": p.available,
            "kv_page_size": p.page_size,
            "kv_tokens_allocated": p.in_use * p.page_size,
        }
        if self.prefix is not None:
            out |= self.prefix.stats()
        if self.snapshots is not None:
            out |= {"prefix_cache_snapshots": len(self.snapshots)}
        if self.disk is not None:
            out |= self.disk.stats()
        if self.events is not None:
            out |= {
                "kv_events_batches": self.events.seq + 1,
                "kv_events_dropped": self.events.dropped,
            }
        return out


def growth_size(pages: int, initial: int, capacity: int) -> int:
    """The smallest of `initial` pages doubled k times (k >= 0, at most `capacity`) that holds
    `pages` pages."""
    size = max(1, initial)
    while size < min(pages, capacity):
        size *= 2
    return min(size, capacity)


def lone_start(hit: int, body: int, w: int) -> int:
    """A prefix hit of `hit` tokens of a prompt whose body (the tokens before its last) is
    `body`, cut back to a multiple of `w` when the body's rest crosses one anyway: its chunks
    are then all lone ones, many a step (`prefill_plan`), with no short chunk up to the multiple
    first, which attends by the score-bound path (H200, 128 agents: one such chunk a step).

    NOTE: it recomputes `hit % w` cached tokens (below `w`); a rest that ends before the next
    multiple (a warm turn: a few tokens) keeps its whole hit, and so does a hit under `w` (its
    chunk up to `w` reads few keys, so many run a step; cut, it would recompute the hit)."""
    cut = hit % w
    return hit - cut if hit > w and body - hit > w - cut else hit
