"""Row KV pool: preallocated per-layer K/V buffers, one row per running request.

Storage is `(rows, kv_heads, row_len, head_dim)` per layer, allocated once. Rows in use are kept
compact (`[0, rows_in_use)`), so a batched step reads `K[:B, :, :L]` as a slice. The per-layer
`LayerCache` objects speak mlx-lm's cache protocol (`update_and_fetch`, `offset`, `make_mask`), so
mlx-lm models run on it unpatched. See docs/kv_cache.md for the decision and its measurements.

Per-layer kinds, from the model's own `make_cache()` (docs/models.md): full attention (`KVCache`),
sliding-window attention (`RotatingKVCache`: the row keeps every token, the layer attends to its last
`window`) and recurrent state (`ArraysCache`: linear attention, Mamba, short convolutions: a
fixed-size state per row, gathered for the step's rows and scattered back, zeroed on admission).

Allocation API (used by the scheduler and the prefix cache):
`alloc() -> row`, `copy_row(src, dst)`, `pop_row()`, `read_row(row, end)`, `write_row(row, kv)`.
Views select what the step's one forward touches: `row_view(row, start)` (one row, int offset:
mlx-lm's own single-stream path) or `ragged_view(plan, kv_len)` (a padded batch of rows, each
with its own start and number of real tokens: every decode row and prefill chunk of a step).
"""

from __future__ import annotations

import math
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
    window: int | None = None  # a sliding-window layer attends to its last `window` tokens


@dataclass(frozen=True)
class StateShape:
    """A recurrent layer's state per row: one array per entry, shapes without the batch axis."""

    arrays: tuple[tuple[tuple[int, ...], mx.Dtype], ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.size for shape, dtype in self.arrays)


@dataclass(frozen=True)
class Layout:
    """The model's cache list, in its order: `("kv", i)` or `("state", j)` for each entry."""

    entries: tuple[tuple[str, int], ...]
    kv: tuple[LayerShape, ...]
    states: tuple[StateShape, ...] = ()

    @classmethod
    def attention_only(cls, shapes: list[LayerShape]) -> Layout:
        return cls(tuple(("kv", i) for i in range(len(shapes))), tuple(shapes))

    @property
    def state_bytes_per_row(self) -> int:
        return sum(s.nbytes for s in self.states)


def bytes_per_token(shapes: list[LayerShape] | tuple[LayerShape, ...]) -> int:
    return sum(s.kv_heads * (s.k_dim + s.v_dim) * s.dtype.size for s in shapes)


class _RowView:
    """One row at an int offset, no padding: exactly mlx-lm's single-stream KVCache path."""

    lengths = None  # NOTE: no padding, so recurrent layers take mlx-lm's unmasked path

    def __init__(self, row: int, start: int) -> None:
        self.row, self.offset = row, start
        self.state_rows = self.state_write = slice(row, row + 1)

    def write(self, buf: mx.array, new: mx.array, ring: int | None) -> mx.array:
        r, s = self.row, self.offset
        if ring is not None:
            assert new.shape[2] == 1, "a lone row writes one token"
            s %= ring
        buf[r : r + 1, :, s : s + new.shape[2]] = new
        return buf

    def read(self, buf: mx.array, n: int, window: int | None, ring: int | None) -> mx.array:
        end = self.offset + n
        if ring is not None:
            return buf[self.row : self.row + 1, :, : min(end, ring)]
        # NOTE: mlx-lm asks no mask of a one-token query; a window layer then must be handed only
        # its last `window` keys, as mlx-lm's RotatingKVCache holds.
        start = max(0, end - window) if window is not None and n == 1 else 0
        return buf[self.row : self.row + 1, :, start:end]

    def mask(self, n: int, return_array: bool, window_size: int | None, ring: int | None = None):
        if ring is not None:
            end = self.offset + n
            if end <= window_size:
                return None  # NOTE: every key read is in the window
            ends = mx.array([end], dtype=mx.int32)
            starts = mx.array([self.offset], dtype=mx.int32)
            return ring_mask(starts, ends, n, min(end, ring), ring, window_size)
        if n == 1:
            return None  # NOTE: a window layer reads only its window (`read`)
        return mlx_cache.create_attention_mask(n, self.offset, return_array, window_size)

    def ssm_mask(self, n: int) -> None:
        return None


