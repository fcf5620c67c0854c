"""The few array shapes a step may have: row counts, query widths and KV lengths in buckets.

A new shape costs compilation on CUDA (MLX builds cuDNN attention graphs and CUDA graphs per shape,
~50-100 ms each, measured), so there every forward's shape is rounded up to a ladder, and the
scheduler runs each rung once before READY (`Scheduler._warm_up`). Metal specialises its kernels by
dtype, head dim and alignment, not by sizes, and the CPU compiles nothing per shape: there padding
only costs work, so shapes are exact (`exact=True`; `backend.py`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# NOTE: fine steps where batches usually are, coarse above; a padded row costs one row of work.
_ROW_RUNGS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_MIN_KV = 32
_MIN_WIDTH = 16
# NOTE: a decode step's keys are rounded up to a multiple of this, not to a power of two: its
# attention reads every key it is given (B=64 x 600 keys on an H200: 10.9 ms read as 601 keys,
# 13.8 ms as 1024), and a new decode length compiles nothing (no cuDNN graph: one query row
# runs MLX's own kernels, whose size is a launch argument).
DECODE_KV_STEP = 32


def _powers(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return [*out, hi]


@dataclass(frozen=True)
class Ladders:
    rows: tuple[int, ...]  # forward rows (batch dimension)
    widths: tuple[int, ...]  # prefill query widths T
    kv: tuple[int, ...]  # keys read per row by a prefill step (warmed with every decode too)
    row_len: int  # the context: most keys a row reads
    exact: bool = False  # no padding: every pad_* returns its argument

    @classmethod
    def for_pool(cls, slots: int, context: int, chunk: int, exact: bool = False) -> Ladders:
        """Rungs up to what the pool can hold: `slots` running requests of `context` tokens."""
        row_rungs = tuple(r for r in _ROW_RUNGS if r < slots) + (slots,)
        widest = min(chunk, context)
        return cls(
            rows=row_rungs,
            widths=tuple(_powers(min(_MIN_WIDTH, widest), widest)),
            kv=tuple(_powers(min(_MIN_KV, context), context)),
            row_len=context,
            exact=exact,
        )

    def pad_rows(self, n: int) -> int:
        return self._ceil(self.rows, n)

    def pad_width(self, n: int) -> int:
        return self._ceil(self.widths, n)

    def pad_kv(self, n: int) -> int:
        return self._ceil(self.kv, n)

    def pad_decode_kv(self, n: int) -> int:
        if n > self.row_len:
            raise ValueError(f"{n} keys is beyond the row length {self.row_len}")
        if self.exact:
            return n
        return min(-(-n // DECODE_KV_STEP) * DECODE_KV_STEP, self.row_len)

    def _ceil(self, rungs: tuple[int, ...], n: int) -> int:
        up = _ceil(rungs, n)  # NOTE: checks the bound in exact mode too
        return n if self.exact else up


def _ceil(rungs: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(rungs, n)
    if i == len(rungs):
        raise ValueError(f"{n} is beyond the largest shape bucket {rungs[-1]}")
    return rungs[i]
