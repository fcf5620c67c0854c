"""Slot KV cache: preallocated per-layer K/V buffers, one row per running request.

Storage is `(rows, kv_heads, row_len, head_dim)` per layer, allocated once. Rows in use are kept
compact (`[0, rows_in_use)`), so a batched step reads `K[:B, :, :L]` as a slice. The per-layer
`LayerCache` objects speak mlx-lm's cache protocol (`update_and_fetch`, `offset`, `make_mask`), so
mlx-lm models run on it unpatched. See docs/kv_cache.md for the decision and its measurements.

Allocation API (used by the scheduler and the prefix cache):
`alloc() -> row`, `copy_row(src, dst)`, `pop_row()`, `read_row(row, end)`, `write_row(row, kv)`.
Views select what the step's one forward touches: `row_view(row, start)` (one row, int offset:
mlx-lm's own single-stream path) or `ragged_view(plan, kv_len)` (a padded batch of rows, each
with its own start and number of real tokens: every decode row and prefill chunk of a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from engine.errors import ModelError


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype


def bytes_per_token(shapes: list[LayerShape]) -> int:
    return sum(s.kv_heads * (s.k_dim + s.v_dim) * s.dtype.size for s in shapes)


class _RowView:
    """One row at an int offset, no padding: exactly mlx-lm's single-stream KVCache path."""

    def __init__(self, row: int, start: int) -> None:
        self.row, self.offset = row, start

    def write(self, buf: mx.array, new: mx.array) -> mx.array:
        r, s = self.row, self.offset
        buf[r : r + 1, :, s : s + new.shape[2]] = new
        return buf

    def read(self, buf: mx.array, n: int) -> mx.array:
        return buf[self.row : self.row + 1, :, : self.offset + n]

    def mask(self, n: int, return_array: bool, window_size: int | None):
        return mlx_cache.create_attention_mask(n, self.offset, return_array, window_size)


class _RaggedView:
    """A padded batch of R rows x T query positions over the pool, for one forward.

    Row i of the forward holds `lengths[i]` real tokens (0 for a pad row) at positions
    `starts[i]:starts[i] + lengths[i]` of pool row `rows[i]`. Real tokens are written in place with
    one scatter; padding is written to the scratch row, so no row in use ever sees it. Attention
    reads keys `[0, kv_len)` (a bucketed length) of the rows: a slice when they are `[0, R)` (a
    decode step), a gather otherwise (a prefill step, where the gather is small next to the work).
    """

    def __init__(self, plan: StepRows, scratch: int, kv_len: int) -> None:
        self.length = kv_len
        t = plan.width
        self.offset = mx.array(plan.starts, dtype=mx.int32)
        self._read_rows = plan.read_rows()
        rows, pos = plan.write_index(scratch)
        self._write = (mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32))
        self._t = t
        self._mask: mx.array | None = None

    def write(self, buf: mx.array, new: mx.array) -> mx.array:
        rows, pos = self._write
        # NOTE: (R, kv_heads, T, dim) -> (R, T, kv_heads, dim), the shape of buf[rows, :, pos].
        buf[rows, :, pos] = new.transpose(0, 2, 1, 3)
        return buf

    def read(self, buf: mx.array, n: int) -> mx.array:
        return buf[self._read_rows, :, : self.length]

    def mask(self, n: int, return_array: bool, window_size: int | None) -> mx.array:
        if self._mask is None:
            self._mask = ragged_mask(self.offset, self._t, self.length, window_size)
        return self._mask


def ragged_mask(starts: mx.array, width: int, kv_len: int, window: int | None) -> mx.array:
    """(R, 1, T, L): query t of row r (at position starts[r] + t) sees keys up to its own."""
    keys = mx.arange(kv_len)[None, None]
    query = (starts[:, None] + mx.arange(width)[None])[:, :, None]
    visible = keys <= query
    if window is not None:
        visible = visible & (keys > query - window)
    return visible[:, None]


@dataclass(frozen=True)
class StepRows:
    """Which pool rows a forward covers and where each row's tokens go (host-side plan)."""

    rows: list[int]  # pool row of each forward row (pad rows: any row, never written)
    starts: list[int]  # position of each row's first token
    lengths: list[int]  # real tokens per row; 0 for a pad row
    width: int  # T, the padded query length

    def read_rows(self) -> slice | mx.array:
        n = len(self.rows)
        if self.rows == list(range(n)):
            return slice(0, n)
        return mx.array(self.rows, dtype=mx.int32)

    def write_index(self, scratch: int) -> tuple[list[list[int]], list[list[int]]]:
        rows, pos = [], []
        for row, start, n in zip(self.rows, self.starts, self.lengths, strict=True):
            rows.append([row] * n + [scratch] * (self.width - n))
            pos.append([start + t for t in range(n)] + list(range(n, self.width)))
        return rows, pos


