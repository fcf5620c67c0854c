"""Which request holds which KV row; decoding rows first, then prefilling rows.

Invariant: rows `[0, n_decode)` hold decoding requests, rows `[n_decode, rows_in_use)` hold
prefilling ones, so a decode step reads `K[:n_decode]` as a slice. Admission appends a row;
retiring moves at most two rows (one row's copy each), never the batch.
Row moves only happen while no step is in flight (the scheduler guarantees it).
"""

from __future__ import annotations

import mlx.core as mx

from scheduler_proc.kv_cache import KVPool
from scheduler_proc.request import Req


class RowTable:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.reqs: list[Req] = []
        self.n_decode = 0

    @property
    def free_rows(self) -> int:
        return self.pool.rows - len(self.reqs)

    def decoding(self) -> list[Req]:
        return self.reqs[: self.n_decode]

    def prefilling(self) -> list[Req]:
        return self.reqs[self.n_decode :]

    def tokens_in_use(self) -> int:
        return sum(r.kv_len for r in self.reqs)

    def add(self, req: Req) -> None:
        req.row = self.pool.alloc()
        self.reqs.append(req)

    def promote(self, req: Req) -> None:
        """A prefilling request starts decoding: it joins the decode region."""
        assert req.row is not None and req.row >= self.n_decode
        self._swap(req.row, self.n_decode)
        self.n_decode += 1

    def release(self, req: Req) -> None:
        """Give the request's row back exactly once, keeping both regions compact."""
        row = req.row
        assert row is not None and self.reqs[row] is req, f"{req.rid}: row released twice"
        if row < self.n_decode:
            self._move(self.n_decode - 1, row)
            self.n_decode -= 1
            row = self.n_decode
        self._move(len(self.reqs) - 1, row)
        self.reqs.pop()
        self.pool.pop_row()
        req.row = None

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        req = self.reqs[src]
        self.pool.copy_row(src, dst, req.kv_len)
        self.reqs[dst], req.row = req, dst

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        ra, rb = self.reqs[a], self.reqs[b]
        kv_a, kv_b = self.pool.read_row(a, ra.kv_len), self.pool.read_row(b, rb.kv_len)
        st_a, st_b = self.pool.read_states(a), self.pool.read_states(b)
        mx.eval(kv_a, kv_b, st_a, st_b)
        self.pool.write_row(b, kv_a)
        self.pool.write_row(a, kv_b)
        self.pool.write_states(b, st_a)
        self.pool.write_states(a, st_b)
        self.reqs[a], self.reqs[b] = rb, ra
        ra.row, rb.row = b, a
