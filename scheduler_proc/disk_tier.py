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
- **Snapshots** (models with window rings or recurrent state, whose hits end only where a
  snapshot of the slot exists): every snapshot the memory tier takes goes out with the blocks
  before it and the K/V of the tokens after the last whole one; a prompt loads the longest one
  its tokens reach, with those blocks, and is then a plain hit there. Blocks alone are of no use
  to such a model and are not written. A load is what the snapshot needs, not cut at
  `LOAD_BYTES`: part of it would be no hit at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from scheduler_proc.disk_cache import BlockFormat, DiskCache, HostArrays, Loaded
from scheduler_proc.kv_cache import KVPool, token_slots
from scheduler_proc.pages import PageAllocator
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.radix_cache import Match, Node
from scheduler_proc.request import Req
from scheduler_proc.snapshots import SlotSnapshots

log = logging.getLogger(__name__)

# NOTE: bounds on what the tier holds in memory: blocks gathered a break (a flood of agents
# finishing at once would otherwise gather gigabytes in one pause), blocks queued and locked in
# the tree, and one request's load (its next blocks load after these are in).
FLUSH_BYTES = 64 << 20
QUEUED_BYTES = 1 << 30
LOAD_BYTES = 256 << 20
# NOTE: while requests run, flushes take at most this share of the time. On CUDA the host copy
# of a gather is a synchronous copy into managed memory that steps in flight wait behind: 64
# agents on an H100 wanted ~7.5 GB of KV written in a ~10 s run (4.1 GB went out, the rest was
# dropped) and ran at 0.68x of the disk tier off, with 43 steps of 50-140 ms, when each flush
# copied 32 arrays on the step's thread. One copy a flush on the writer's thread (`HostCopy`)
# cuts a flush's cost ~3.5x; this pace bounds what is left. Blocks it holds back wait, locked
# and counted in QUEUED_BYTES (beyond it the oldest are dropped, as when the disk is behind).
# Not enough on a GPU: 64 agents ran at 0.50-0.83x of the tier off on an H200 and 0.60-0.97x
# on an H100, first tokens later; not the host copy nor the writes (a run with neither was no
# faster), nor a copied buffer going back to MLX's cache (docs/prefix_cache.md, "Not solved on
# a GPU").
FLUSH_SHARE = 0.05
CLAIMS_KEPT = 1024  # NOTE: claims on files being loaded, before finished owners' are dropped


@dataclass(eq=False)
class _Write:
    tokens: list[int]
    keys: list[bytes]
    blocks: list[int]
    node: Node  # its path locked in the tree until gathered
    snapshot: list[mx.array] | None = None  # the slot holding exactly `tokens`, to write too


@dataclass(eq=False)
class DiskLoad:
    """A request's blocks `first .. first + n - 1` being read (`Req.disk`), then the snapshot
    at `snapshot` tokens (0: none)."""

    keys: list[bytes]
    first: int
    n: int
    future: Future[Loaded]
    snapshot: int = 0
    claim: bytes = b""  # NOTE: its first file's key (`DiskTier._claimed`)
    asked: float = field(default_factory=time.monotonic)


def block_format(pool: KVPool, block_tokens: int) -> BlockFormat:
    """What a block of `pool`'s full-attention KV holds: its arrays as stored (K then V per
    layer; quantized, each one's codes, scales and biases); and a slot's snapshot's arrays."""
    arrays = []
    for a in pool.paged_arrays():
        h, _, d = a.shape
        arrays.append((_dtype_name(a.dtype), (h, block_tokens, d)))
    slots = tuple((_dtype_name(a.dtype), (1, *a.shape[1:])) for a in pool.slot_arrays())
    return BlockFormat(block_tokens, tuple(arrays), slots)


