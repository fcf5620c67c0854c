"""K/V storage of cached prefixes: per-layer buffers indexed by token slot, and a slot allocator.

Per layer the store holds `(1, kv_heads, size, dim)` keys and values, the shape `KVPool.read_row`
returns, so a span moves between a request's row and the store with one gather or one scatter per
layer. The two copies between a row and the store:
- admission: `load(pool, row, slots)` writes a cached prefix into positions `[0, n)` of a row;
- finish / abort: `save(pool, row, start, slots)` copies positions `[start, start + n)` of a row
  (the part not cached yet) into the store.
Both run only while no step is in flight, and evaluate their copies at once so neither buffer keeps
a pending reference that would make the next in-place write copy a whole buffer.
"""

from __future__ import annotations

import mlx.core as mx

from scheduler_proc.kv_cache import KVPool, LayerShape


class SlotAllocator:
    """Free list of token slots; frees of a free slot raise, so double frees cannot hide."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # NOTE: pop() hands out ascending runs
        self._used = bytearray(size)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"prefix store: {n} slots wanted, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        for s in slots:
            self._used[s] = 1
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if not self._used[s]:
                raise RuntimeError(f"prefix store: slot {s} freed twice")
            self._used[s] = 0
        self._free += slots


class PrefixStore:
    def __init__(self, shapes: list[LayerShape], size: int) -> None:
        self.shapes, self.size = shapes, size
        self.keys = [mx.zeros((1, s.kv_heads, size, s.k_dim), s.dtype) for s in shapes]
        self.values = [mx.zeros((1, s.kv_heads, size, s.v_dim), s.dtype) for s in shapes]
        mx.eval(self.keys, self.values)
        self.slots = SlotAllocator(size)
        # NOTE: whether a slot holds its token's K/V for the ring (window) layers too: a row's
        # ring keeps only its last positions, so older ones are stored for full layers only.
        self.window_ok = bytearray(size)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values, strict=True))

    def load(self, pool: KVPool, row: int, slots: list[int]) -> None:
        """Write the cached span `slots` into positions `[0, len(slots))` of a pool row."""
        if not slots:
            return
        idx = _index(slots)
        kv = [(k[:, :, idx], v[:, :, idx]) for k, v in zip(self.keys, self.values, strict=True)]
        mx.eval(kv)
        pool.load_prefix(row, kv)

    def save(
        self, pool: KVPool, row: int, start: int, slots: list[int], row_end: int | None = None
    ) -> None:
        """Copy positions `[start, start + len(slots))` of a pool row, whose tokens end at
        `row_end` (default: there), into the store's `slots`."""
        if not slots:
            return
        idx, end = _index(slots), start + len(slots)
        row_end = end if row_end is None else row_end
        for i in range(len(self.shapes)):
            src = (slice(row, row + 1), slice(None), pool.positions(i, start, end))
            self.keys[i][:, :, idx] = pool.keys[i][src]
            self.values[i][:, :, idx] = pool.values[i][src]
        rings = [r for r in pool.rings if r is not None]
        kept = row_end - min(rings) if rings else 0  # NOTE: first position every ring still holds
        for p, slot in zip(range(start, end), slots, strict=True):
            self.window_ok[slot] = p >= kept
        mx.eval(self.keys, self.values)


def _index(slots: list[int]) -> slice | mx.array:
    """A contiguous ascending run is a slice (a plain copy); anything else a gather index."""
    first = slots[0]
    if slots[-1] - first == len(slots) - 1 and slots == list(range(first, first + len(slots))):
        return slice(first, first + len(slots))
    return mx.array(slots, dtype=mx.int32)
