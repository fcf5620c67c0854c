"""Snapshots of a request's per-slot KV (window rings, recurrent state) at token boundaries.

A prefix hit restores full-attention KV by sharing pages, but a ring or a recurrent state is
exact only at the position it was taken. So when a request publishes its prompt body and when it
retires, its slot is copied here, keyed by the exact tokens it holds; a later request whose
cached prefix reaches such a boundary restores the copy into its own slot and starts there (a
hit is cut back to the longest boundary it reaches). Least recently used snapshots go first.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from scheduler_proc.kv_cache import KVPool


class SlotSnapshots:
    def __init__(self, pool: KVPool, capacity: int) -> None:
        self.pool, self.capacity = pool, capacity
        # NOTE: keyed by (length, hash); the tokens themselves are kept to rule out collisions.
        self._store: OrderedDict[tuple[int, int], tuple[tuple[int, ...], list[mx.array]]] = (
            OrderedDict()
        )
        self.taken = 0
        self.restored = 0

    def __len__(self) -> int:
        return len(self._store)

    def take(self, slot: int, tokens: list[int]) -> list[mx.array] | None:
        """Copy the slot, which holds exactly `tokens`; queued, not waited for. Returns the
        copy (None: none is kept), which the disk tier writes beside the KV before it."""
        if not tokens or self.capacity <= 0:
            return None
        key = _key(tokens)
        if key in self._store:
            self._store.move_to_end(key)
            return self._store[key][1]
        arrays = self.pool.read_slot(slot)
        # NOTE: queued now, so no pending read keeps a buffer from being written in place.
        mx.async_eval(arrays)
        self.put(tokens, arrays)
        self.taken += 1
        return arrays

    def put(self, tokens: list[int], arrays: list[mx.array]) -> None:
        """Keep `arrays` as the snapshot of `tokens` (taken here, or read from disk)."""
        key = _key(tokens)
        self._store[key] = (tuple(tokens), arrays)
        self._store.move_to_end(key)
        while len(self._store) > self.capacity:
            self._store.popitem(last=False)

    def longest(self, tokens: list[int], limit: int) -> int:
        """The longest boundary `n <= limit` with a snapshot of `tokens[:n]` (0: none)."""
        for n in sorted({k[0] for k in self._store if k[0] <= limit}, reverse=True):
            entry = self._store.get(_key(tokens[:n]))
            if entry is not None and entry[0] == tuple(tokens[:n]):
                return n
        return 0

    def get(self, tokens: list[int]) -> list[mx.array] | None:
        """The snapshot of exactly `tokens` (None: none kept)."""
        entry = self._store.get(_key(tokens))
        return entry[1] if entry is not None and entry[0] == tuple(tokens) else None

    def clear(self) -> None:
        self._store.clear()

    def restore(self, slot: int, tokens: list[int]) -> None:
        key = _key(tokens)
        self._store.move_to_end(key)
        self.pool.write_slot(slot, self._store[key][1])
        self.restored += 1


def _key(tokens: list[int]) -> tuple[int, int]:
    return len(tokens), hash(tuple(tokens))
