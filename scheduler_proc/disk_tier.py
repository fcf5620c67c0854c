"""The disk tier between the prefix cache and the pool: what goes to disk, and what comes back.

- **Out**: a request that retires with its KV cached (`KVManager.release`) queues its whole
  blocks that no file holds yet, locking their path in the tree so they are not evicted before
  they are read. Between steps (`Scheduler._settle`: nothing in flight) the queued blocks'
  K/V are gathered from the pool in one evaluation, unlocked, and handed to the writer thread.
  The gather waits for the device, but only for itself: no step is in flight then. Gathering
  while a step was queued would make that step's KV write copy the whole pool (a reader still
  pending on the buffer), as copies between steps once did (docs/kv_cache.md).
- **In**: a waiting request whose prompt continues past its cached prefix in blocks on disk
  waits out of the seating pass (like a grammar being built) while the loader thread reads them;
  then, with no step in flight, they are written into fresh pages and inserted into the tree, and
  the request is seated as usual: the blocks are a plain prefix hit (its `cached_tokens`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from scheduler_proc.disk_cache import BlockFormat, DiskCache
from scheduler_proc.kv_cache import KVPool, token_slots
from scheduler_proc.pages import PageAllocator
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.radix_cache import Node
from scheduler_proc.request import Req

log = logging.getLogger(__name__)

# NOTE: bounds on what the tier holds in memory: blocks gathered a break (a flood of agents
# finishing at once would otherwise gather gigabytes in one pause), blocks queued and locked in
# the tree, and one request's load (its next blocks load after these are in).
FLUSH_BYTES = 64 << 20
QUEUED_BYTES = 1 << 30
LOAD_BYTES = 256 << 20


@dataclass(eq=False)
class _Write:
    tokens: list[int]
    keys: list[bytes]
    blocks: list[int]
    node: Node  # its path locked in the tree until gathered


@dataclass(eq=False)
class DiskLoad:
    """A request's blocks `first .. first + n - 1` being read (`Req.disk`)."""

    keys: list[bytes]
    first: int
    n: int
    future: Future[list[list[np.ndarray]]]


def block_format(pool: KVPool, block_tokens: int) -> BlockFormat:
    """What a block of `pool`'s full-attention KV holds: its arrays as stored (K then V per
    layer; quantized, each one's codes, scales and biases)."""
    arrays = []
    for a in pool.paged_arrays():
        h, _, d = a.shape
        arrays.append((_dtype_name(a.dtype), (h, block_tokens, d)))
    return BlockFormat(block_tokens, tuple(arrays))