class _RaggedView:
    """A padded batch of R rows x T query positions over the pool, for one forward.

    Row i of the forward holds `lengths[i]` real tokens (0 for a pad row) at positions
    `starts[i]:starts[i] + lengths[i]` of pool row `rows[i]`. Real tokens are written in place with
    one scatter; padding is written to the scratch row, so no row in use ever sees it. Attention
    reads keys `[0, kv_len)` (a bucketed length) of the rows: a slice when they are `[0, R)` (a
    decode step), a gather otherwise (a prefill step, where the gather is small next to the work).

    `fused` (a decode step on CUDA, `scheduler_proc.decode_attention`): full-attention layers hand
    attention the whole buffers and each row's key count instead of a slice and a mask.
    """

    def __init__(self, plan: StepRows, scratch: int, kv_len: int, fused: bool = False) -> None:
        self.length = kv_len
        t = plan.width
        self.offset = mx.array(plan.starts, dtype=mx.int32)
        self._read_rows = plan.read_rows()
        rows, pos = plan.write_index(scratch)
        self._write = (mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32))
        self._t = t
        self._ends = self.offset + mx.array(plan.lengths, dtype=mx.int32)
        self._masks: dict[tuple[int | None, int | None], mx.array] = {}
        self._ring_pos: dict[int, mx.array] = {}
        # NOTE: recurrent state: read for every forward row, written back only for rows with real
        # tokens (pad rows write the scratch row); `lengths` tells the model's conv / scan which
        # positions are real, so padding never updates a row's state.
        self.state_rows = self._read_rows
        self.state_write = mx.array(
            [r if n else scratch for r, n in zip(plan.rows, plan.lengths, strict=True)], mx.int32
        )
        padded = any(n < t for n in plan.lengths)
        self.lengths = mx.array(plan.lengths, dtype=mx.int32) if padded else None
        # NOTE: the kernel reads row b of the step from pool row b: decode rows are [0, R).
        reads_first_rows = isinstance(self._read_rows, slice) and self._read_rows.start == 0
        self.fused = fused and t == 1 and reads_first_rows

    def write(self, buf: mx.array, new: mx.array, ring: int | None) -> mx.array:
        rows, pos = self._write
        if ring is not None:
            # NOTE: scratch positions are below the width, itself at most the ring: unchanged.
            if ring not in self._ring_pos:
                self._ring_pos[ring] = pos % ring
            pos = self._ring_pos[ring]
        # NOTE: (R, kv_heads, T, dim) -> (R, T, kv_heads, dim), the shape of buf[rows, :, pos].
        buf[rows, :, pos] = new.transpose(0, 2, 1, 3)
        return buf

    def read(self, buf: mx.array, n: int, window: int | None, ring: int | None) -> mx.array:
        if self.fused and window is None:
            return buf  # NOTE: `fused_ends` bounds each row's keys
        keys = self.length if ring is None else min(ring, self.length)
        # NOTE: slice the keys first, then pick the rows: `buf[rows, :, :keys]` gathers whole
        # rows before slicing (CPU, 11 rows of a 4096-token pool: 18 ms per layer vs 0.3 ms).
        return buf[:, :, :keys][self._read_rows]

    def fused_ends(self, window: int | None) -> tuple[mx.array, int] | None:
        """Keys per row for a fused full-attention layer, and a host bound on them (None: the
        layer takes the mask)."""
        return (self._ends, self.length) if self.fused and window is None else None

    def mask(
        self, n: int, return_array: bool, window_size: int | None, ring: int | None = None
    ) -> mx.array:
        if self.fused and window_size is None:
            return None  # NOTE: unused: the fused kernel bounds each row by its length
        # NOTE: one mask per window size: a model with sliding and full layers asks for both.
        key = (window_size, ring)
        if key not in self._masks:
            if ring is None:
                mask = ragged_mask(self.offset, self._t, self.length, window_size)
            else:
                keys = min(ring, self.length)
                mask = ring_mask(self.offset, self._ends, self._t, keys, ring, window_size)
            self._masks[key] = mask
        return self._masks[key]

    def ssm_mask(self, n: int) -> mx.array | None:
        if self.lengths is None:
            return None
        return mx.arange(n)[None] < self.lengths[:, None]


def ragged_mask(starts: mx.array, width: int, kv_len: int, window: int | None) -> mx.array:
    """(R, 1, T, L): query t of row r (at position starts[r] + t) sees keys up to its own."""
    keys = mx.arange(kv_len)[None, None]
    query = (starts[:, None] + mx.arange(width)[None])[:, :, None]
    visible = keys <= query
    if window is not None:
        visible = visible & (keys > query - window)
    return visible[:, None]