class LayerCache:
    """What a model layer sees: mlx-lm's cache protocol over one layer of the pool."""

    def __init__(self, pool: KVPool, layer: int) -> None:
        self._pool, self._layer = pool, layer

    @property
    def offset(self):
        return self._pool.view.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._pool.update(self._layer, keys, values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return self._pool.view.mask(N, return_array, window_size)


class KVPool:
    """Per-layer K/V buffers of `rows` rows of `row_len` tokens, rows in use kept compact."""

    def __init__(self, shapes: list[LayerShape], rows: int, row_len: int) -> None:
        self.shapes, self.rows, self.row_len = shapes, rows, row_len
        # NOTE: one row more than requests can hold: the scratch row takes a padded forward's
        # padding writes, so they never touch a row in use.
        self.scratch = rows
        n = rows + 1
        self.keys = [mx.zeros((n, s.kv_heads, row_len, s.k_dim), s.dtype) for s in shapes]
        self.values = [mx.zeros((n, s.kv_heads, row_len, s.v_dim), s.dtype) for s in shapes]
        mx.eval(self.keys, self.values)
        self.rows_in_use = 0
        self.view: _RowView | _RaggedView | None = None
        self.layers = [LayerCache(self, i) for i in range(len(shapes))]

    @property
    def nbytes(self) -> int:
        return (self.rows + 1) * self.row_len * bytes_per_token(self.shapes)

    # -- allocation --------------------------------------------------------------------------
    def alloc(self) -> int:
        if self.rows_in_use >= self.rows:
            raise RuntimeError("KV pool has no free row")
        self.rows_in_use += 1
        return self.rows_in_use - 1

    def pop_row(self) -> None:
        """Release the last row in use (the scheduler moves a row into a hole first)."""
        if self.rows_in_use <= 0:
            raise RuntimeError("KV pool: release of a row not in use")
        self.rows_in_use -= 1

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` tokens of row `src` into row `dst`: one row's copy."""
        if src == dst or length <= 0:
            return
        kv = self.read_row(src, length)
        # NOTE: materialise the row first so the buffer stays donatable: a pending slice of the
        # buffer would make the write below copy the whole batch's KV.
        mx.eval(kv)
        self.write_row(dst, kv)

    def read_row(self, row: int, end: int) -> list[tuple[mx.array, mx.array]]:
        sl = (slice(row, row + 1), slice(None), slice(0, end))
        return [(mx.contiguous(k[sl]), mx.contiguous(v[sl])) for k, v in self._pairs()]

    def write_row(self, row: int, kv: list[tuple[mx.array, mx.array]], start: int = 0) -> None:
        for i, (k, v) in enumerate(kv):
            end = start + k.shape[2]
            if end == start:
                continue
            self.keys[i][row : row + 1, :, start:end] = k
            self.values[i][row : row + 1, :, start:end] = v

    def _pairs(self):
        return zip(self.keys, self.values, strict=True)

    # -- forward views -----------------------------------------------------------------------
    def row_view(self, row: int, start: int) -> list[LayerCache]:
        """One row, tokens at `start:`, int offset (a single stream's step)."""
        self.view = _RowView(row, start)
        return self.layers

    def ragged_view(self, plan: StepRows, kv_len: int) -> list[LayerCache]:
        """A padded batch of rows (see `_RaggedView`); `kv_len` keys are read per row."""
        self.view = _RaggedView(plan, self.scratch, kv_len)
        return self.layers

    def update(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        view = self.view
        self.keys[layer] = view.write(self.keys[layer], k)
        self.values[layer] = view.write(self.values[layer], v)
        n = k.shape[2]
        return view.read(self.keys[layer], n), view.read(self.values[layer], n)

    def state(self) -> list[mx.array]:
        """Every buffer, for `mx.async_eval` alongside a step's outputs."""
        return [*self.keys, *self.values]


class _ShapeProbe:
    """A one-token forward through this records each layer's K/V shape and dtype."""

    offset = 0

    def __init__(self) -> None:
        self.shape: LayerShape | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.shape = LayerShape(keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None


def probe_model(model) -> tuple[list[LayerShape], int]:
    """K/V shapes of every layer and the vocabulary size; refuses non-attention caches."""
    if hasattr(model, "make_cache"):
        kinds = {type(c) for c in model.make_cache()}
        if kinds - {mlx_cache.KVCache}:
            names = ", ".join(sorted(k.__name__ for k in kinds))
            raise ModelError(f"unsupported cache types for the slot KV cache: {names}")
    probes = [_ShapeProbe() for _ in model.layers]
    logits = model(mx.array([[0]]), cache=probes)
    mx.eval(logits)
    if any(p.shape is None for p in probes):
        raise ModelError("a layer did not call cache.update_and_fetch")
    return [p.shape for p in probes], logits.shape[-1]