class DiskTier:
    def __init__(
        self,
        cache: DiskCache,
        pool: KVPool,
        prefix: PrefixCache,
        pages: PageAllocator,
        room: Callable[[int], bool],
    ) -> None:
        """`room(n)`: whether `n` pages are free, the pool grown or the cache evicted for them
        (`KVManager.room`)."""
        self.cache, self.pool, self.prefix, self.pages = cache, pool, prefix, pages
        self.room = room
        self.block = cache.block
        self._writes: list[_Write] = []
        self._load_blocks = max(1, LOAD_BYTES // cache.fmt.nbytes)

    # -- out ---------------------------------------------------------------------------------------
    def retired(self, tokens: list[int]) -> None:
        """`tokens` were just cached (a request retired): queue their blocks not on disk."""
        n = len(tokens) // self.block
        if n == 0:
            return
        keys = self.cache.keys(tokens, n)
        queued = {k for w in self._writes for k in (w.keys[b] for b in w.blocks)}
        blocks = [b for b in self.cache.wanted(keys) if keys[b] not in queued]
        if not blocks:
            return
        tokens = tokens[: n * self.block]
        node = self.prefix.tree.match_prefix(tokens).node
        self.prefix.tree.lock(node)
        self._writes.append(_Write(tokens, keys, blocks, node))
        while self._queued_blocks() * self.cache.fmt.nbytes > QUEUED_BYTES:
            dropped = self._writes.pop(0)
            self.prefix.tree.unlock(dropped.node)
            self.cache.dropped_blocks += len(dropped.blocks)

    def _queued_blocks(self) -> int:
        return sum(len(w.blocks) for w in self._writes)

    def flush(self) -> None:
        """Gather queued blocks (up to `FLUSH_BYTES`) and hand them to the writer; only while no
        step is in flight."""
        take: list[_Write] = []
        size = 0
        while self._writes and (not take or size < FLUSH_BYTES):
            job = self._writes.pop(0)
            take.append(job)
            size += len(job.blocks) * self.cache.fmt.nbytes
        if not take:
            return
        slots: list[int] = []
        b = self.block
        for job in take:
            m = self.prefix.tree.match_prefix(job.tokens)
            assert m.length == len(job.tokens), "a queued block left the tree while locked"
            for k in job.blocks:
                slots += m.slots[k * b : (k + 1) * b]
        arrays = [_host(a) for a in self.pool.read_tokens(slots)]
        at = 0
        for job in take:
            self.prefix.tree.unlock(job.node)
            blocks = {}
            for k in job.blocks:
                blocks[k] = [a[:, at : at + b] for a in arrays]
                at += b
            self.cache.store(job.tokens, job.keys, blocks)

    def drop_queued(self) -> None:
        """Queued blocks forgotten (the model changes: their KV is the old model's)."""
        for job in self._writes:
            self.prefix.tree.unlock(job.node)
        self._writes.clear()

    # -- in ----------------------------------------------------------------------------------------
    def waits(self, req: Req, in_flight: bool) -> bool:
        """Whether `req` waits for blocks of its prompt loading from disk; the first call for
        it starts the load when the disk holds blocks past its cached prefix."""
        if req.disk is None:
            return self._start(req)
        if not req.disk.future.done() or in_flight:
            return True
        load, req.disk = req.disk, None
        full = self._promote(req.fill_ids, load)
        req.disk_checked = not full  # NOTE: a load cut at `LOAD_BYTES`: the next ones follow
        return False

    def _start(self, req: Req) -> bool:
        if req.disk_checked or req.wants_prompt_logprobs:
            return False
        req.disk_checked = True
        limit = req.fill_len - 1  # NOTE: the last prompt token is computed, for its logits
        n = limit // self.block
        if n == 0:
            return False
        keys = self.cache.keys(req.fill_ids, n)
        cached = self.prefix.tree.match_prefix(req.fill_ids[:limit]).length
        first = cached // self.block
        count = min(self.cache.present(keys, first), self._load_blocks)
        if count == 0:
            return False
        future = self.cache.load(req.fill_ids, keys, first, count)
        req.disk = DiskLoad(keys, first, count, future)
        return True

    def _promote(self, tokens: list[int], load: DiskLoad) -> bool:
        """Write the loaded blocks into fresh pages and cache them; returns whether every block
        asked for came (a short load ends at a block that could not be used)."""
        try:
            blocks = load.future.result()
        except Exception:  # NOTE: the loader's failure is this load's, logged, not the engine's
            log.exception("KV disk cache: a load failed")
            return True
        b, tree = self.block, self.prefix.tree
        end = load.first + len(blocks)
        m = tree.match_prefix(tokens[: end * b])
        # NOTE: the tree may have changed while the blocks loaded: more cached (fewer blocks
        # needed), or less (evicted: the loaded blocks no longer follow a cached prefix)
        start = max(load.first, m.length // b)
        if m.length < load.first * b or end * b <= m.length:
            return len(blocks) == load.n
        tree.lock(m.node)  # NOTE: making room may evict; not the prefix the blocks follow
        try:
            self._write(tokens, m.slots[: start * b], blocks[start - load.first :], start, end)
        finally:
            tree.unlock(m.node)
        self.cache.hit_tokens += end * b - m.length
        return len(blocks) == load.n

    def _write(
        self, tokens: list[int], before: list[int], blocks: list, start: int, end: int
    ) -> None:
        b, p = self.block, self.pool.page_size
        n = (end - start) * b
        if not self.room(n // p):
            self.cache.dropped_blocks += end - start
            return
        new = self.pages.alloc(n // p)
        slots = token_slots(new, 0, n, p).tolist()
        parts = zip(*blocks, strict=True)  # NOTE: per array (layer's K or V), every block's
        self.pool.write_tokens(slots, [_device(np.concatenate(a, axis=1)) for a in parts])
        self.prefix.insert(tokens[: end * b], before + slots)
        self.pages.release(new)  # NOTE: the tree holds what it took; the rest is free again

    def stats(self) -> dict[str, int]:
        return {**self.cache.stats(), "kv_disk_queued_blocks": self._queued_blocks()}


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _host(a: mx.array) -> np.ndarray:
    """An evaluated array's bits in host memory (bfloat16 as uint16: numpy has no bfloat16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def _device(a: np.ndarray) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if a.dtype == np.uint16 else x