def ring_mask(
    starts: mx.array, ends: mx.array, width: int, keys: int, ring: int, window: int
) -> mx.array:
    """(R, 1, T, keys) over a window layer's ring of `ring` entries (position p in entry p % ring).

    After the step's writes, entry j of a row ending at `e` holds position
    `e - 1 - ((e - 1 - j) mod ring)` (negative: never written); query t (at `starts + t`) sees
    the positions in its window up to its own. Padding queries see what the row's last real token
    sees, so no query row of the mask is empty.
    """
    e = mx.maximum(ends, 1)[:, None]
    pos = e - 1 - ((e - 1 - mx.arange(keys)[None]) % ring)
    query = mx.minimum(starts[:, None] + mx.arange(width)[None], e - 1)
    p, q = pos[:, None, :], query[:, :, None]
    visible = (p >= 0) & (p <= q) & (p > q - window)
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
        self._window = pool.shapes[layer].window
        self._ring = pool.rings[layer]

    @property
    def offset(self):
        return self._pool.view.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._pool.update(self._layer, keys, values)

    def fused_lengths(self) -> tuple[mx.array, int] | None:
        """Keys per row (and their host bound) when this layer's attention runs the fused decode
        (`decode_attention`)."""
        ends = getattr(self._pool.view, "fused_ends", None)
        return ends(self._window) if ends is not None else None

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # NOTE: as mlx-lm's RotatingKVCache: a window layer's mask has its window even when the
        # model does not name one.
        if self._ring is not None:
            return self._pool.view.mask(N, return_array, self._window, self._ring)
        return self._pool.view.mask(N, return_array, window_size or self._window)


class StateCache:
    """What a recurrent layer sees: mlx-lm's `ArraysCache` protocol over the pool's state rows.

    `cache[i]` is entry i's state for the forward's rows; assigning it writes the rows back.
    """

    def __init__(self, pool: KVPool, index: int) -> None:
        self._pool, self._index = pool, index

    def __getitem__(self, i: int) -> mx.array:
        return self._pool.states[self._index][i][self._pool.view.state_rows]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self._pool.write_state(self._index, i, value)

    def __bool__(self) -> bool:  # NOTE: models test `if cache:`
        return True

    @property
    def lengths(self) -> mx.array | None:
        return self._pool.view.lengths

    def advance(self, n: int) -> None:
        """NOTE: nothing to count: each step's view says where every row's tokens are."""

    def make_mask(self, N: int) -> mx.array | None:
        return self._pool.view.ssm_mask(N)


# NOTE: what the model sees for one entry of its cache list (attention K/V or recurrent state).
EntryCache = LayerCache | StateCache