class DiskTier:
    def __init__(
        self,
        cache: DiskCache,
        pool: KVPool,
        prefix: PrefixCache,
        pages: PageAllocator,
        room: Callable[[int], bool],
        snapshots: SlotSnapshots | None = None,
    ) -> None:
        """`room(n)`: whether `n` pages are free, the pool grown or the cache evicted for them
        (`KVManager.room`); `snapshots`: the slots' snapshots, for models that have them."""
        self.cache, self.pool, self.prefix, self.pages = cache, pool, prefix, pages
        self.room, self.snapshots = room, snapshots
        self.block = cache.block
        self._writes: list[_Write] = []
        self._resume = 0.0  # NOTE: while busy, the next flush waits until then (`FLUSH_SHARE`)
        self._copy_s_per_byte = 0.0  # NOTE: the latest host copy's cost, a byte
        # NOTE: what the tier costs, for the stats: on the step's thread, flushes (the gathers)
        # and loads (into pages); on the writer's, host copies (on CUDA steps in flight may
        # wait behind them)
        self._flush_s = self._load_s = self._copy_s = 0.0
        self._flushes = 0
        self._load_blocks = max(1, LOAD_BYTES // cache.fmt.nbytes)
        # NOTE: the request loading each load's first file (its key): another waiting request
        # that would load it too waits for it instead (`_claimed`)
        self._loading: dict[bytes, Req] = {}

    # -- out ---------------------------------------------------------------------------------------
    def retired(self, tokens: list[int], snapshot: list[mx.array] | None = None) -> None:
        """`tokens` were just cached (a request retired, or published its prompt): queue their
        blocks not on disk; with slots, only behind a snapshot of the slot at `tokens`."""
        n = len(tokens) // self.block
        if self.snapshots is None:
            tokens = tokens[: n * self.block]
        elif snapshot is None:
            return
        keys = self.cache.keys(tokens, n)
        queued = {k for w in self._writes for k in (w.keys[b] for b in w.blocks)}
        blocks = [b for b in self.cache.wanted(keys) if keys[b] not in queued]
        if snapshot is not None:
            anchor = self.cache.anchor(keys, len(tokens))
            key = self.cache.snapshot_key(tokens, len(tokens), anchor)
            if not self.cache.wants_snapshot(anchor, len(tokens), key):
                snapshot = None
        if not blocks and snapshot is None:
            return
        m = self.prefix.tree.match_prefix(tokens)
        if m.length < len(tokens):
            return  # NOTE: a snapshot's shared prefix, evicted since (no request locks it)
        self.prefix.tree.lock(m.node)
        self._writes.append(_Write(tokens, keys, blocks, m.node, snapshot))
        while self._queued_bytes() > QUEUED_BYTES:
            dropped = self._writes.pop(0)
            self.prefix.tree.unlock(dropped.node)
            self.cache.dropped_blocks += len(dropped.blocks) + (dropped.snapshot is not None)

    def _queued_bytes(self) -> int:
        return sum(self._bytes(w) for w in self._writes)

    def _bytes(self, job: _Write) -> int:
        fmt = self.cache.fmt
        snap = fmt.snapshot_nbytes(len(job.tokens) % self.block) if job.snapshot else 0
        return len(job.blocks) * fmt.nbytes + snap

    def pending(self) -> bool:
        """Blocks queued, not yet handed to the writer."""
        return bool(self._writes)

    def flush(self, busy: bool = False) -> None:
        """Gather queued blocks (up to `FLUSH_BYTES`) and hand them to the writer; only while no
        step is in flight. `busy`: requests run, so flushes are paced to `FLUSH_SHARE` of the
        time (what a flush costs the steps: its gather here, its host copy on the writer's
        thread, measured)."""
        now = time.monotonic()
        if busy and now < self._resume:
            return
        take: list[_Write] = []
        size = 0
        while self._writes and (not take or size < FLUSH_BYTES):
            job = self._writes.pop(0)
            take.append(job)
            size += self._bytes(job)
        if not take:
            return
        slots: list[int] = []
        b = self.block
        for job in take:
            m = self.prefix.tree.match_prefix(job.tokens)
            assert m.length == len(job.tokens), "a queued block left the tree while locked"
            for k in job.blocks:
                slots += m.slots[k * b : (k + 1) * b]
            if job.snapshot is not None:  # NOTE: the tokens after the last whole block
                slots += m.slots[len(job.tokens) // b * b :]
        # NOTE: no slots (the blocks on disk, a snapshot at a block's end) reads each array
        # empty: such a snapshot's tail is its K/V of no tokens, as its format says
        gathered = self.pool.read_tokens(slots)
        states = [a for job in take if job.snapshot is not None for a in job.snapshot]
        host = HostCopy([*gathered, *states], self._copied)
        n = len(gathered)
        at, state_at = 0, n  # NOTE: tokens into the gathered arrays; the next state array
        for job in take:
            self.prefix.tree.unlock(job.node)
            blocks = {}
            for k in job.blocks:
                blocks[k] = host.part(range(n), at, at + b)
                at += b
            self.cache.store(job.tokens, job.keys, blocks)
            if job.snapshot is not None:
                tail = len(job.tokens) % b
                kv = host.part(range(n), at, at + tail)
                at += tail
                state = host.part(range(state_at, state_at + len(job.snapshot)))
                state_at += len(job.snapshot)
                anchor = self.cache.anchor(job.keys, len(job.tokens))
                self.cache.store_snapshot(job.tokens, len(job.tokens), anchor, _joined(kv, state))
        main = time.monotonic() - now
        self._flush_s += main
        self._flushes += 1
        spent = main + host.nbytes * self._copy_s_per_byte
        self._resume = now + spent / FLUSH_SHARE
        log.debug(
            "disk flush: %d blocks, %.1f MB, %.1f ms here, host copy %.2f ms/MB",
            sum(len(j.blocks) for j in take),
            host.nbytes / 1e6,
            main * 1e3,
            self._copy_s_per_byte * 1e9,
        )

    def _copied(self, nbytes: int, seconds: float) -> None:
        """A host copy's cost, measured on the writer's thread."""
        self._copy_s += seconds
        if nbytes:
            self._copy_s_per_byte = seconds / nbytes

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
        self._loading.pop(load.claim, None)
        t = time.monotonic()
        full = self._promote(req.fill_ids, load)
        into = time.monotonic() - t
        self._load_s += into
        log.debug(
            "disk load: %d blocks in %.1f ms since asked (read %.1f ms), %.1f ms into pages",
            load.n,
            (t - load.asked) * 1e3,
            _read_s(load) * 1e3,
            into * 1e3,
        )
        req.disk_checked = not full  # NOTE: a load cut at `LOAD_BYTES`: the next ones follow
        return False

    def _start(self, req: Req) -> bool:
        if req.disk_checked or req.wants_prompt_logprobs:
            return False
        req.disk_checked = True
        limit = req.fill_len - 1  # NOTE: the last prompt token is computed, for its logits
        n = limit // self.block
        if n == 0 and self.snapshots is None:
            return False
        keys = self.cache.keys(req.fill_ids, n)
        cached = self.prefix.tree.match_prefix(req.fill_ids[:limit]).length
        if self.snapshots is not None:
            return self._start_snapshot(req, keys, limit, cached)
        first = cached // self.block
        count = min(self.cache.present(keys, first), self._load_blocks)
        if count == 0:
            return False
        if self._claimed(req, keys[first]):
            return True
        future = self.cache.load(req.fill_ids, keys, first, count)
        req.disk = DiskLoad(keys, first, count, future, claim=keys[first])
        return True

    def _claimed(self, req: Req, key: bytes) -> bool:
        """Whether another waiting request is loading the file `key` (`req` then waits and
        asks again once those blocks are in: a burst of agents after a restart read their
        shared system prompt once each); else `req` claims it."""
        owner = self._loading.get(key)
        if owner is not None and owner is not req and _loading(owner):
            req.disk_checked = False
            return True
        if len(self._loading) >= CLAIMS_KEPT:  # NOTE: owners aborted while their files loaded
            self._loading = {k: r for k, r in self._loading.items() if _loading(r)}
        self._loading[key] = req
        return False

    def _start_snapshot(self, req: Req, keys: list[bytes], limit: int, cached: int) -> bool:
        """With slots: load the longest snapshot on disk past the hit memory holds (its
        longest snapshot within the cached prefix), with the blocks before it not cached."""
        assert self.snapshots is not None
        tokens, b = req.fill_ids, self.block
        hit = self.snapshots.longest(tokens, cached)
        for k in range(len(keys), -1, -1):
            if (k + 1) * b <= hit:
                return False  # NOTE: every snapshot from here on is within the hit
            anchor = keys[k - 1] if k else self.cache.anchor(keys, 0)
            for length, key in self.cache.snapshots(anchor):
                if not hit < length <= limit or key != self.cache.snapshot_key(
                    tokens, length, anchor
                ):
                    continue
                first = min(cached, length) // b
                if self.cache.present(keys, first) < k - first:
                    continue  # NOTE: a block before it is neither cached nor on disk
                claim = keys[first] if first < k else key
                if self._claimed(req, claim):
                    return True
                future = self.cache.load(tokens, keys, first, k - first, length)
                req.disk = DiskLoad(keys, first, k - first, future, length, claim)
                return True
        return False

    def _promote(self, tokens: list[int], load: DiskLoad) -> bool:
        """Write the loaded blocks into fresh pages and cache them; returns whether every block
        asked for came (a short load ends at a block that could not be used)."""
        try:
            loaded = load.future.result()
        except Exception:  # NOTE: the loader's failure is this load's, logged, not the engine's
            log.exception("KV disk cache: a load failed")
            return True
        if load.snapshot:
            self._promote_snapshot(tokens, load, loaded)
            return True
        blocks = loaded.blocks
        b, tree = self.block, self.prefix.tree
        end = load.first + len(blocks)
        m = tree.match_prefix(tokens[: end * b])
        # NOTE: the tree may have changed while the blocks loaded: more cached (fewer blocks
        # needed), or less (evicted: the loaded blocks no longer follow a cached prefix)
        start = max(load.first, m.length // b)
        if m.length < load.first * b or end * b <= m.length:
            return len(blocks) == load.n
        skip = (start - load.first) * b
        joined = [a[:, skip:] for a in loaded.joined]
        if self._write(tokens[: end * b], m, blocks[start - load.first :], start, joined):
            self.cache.hit_tokens += end * b - m.length
        return len(blocks) == load.n

    def _promote_snapshot(self, tokens: list[int], load: DiskLoad, loaded: Loaded) -> None:
        """Write the loaded blocks and the snapshot's tail into fresh pages, cache them and keep
        the slot's snapshot: a hit of `load.snapshot` tokens from here on."""
        assert self.snapshots is not None
        b, length = self.block, load.snapshot
        if len(loaded.blocks) < load.n or loaded.snapshot is None:
            return  # NOTE: a file skipped: no hit without every part
        m = self.prefix.tree.match_prefix(tokens[:length])
        if m.length < load.first * b:
            return  # NOTE: evicted while they loaded: the blocks follow nothing cached
        cut = len(self.cache.fmt.arrays)
        kv, state = loaded.snapshot[:cut], loaded.snapshot[cut:]
        start = max(load.first, m.length // b)
        if m.length < length:
            if not self._write(
                tokens[:length], m, [*loaded.blocks, kv][start - load.first :], start
            ):
                return
            self.cache.hit_tokens += length - m.length
        self.snapshots.put(tokens[:length], [_device(a) for a in state])

    def _write(
        self,
        tokens: list[int],
        m: Match,
        parts: list,
        start: int,
        joined: list[np.ndarray] | None = None,
    ) -> bool:
        """Write `parts` (blocks from `start`, the last one maybe a tail: fewer tokens) into
        fresh pages and cache `tokens` there after the cached prefix `m`; False when no page
        is free for them (counted as dropped). `joined`: the parts already joined per array
        (`Loaded.joined`), else they are joined here."""
        b, p, tree = self.block, self.pool.page_size, self.prefix.tree
        n = len(tokens) - start * b
        tree.lock(m.node)  # NOTE: making room may evict; not the prefix the blocks follow
        try:
            if not self.room(-(-n // p)):
                self.cache.dropped_blocks += len(parts)
                return False
            new = self.pages.alloc(-(-n // p))
            slots = token_slots(new, 0, n, p).tolist()
            if joined is None:  # NOTE: per array (a layer's K or V), every part's tokens
                joined = [np.concatenate(a, axis=1) for a in zip(*parts, strict=True)]
            self.pool.write_tokens(slots, [_device(a) for a in joined])
            self.prefix.insert(tokens, m.slots[: start * b] + slots)
            self.pages.release(new)  # NOTE: the tree holds what it took; the rest is free again
        finally:
            tree.unlock(m.node)
        return True

    def stats(self) -> dict[str, int | float]:
        queued = sum(len(w.blocks) + (w.snapshot is not None) for w in self._writes)
        return {
            **self.cache.stats(),
            "kv_disk_queued_blocks": queued,
            "kv_disk_flushes": self._flushes,
            "kv_disk_flush_s": self._flush_s,
            "kv_disk_load_s": self._load_s,
            "kv_disk_copy_s": self._copy_s,
        }


def _read_s(load: DiskLoad) -> float:
    done = load.future.exception() is None
    return load.future.result().read_s if done else 0.0


def _loading(req: Req) -> bool:
    return req.disk is not None and not req.finished


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


class HostCopy:
    """A flush's arrays as one device array, evaluated on the step's thread; brought to the host
    once, by the first file the writer makes from it, on the writer's thread.

    NOTE: on CUDA an array's host view is a synchronous copy into managed memory, which steps in
    flight wait behind. Made on the step's thread, 32 arrays a flush (64 MB) cost the steps
    ~32 ms a flush; one array's copy on the writer's thread ~9 ms (H100, a diagnosis script:
    chained steps of ~1 ms, a flush every 20). Metal and the CPU view the same memory (no copy).
    """

    def __init__(self, arrays: list[mx.array], copied: Callable[[int, float], None]) -> None:
        self._specs = [(_numpy_dtype(a.dtype), a.shape) for a in arrays]
        flat = [a.reshape(-1).view(mx.uint8) for a in arrays]
        self._device: mx.array | None = mx.concatenate(flat) if flat else mx.zeros((0,), mx.uint8)
        mx.eval(self._device)
        self.nbytes = self._device.nbytes
        self._host: list[np.ndarray] | None = None
        self._lock = threading.Lock()
        self._copied = copied

    def arrays(self) -> list[np.ndarray]:
        with self._lock:
            if self._host is None:
                assert self._device is not None
                t = time.perf_counter()
                raw = np.asarray(self._device)
                self._copied(self.nbytes, time.perf_counter() - t)
                self._device = None  # NOTE: the views below keep its memory
                self._host, at = [], 0
                for dtype, shape in self._specs:
                    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    self._host.append(raw[at : at + n].view(dtype).reshape(shape))
                    at += n
            return self._host

    def part(self, which: range, start: int = 0, end: int | None = None) -> HostArrays:
        """Arrays `which`, tokens `start:end` of each (all: `end` None), made when called."""

        def make() -> list[np.ndarray]:
            host = self.arrays()
            return [host[i] if end is None else host[i][:, start:end] for i in which]

        return make


def _joined(*parts: HostArrays) -> HostArrays:
    return lambda: [a for part in parts for a in part()]


def _numpy_dtype(dtype: mx.Dtype) -> np.dtype:
    """Where an MLX dtype's bits go in numpy (bfloat16 as uint16: numpy has no bfloat16)."""
    return np.dtype(np.uint16) if dtype == mx.bfloat16 else np.dtype(_dtype_name(dtype))


def _device(a: np.ndarray) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if a.dtype == np.uint16 else x