class KVPool:
    """Per-layer K/V buffers of `rows` rows of `row_len` tokens, rows in use kept compact."""

    def __init__(
        self,
        shapes: list[LayerShape],
        rows: int,
        row_len: int,
        layout: Layout | None = None,
        chunk: int | None = None,
    ) -> None:
        self.shapes, self.rows, self.row_len = list(shapes), rows, row_len
        self.layout = layout or Layout.attention_only(self.shapes)
        # NOTE: a window layer keeps a ring of `window + chunk - 1` entries when that is shorter
        # than the row: a step's widest chunk (`chunk` tokens) then never overwrites a key one
        # of its own queries still needs. Without `chunk` every layer keeps the whole row.
        self.rings = [ring_size(s.window, chunk, row_len) for s in self.shapes]
        # NOTE: one row more than requests can hold: the scratch row takes a padded forward's
        # padding writes, so they never touch a row in use.
        self.scratch = rows
        n = rows + 1
        lens = [ring or row_len for ring in self.rings]
        self.keys = [
            mx.zeros((n, s.kv_heads, ln, s.k_dim), s.dtype)
            for s, ln in zip(shapes, lens, strict=True)
        ]
        self.values = [
            mx.zeros((n, s.kv_heads, ln, s.v_dim), s.dtype)
            for s, ln in zip(shapes, lens, strict=True)
        ]
        self.states = [
            [mx.zeros((n, *shape), dtype) for shape, dtype in st.arrays]
            for st in self.layout.states
        ]
        mx.eval(self.keys, self.values, self.states)
        self.rows_in_use = 0
        self.view: _RowView | _RaggedView | None = None
        # NOTE: one cache object per entry of the model's own cache list, in its order.
        self.layers = [
            LayerCache(self, i) if kind == "kv" else StateCache(self, i)
            for kind, i in self.layout.entries
        ]

    @property
    def nbytes(self) -> int:
        kv = sum(k.nbytes + v.nbytes for k, v in self._pairs())
        return kv + (self.rows + 1) * self.layout.state_bytes_per_row

    @property
    def ring_window(self) -> int | None:
        """The widest window kept in a ring (None: no ring layer): a prefix hit needs its
        last `ring_window` tokens present in the store for every ring layer."""
        windows = [s.window for s, r in zip(self.shapes, self.rings, strict=True) if r]
        return max(windows) if windows else None

    # -- allocation --------------------------------------------------------------------------
    def alloc(self) -> int:
        if self.rows_in_use >= self.rows:
            raise RuntimeError("KV pool has no free row")
        self.rows_in_use += 1
        row = self.rows_in_use - 1
        self.reset_states(row)
        return row

    def pop_row(self) -> None:
        """Release the last row in use (the scheduler moves a row into a hole first)."""
        if self.rows_in_use <= 0:
            raise RuntimeError("KV pool: release of a row not in use")
        self.rows_in_use -= 1

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` tokens of row `src` into row `dst`: one row's copy."""
        # NOTE: a row with no tokens yet still has a state to move (zeros, from admission).
        if src == dst:
            return
        kv, states = self.read_row(src, max(0, length)), self.read_states(src)
        # NOTE: materialise the row first so the buffer stays donatable: a pending slice of the
        # buffer would make the write below copy the whole batch's KV.
        mx.eval(kv, states)
        self.write_row(dst, kv)
        self.write_states(dst, states)

    def read_row(self, row: int, end: int) -> list[tuple[mx.array, mx.array]]:
        """The row's first `end` tokens per layer; a ring layer's entries as they are (at most
        its ring), which `write_row` puts back at the same entries."""
        out = []
        for k, v in self._pairs():
            sl = (slice(row, row + 1), slice(None), slice(0, min(end, k.shape[2])))
            out.append((mx.contiguous(k[sl]), mx.contiguous(v[sl])))
        return out

    def load_prefix(self, row: int, kv: list[tuple[mx.array, mx.array]]) -> None:
        """Write a cached prefix (every token of it, per layer) as positions `[0, n)` of a row;
        a ring layer takes only the positions its ring holds."""
        for i, (k, v) in enumerate(kv):
            ring, n = self.rings[i], k.shape[2]
            if ring is None or n <= ring:
                self.keys[i][row : row + 1, :, :n] = k
                self.values[i][row : row + 1, :, :n] = v
                continue
            idx = mx.array([p % ring for p in range(n - ring, n)], dtype=mx.int32)
            self.keys[i][row : row + 1, :, idx] = k[:, :, n - ring :]
            self.values[i][row : row + 1, :, idx] = v[:, :, n - ring :]

    def positions(self, layer: int, start: int, end: int) -> slice | mx.array:
        """Where positions `[start, end)` of a row sit in a layer's buffer."""
        ring = self.rings[layer]
        if ring is None or end <= ring:
            return slice(start, end)
        return mx.array([p % ring for p in range(start, end)], dtype=mx.int32)

    def write_row(self, row: int, kv: list[tuple[mx.array, mx.array]], start: int = 0) -> None:
        for i, (k, v) in enumerate(kv):
            end = start + k.shape[2]
            if end == start:
                continue
            self.keys[i][row : row + 1, :, start:end] = k
            self.values[i][row : row + 1, :, start:end] = v

    def read_states(self, row: int) -> list[list[mx.array]]:
        """A row's recurrent state (contiguous copies), per state layer and entry."""
        return [[mx.contiguous(a[row : row + 1]) for a in layer] for layer in self.states]

    def write_states(self, row: int, states: list[list[mx.array]]) -> None:
        for layer, new in zip(self.states, states, strict=True):
            for a, v in zip(layer, new, strict=True):
                a[row : row + 1] = v

    def reset_states(self, row: int) -> None:
        """A new request's state is zero, what mlx-lm's models start from with an empty cache."""
        for layer in self.states:
            for a in layer:
                a[row : row + 1] = 0

    def write_state(self, layer: int, entry: int, value: mx.array) -> None:
        buf = self.states[layer][entry]
        buf[self.view.state_write] = value.astype(buf.dtype)
        self.states[layer][entry] = buf

    def _pairs(self):
        return zip(self.keys, self.values, strict=True)

    # -- forward views -----------------------------------------------------------------------
    def row_view(self, row: int, start: int) -> list[EntryCache]:
        """One row, tokens at `start:`, int offset (a single stream's step)."""
        self.view = _RowView(row, start)
        return self.layers

    def ragged_view(self, plan: StepRows, kv_len: int, fused: bool = False) -> list[EntryCache]:
        """A padded batch of rows (see `_RaggedView`); `kv_len` keys are read per row."""
        self.view = _RaggedView(plan, self.scratch, kv_len, fused)
        return self.layers

    def update(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        view = self.view
        ring = self.rings[layer]
        self.keys[layer] = view.write(self.keys[layer], k, ring)
        self.values[layer] = view.write(self.values[layer], v, ring)
        n, window, ring = k.shape[2], self.shapes[layer].window, self.rings[layer]
        return (
            view.read(self.keys[layer], n, window, ring),
            view.read(self.values[layer], n, window, ring),
        )

    def state(self) -> list[mx.array]:
        """Every buffer, for `mx.async_eval` alongside a step's outputs."""
        return [*self.keys, *self.values, *(a for layer in self.states for a in layer)]


def ring_size(window: int | None, chunk: int | None, row_len: int) -> int | None:
    """Entries of a window layer's ring, or None when the layer keeps the whole row."""
    if window is None or chunk is None:
        return None
    ring = window + chunk - 1
    return ring if ring < row_len else None


class _ShapeProbe:
    """A one-token forward through this records an attention layer's K/V shape and dtype."""

    offset = 0

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.shape: LayerShape | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = keys.shape, values.shape
        self.shape = LayerShape(k[1], k[3], v[3], keys.dtype, self.window)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None


class _StateProbe:
    """A one-token forward through this records a recurrent layer's state shapes (batch 1)."""

    lengths = None

    def __init__(self, size: int) -> None:
        self.arrays: list[tuple[tuple[int, ...], mx.Dtype] | None] = [None] * size

    def __getitem__(self, i: int) -> None:
        return None  # NOTE: an empty cache: the model starts from a zero state

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.arrays[i] = (tuple(value.shape[1:]), value.dtype)

    def __bool__(self) -> bool:
        return True

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, N: int) -> None:
        return None


def _probe_for(cache):
    """The probe for one entry of the model's cache list; None for a kind the pool cannot hold."""
    kind = type(cache)
    if kind is mlx_cache.KVCache:
        return _ShapeProbe()
    if kind is mlx_cache.RotatingKVCache and cache.keep == 0:
        return _ShapeProbe(cache.max_size)
    if kind is mlx_cache.ArraysCache:
        return _StateProbe(len(cache.cache))
    return None


def probe_model(model) -> tuple[Layout, int]:
    """The model's cache layout (K/V shapes, windows, state shapes) and its vocabulary size.

    Refuses, with `ModelError`, a model whose cache holds a kind the pool has no rows for.
    """
    caches = mlx_cache.make_prompt_cache(model)
    probes = [_probe_for(c) for c in caches]
    if any(p is None for p in probes):
        names = sorted({_kind_name(c) for c, p in zip(caches, probes, strict=True) if p is None})
        raise ModelError(f"unsupported cache types for the row KV pool: {', '.join(names)}")
    logits = model(mx.array([[0]]), cache=probes)
    mx.eval(logits)
    entries: list[tuple[str, int]] = []
    kv: list[LayerShape] = []
    states: list[StateShape] = []
    for p in probes:
        if isinstance(p, _ShapeProbe):
            if p.shape is None:
                raise ModelError("a layer did not call cache.update_and_fetch")
            entries.append(("kv", len(kv)))
            kv.append(p.shape)
        else:
            if any(a is None for a in p.arrays):
                raise ModelError("a recurrent layer did not set its whole state")
            entries.append(("state", len(states)))
            states.append(StateShape(tuple(p.arrays)))
    if not kv:
        raise ModelError("no attention layer: state-space-only models are not supported")
    return Layout(tuple(entries), tuple(kv), tuple(states)), logits.shape[-1]


def _kind_name(cache) -> str:
    if isinstance(cache, mlx_cache.RotatingKVCache) and cache.keep:
        return f"RotatingKVCache(keep={cache.keep})"
    return type(cache).__name__
