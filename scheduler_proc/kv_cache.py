"""Paged KV pool: full-attention K/V in pages, window rings and recurrent state per slot.

Storage, allocated once (docs/kv_cache.md):
- a full-attention layer holds `(kv_heads, (pages + 1) * page_size, dim)` keys and values: token
  slot `page * page_size + offset`; a request's page table lists its pages in position order, so
  its token at position p sits in slot `table[p // page_size] * page_size + p % page_size`. The
  pages grow by doubling, between steps, up to the planned capacity (`grow`), and shrink back
  when the engine is idle (`shrink`), so memory in use follows the tokens held rather than the
  budget;
- a sliding-window layer holds a ring of `window + chunk - 1` entries per running request
  (`(slots + 1, kv_heads, ring, dim)`): bounded per request, never paged;
- a recurrent layer holds a fixed-size state per running request (`(slots + 1, ...)`).
Page 0 and the last slot are scratch: a padded forward's padding writes there, so nothing in use
ever sees it.

Views say what one forward touches, and each forward gets its own caches bound to its view
(`row_view`, `ragged_view`): no state on the pool says which step is running. The caches speak
mlx-lm's protocol (`update_and_fetch`, `offset`, `make_mask`; `ArraysCache` indexing for state),
so mlx-lm models run on it unpatched. A full layer's keys are read by gathering the rows' pages
into one contiguous batch (a slice when a lone row's pages are one run); in a fused decode (CUDA,
`decode_attention`) the kernel reads them through the page table instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from scheduler_proc.decode_attention import Groups, PagedKeys, QuantPages, RowGroup
from scheduler_proc.kv_layout import LayerShape, Layout, bytes_per_token, ring_size
from scheduler_proc.kv_quant import Buffer, KVQuant, QuantBuffer, parts, rebuilt


@dataclass(frozen=True)
class StepRows:
    """What one forward covers (host side): per forward row, its request's slot and page table,
    the position of its first token and how many of its `width` tokens are real (0: a pad row)."""

    slots: list[int]
    tables: list[list[int]]
    starts: list[int]
    lengths: list[int]
    width: int


# NOTE: a decode step splits its rows where a row holds fewer than half the keys of the longest
# row of its group, each group reading only up to its own longest (`length_groups`).
SPLIT_RATIO = 2
# NOTE: lone chunks gathered together read at most this many keys a group (`_lone_reads`): a
# group's gather is held until its last row is copied out, so 16 rows of 128k keys at once would
# hold 16x what one row at a time did; 16 rows of 4k keys still go in one group.
LONE_GROUP_KEYS = 1 << 16


def token_slots(table: list[int], start: int, n: int, page: int) -> np.ndarray:
    """Pool slots of positions `[start, start + n)` of a request with page table `table`."""
    pos = np.arange(start, start + n)
    return np.asarray(table, dtype=np.int64)[pos // page] * page + pos % page


def slot_index(slots: np.ndarray | list[int]) -> mx.array:
    """Token slots as the index `write_slots` takes: int32, shaped `(1, n, 1)`, built on the host."""
    return mx.array(np.asarray(slots, dtype=np.int32).reshape(1, -1, 1))


def write_slots(buf: Buffer, index: mx.array, new: mx.array) -> Buffer:
    """`buf[:, slots] = new` for a `(kv_heads, n, dim)` update, in place; returns `buf`.

    NOTE: one scatter along the slot axis (`put_along_axis`: 4 graph nodes with the update's
    reshape); `buf[:, idx] = new` builds the head index again at every write (11 nodes, twice a
    layer a step; on this CPU the 16-row decode step of the default model went from ~187 to
    ~162 ms). `buf[...] =` makes this very Python object the scatter's result, as an indexed
    assignment does (no node): a scatter reuses its input's memory only when nothing else holds
    it, and a new object would leave the old one to whoever kept a reference.
    """
    if isinstance(buf, QuantBuffer):
        for part, x in zip(buf.parts, buf.quantize(new), strict=True):
            part[...] = mx.put_along_axis(part, index, x, axis=1)
        return buf
    buf[...] = mx.put_along_axis(buf, index, new, axis=1)
    return buf


def write_run(buf: Buffer, s0: int, new: mx.array) -> Buffer:
    """`buf[:, s0 : s0 + n] = new` for a `(kv_heads, n, dim)` update (pages in one run)."""
    n = new.shape[1]
    if isinstance(buf, QuantBuffer):
        for part, x in zip(buf.parts, buf.quantize(new), strict=True):
            part[:, s0 : s0 + n] = x
        return buf
    buf[:, s0 : s0 + n] = new
    return buf


def contiguous_run(table: list[int], n_pages: int) -> bool:
    """Whether a table's first `n_pages` pages are one ascending run (a slice of the pool)."""
    if len(table) < n_pages:
        return False
    if n_pages <= 1:
        return True
    first = table[0]
    return table[:n_pages] == list(range(first, first + n_pages))


class _RowView:
    """One request at an int offset, no padding: exactly mlx-lm's single-stream path."""

    lengths = None  # NOTE: no padding, so recurrent layers take mlx-lm's unmasked path
    by_ops = False  # NOTE: one row, mlx-lm's own masks and attention
    fresh = False  # NOTE: its keys are read back (a slice when its pages are one run)
    grouped = False  # NOTE: one row: attends as mlx-lm's

    def __init__(self, pool: KVPool, slot: int, table: list[int], start: int, n: int = 1) -> None:
        self.pool, self.slot, self.table, self.offset = pool, slot, table, start
        self.state_rows = self.state_write = slice(slot, slot + 1)
        # NOTE: checked once per forward, not per layer: whether its keys are one slice.
        self._run = contiguous_run(table, pool.pages_for(start + n))

    def fused_keys(self, window: int | None) -> None:
        return None

    def write(self, buf: Buffer, new: mx.array) -> Buffer:
        p, n = self.pool.page_size, new.shape[2]
        if self._run:
            return write_run(buf, self.table[0] * p + self.offset, new[0])
        return write_slots(buf, slot_index(token_slots(self.table, self.offset, n, p)), new[0])

    def read(self, buf: Buffer, n: int) -> mx.array:
        return self.pool.gather([self.table], self.offset + n, buf, run=self._run)

    def write_ring(self, buf: mx.array, new: mx.array, ring: int) -> mx.array:
        assert new.shape[2] == 1, "a lone row writes one token"
        s, r = self.offset % ring, self.slot
        buf[r : r + 1, :, s : s + 1] = new
        return buf

    def read_ring(self, buf: mx.array, n: int, ring: int) -> mx.array:
        return buf[self.slot : self.slot + 1, :, : min(self.offset + n, ring)]

    def mask(self, n: int, return_array: bool, window_size: int | None, ring: int | None = None):
        if ring is not None:
            end = self.offset + n
            if window_size is None or end <= window_size:
                return None  # NOTE: every key read is in the window
            ends = mx.array([end], dtype=mx.int32)
            starts = mx.array([self.offset], dtype=mx.int32)
            return ring_mask(starts, ends, n, min(end, ring), ring, window_size)
        if n == 1:
            return None
        return mlx_cache.create_attention_mask(n, self.offset, return_array, window_size)

    def ssm_mask(self, n: int) -> None:
        return None


@dataclass(frozen=True)
class _GroupReads:
    """What a group of rows reads, the same in every layer (`_RaggedView.groups`): a lone
    chunk's row (`_lone_reads`) or decode rows of like lengths (`_decode_reads`)."""

    rows: slice | mx.array
    tables: list[list[int]]
    pages: mx.array
    keys: int
    run: bool
    mask: mx.array | str | None


class _RaggedView:
    """A padded batch of R rows x T query positions over the pool, for one forward.

    Row i holds `lengths[i]` real tokens at positions `starts[i]:starts[i] + lengths[i]` of the
    request in slot `slots[i]`. Real tokens are written in place with one scatter per layer;
    padding goes to the scratch page (full layers) or the scratch slot (rings, state). Attention
    reads keys `[0, kv_len)` of every row (a bucketed length): the rows' pages gathered, or, in a
    fused decode, the whole buffers and the page table.
    """

    def __init__(
        self,
        pool: KVPool,
        plan: StepRows,
        kv_len: int,
        fused: bool = False,
        by_ops: bool = False,
        causal: bool = False,
        split: bool = False,
    ) -> None:
        self.pool, self.plan, self.length = pool, plan, kv_len
        self._t = t = plan.width
        self.offset = mx.array(plan.starts, dtype=mx.int32)
        self._ends = self.offset + mx.array(plan.lengths, dtype=mx.int32)
        tables = pool.table_numpy(plan.tables, pool.pages_for(kv_len))
        self._write_idx = slot_index(self._write_slots(tables))
        self._tables = mx.array(tables)
        one = len(plan.tables) == 1
        # NOTE: `causal`: one row whose queries are its last keys needs no mask (the fast op's
        # bottom-right causal kernel). Its keys are always gathered: cuDNN builds a graph per
        # shape and strides, and a slice of the pool has other strides than the warm-up's.
        self.causal = causal and one and plan.starts[0] + plan.width == kv_len
        # NOTE: several such rows (lone chunks, each from a multiple of the width): each row
        # attends on its own over its keys, `starts[i] + width` (`by_rows`), in a lone chunk's
        # shape (`_lone_parts`); the padded batch's gather is not made.
        self.by_rows = causal and not one
        # NOTE: `fresh`: every row starts at position 0, so a full layer's keys are the chunk's
        # own, right-padded; a causal mask is exact for every real query (padding only follows
        # it) and nothing needs gathering back from the pages. One shape per (rows, width).
        self.fresh = plan.width > 1 and not any(plan.starts)
        self._full_keys = plan.width if self.fresh else kv_len
        run = one and not self.causal
        self._run = run and contiguous_run(plan.tables[0], pool.pages_for(kv_len))
        self._masks: dict[tuple[int | None, int | None], mx.array] = {}
        self._rings: dict[int, tuple[mx.array, mx.array]] = {}
        scratch = pool.scratch_slot
        n = len(plan.slots)
        self._slot_rows = (
            slice(0, n) if plan.slots == list(range(n)) else mx.array(plan.slots, dtype=mx.int32)
        )
        # NOTE: recurrent state: read for every forward row, written back only for rows with real
        # tokens (pad rows write the scratch slot); `lengths` tells the model's conv / scan which
        # positions are real, so padding never updates a row's state.
        self.state_rows = self._slot_rows
        self.state_write = mx.array(
            [s if k else scratch for s, k in zip(plan.slots, plan.lengths, strict=True)], mx.int32
        )
        padded = any(k < t for k in plan.lengths)
        self.lengths = mx.array(plan.lengths, dtype=mx.int32) if padded else None
        self.fused = fused and t == 1
        self.by_ops = by_ops and t > 1
        # NOTE: a decode whose rows read very different numbers of keys (one long request among
        # short ones) attends in groups, each reading up to its own longest row: gathered to
        # the longest row, a 7,000-token request made 15 short streams decode ~30x slower (CPU).
        ends = [max(s + n, 1) for s, n in zip(plan.starts, plan.lengths, strict=True)]
        self._split = length_groups(ends) if split and t == 1 and not self.fused else None
        self.grouped = self.by_rows or self._split is not None
        self._group_reads: list[_GroupReads] | None = None
        self._group_order: mx.array | None = None
        self._lone: list[tuple[list[int], _GroupReads]] | None = None  # NOTE: `_lone_reads`

    def _write_slots(self, tables: np.ndarray) -> np.ndarray:
        """Slot of every (row, query) position, row-major; padding to the scratch page.

        NOTE: vectorised over the rows: a per-row loop cost 2.3 ms for a 256-row decode step on
        this CPU, more than the GPU's whole step hides."""
        plan, page = self.plan, self.pool.page_size
        for table, start, n in zip(plan.tables, plan.starts, plan.lengths, strict=True):
            if n and len(table) * page < start + n:
                raise RuntimeError(f"KV pages: a write past the page table ({start + n} tokens)")
        t = np.arange(plan.width)[None]
        pos = np.asarray(plan.starts)[:, None] + t
        real = t < np.asarray(plan.lengths)[:, None]
        index = np.where(real, pos // page, 0)
        own = np.take_along_axis(tables, index, axis=1).astype(np.int64) * page + pos % page
        return np.where(real, own, self.pool.scratch_page * page + t % page).reshape(-1)

    def groups(self, keys: Buffer, values: Buffer) -> Groups | None:
        """A full layer's attention in parts (`grouped`), from its buffers after the write."""
        # NOTE: what each group reads is found once per forward, shared by every layer
        if self.by_rows:
            if self._lone is None:
                self._lone = self._lone_reads()
            return Groups(self._lone_parts(self._lone, keys, values))
        if self._split is None:
            return None
        if self._group_reads is None:
            self._group_reads = [self._decode_reads(g) for g in self._split]
            order = np.argsort([i for g in self._split for i in g]).astype(np.int32)
            self._group_order = mx.array(order)
        parts = [self._group(r, keys, values) for r in self._group_reads]
        return Groups(parts, self._group_order)

    def _lone_reads(self) -> list[tuple[list[int], _GroupReads]]:
        """Row i reads keys `[0, starts[i] + width)`, its queries the last of them. Rows that
        read as many keys are gathered (and dequantized) together, once a layer, up to
        `LONE_GROUP_KEYS` keys a group.

        NOTE: gathering each row alone cost 34 ms a step of 16 rows x 16 layers (H100, 1B
        shape, 512-token chunks over 1.5-3k keys) and 72-91 ms with 8-bit pages (three parts
        and a dequantize a row): 16 long prompts took 1.35x as long quantized. Gathered by
        like rows: 19-26 ms plain, 15-39 ms quantized (`scripts/bench_lone_reads.py`)."""
        plan, by_keys = self.plan, dict[int, list[int]]()
        for i, start in enumerate(plan.starts):
            by_keys.setdefault(start + self._t, []).append(i)
        reads = []
        for n, same in by_keys.items():
            per = max(1, LONE_GROUP_KEYS // n)
            for rows in (same[j : j + per] for j in range(0, len(same), per)):
                index = mx.array(np.asarray(rows, dtype=np.int32))
                pages = self._tables[index][:, : self.pool.pages_for(n)]
                tables = [plan.tables[i] for i in rows]
                reads.append((rows, _GroupReads(index, tables, pages, n, False, "causal")))
        return reads

    def _lone_parts(
        self, lone: list[tuple[list[int], _GroupReads]], keys: Buffer, values: Buffer
    ) -> list[RowGroup]:
        """One part a row, in row order, each a lone chunk's keys: contiguous, so its attention
        has the shape and strides whose graph the warm-up built (cuDNN builds one per strides:
        a row's view into its group's gather cost a ~70 ms build the first time)."""
        parts: dict[int, RowGroup] = {}
        for rows, r in lone:
            g = self._group(r, keys, values)
            for j, i in enumerate(rows):
                k, v = (mx.contiguous(a[j : j + 1]) for a in (g.keys, g.values))
                parts[i] = RowGroup(slice(i, i + 1), k, v, "causal")
        return [parts[i] for i in range(len(self.plan.starts))]

    def _decode_reads(self, rows: list[int]) -> _GroupReads:
        """What decode rows `rows` read: keys up to the longest of them, through their pages
        (one row's pages in one run: a slice, no copy), and the mask of the shorter ones."""
        pool, plan = self.pool, self.plan
        ends = [max(plan.starts[i] + plan.lengths[i], 1) for i in rows]
        n = max(ends)
        tables = [plan.tables[i] for i in rows]
        run = len(rows) == 1 and contiguous_run(tables[0], pool.pages_for(n))
        index = mx.array(np.asarray(rows, dtype=np.int32))
        mask = None
        if min(ends) < n:  # NOTE: (G, 1, 1, n): row r sees its first ends[r] keys
            mask = (mx.arange(n)[None] < mx.array(ends)[:, None])[:, None, None]
        pages = self._tables[index][:, : pool.pages_for(n)]
        return _GroupReads(index, tables, pages, n, run, mask)

    def _group(self, r: _GroupReads, keys: Buffer, values: Buffer) -> RowGroup:
        for buf in (keys, values):
            self.pool.count_gather(len(r.tables), r.keys, buf, r.run)
        k = self.pool.gather(r.tables, r.keys, keys, r.pages, r.run)
        v = self.pool.gather(r.tables, r.keys, values, r.pages, r.run)
        return RowGroup(r.rows, k, v, r.mask)

    def fused_keys(self, window: int | None) -> PagedKeys | None:
        """A fused full-attention layer's keys: per-row counts, their host bound and the table."""
        if not self.fused or window is not None:
            return None
        return PagedKeys(self._ends, self.length, self._tables, self.pool.page_size)

    def write(self, buf: Buffer, new: mx.array) -> Buffer:
        r, h, t, d = new.shape
        plan = self.plan
        if self._run and plan.lengths == [t]:  # NOTE: one row, unpadded, pages in one run
            return write_run(buf, plan.tables[0][0] * self.pool.page_size + plan.starts[0], new[0])
        # NOTE: (R, kv_heads, T, dim) -> (kv_heads, R * T, dim), row-major like the slots
        return write_slots(buf, self._write_idx, new.transpose(1, 0, 2, 3).reshape(h, r * t, d))

    def read(self, buf: Buffer, n: int) -> mx.array:
        if self.fused:
            # NOTE: the kernel reads through the table (`fused_keys`); quantized, the codes
            # (`LayerCache.fused_lengths` hands it the scales and biases)
            return (buf.parts[0] if isinstance(buf, QuantBuffer) else buf)[None]
        if not self.grouped:  # NOTE: grouped, this gather is never run (`KVPool.update`)
            self.pool.count_gather(len(self.plan.tables), self.length, buf, self._run)
        return self.pool.gather(self.plan.tables, self.length, buf, self._tables, self._run)

    def write_ring(self, buf: mx.array, new: mx.array, ring: int) -> mx.array:
        rows, pos = self._ring_index(ring)
        # NOTE: (R, kv_heads, T, dim) -> (R, T, kv_heads, dim), the shape of buf[rows, :, pos].
        buf[rows, :, pos] = new.transpose(0, 2, 1, 3)
        return buf

    def _ring_index(self, ring: int) -> tuple[mx.array, mx.array]:
        if ring not in self._rings:
            plan, scratch = self.plan, self.pool.scratch_slot
            rows, pos = [], []
            for slot, start, n in zip(plan.slots, plan.starts, plan.lengths, strict=True):
                rows.append([slot] * n + [scratch] * (plan.width - n))
                # NOTE: scratch positions are below the width, itself at most the ring.
                pos.append([(start + i) % ring for i in range(n)] + list(range(n, plan.width)))
            self._rings[ring] = (mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32))
        return self._rings[ring]

    def read_ring(self, buf: mx.array, n: int, ring: int) -> mx.array:
        # NOTE: slice the keys first, then pick the rows: `buf[rows, :, :keys]` gathers whole
        # rows before slicing.
        return buf[:, :, : min(ring, self.length)][self._slot_rows]

    def mask(
        self, n: int, return_array: bool, window_size: int | None, ring: int | None = None
    ) -> mx.array | str | None:
        if self.fused and ring is None:
            return None  # NOTE: unused: the fused kernel bounds each row by its length
        causal = self.causal or self.fresh or self.by_rows
        if causal and ring is None and window_size is None and not return_array:
            return "causal"
        # NOTE: one mask per window size: a model with sliding and full layers asks for both.
        key = (window_size, ring)
        if key not in self._masks:
            if ring is None:
                mask = ragged_mask(self.offset, self._t, self._full_keys, window_size)
            else:
                keys = min(ring, self.length)
                mask = ring_mask(self.offset, self._ends, self._t, keys, ring, window_size)
            self._masks[key] = mask
        return self._masks[key]

    def ssm_mask(self, n: int) -> mx.array | None:
        if self.lengths is None:
            return None
        return mx.arange(n)[None] < self.lengths[:, None]


View = _RowView | _RaggedView


def length_groups(ends: list[int]) -> list[list[int]] | None:
    """Decode rows (`ends`: keys each reads) in groups, longest first: a row starts a new group
    when it reads fewer than 1 / SPLIT_RATIO of its group's longest; None when that saves under
    a quarter of the keys read (one group: the padded batch)."""
    order = sorted(range(len(ends)), key=lambda i: -ends[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or ends[i] * SPLIT_RATIO < ends[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    read = sum(len(g) * ends[g[0]] for g in groups)
    if len(groups) == 1 or read * 4 > len(ends) * ends[order[0]] * 3:
        return None
    return groups


def ragged_mask(starts: mx.array, width: int, kv_len: int, window: int | None) -> mx.array:
    """(R, 1, T, L): query t of row r (at position starts[r] + t) sees keys up to its own."""
    keys = mx.arange(kv_len)[None, None]
    query = (starts[:, None] + mx.arange(width)[None])[:, :, None]
    visible = keys <= query
    if window is not None:
        visible = visible & (keys > query - window)
    return visible[:, None]


def ring_mask(
    starts: mx.array, ends: mx.array, width: int, keys: int, ring: int, window: int | None
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
    visible = (p >= 0) & (p <= q)
    if window is not None:
        visible = visible & (p > q - window)
    return visible[:, None]


class LayerCache:
    """What an attention layer sees in one forward: mlx-lm's cache protocol over its view."""

    def __init__(self, pool: KVPool, layer: int, view: View) -> None:
        self._pool, self._layer, self._view = pool, layer, view
        self._window = pool.shapes[layer].window
        self._ring = pool.rings[layer]

    @property
    def offset(self):
        return self._view.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._pool.update(self._layer, self._view, keys, values)

    def fused_lengths(self) -> PagedKeys | None:
        """Keys per row, their host bound and the page table when this layer's attention runs
        the fused decode (`decode_attention`); with quantized pages, their scales and biases."""
        paged = self._view.fused_keys(self._window)
        k, v = self._pool.keys[self._layer], self._pool.values[self._layer]
        if paged is None or not isinstance(k, QuantBuffer) or not isinstance(v, QuantBuffer):
            return paged
        # NOTE: read after this step's writes (the layer updated its cache before attention)
        ks, kb, vs, vb = (a[None] for a in (*k.parts[1:], *v.parts[1:]))
        pages = QuantPages(ks, kb, vs, vb, k.quant.bits, k.quant.group)
        return dataclasses.replace(paged, quant=pages)

    def groups(self) -> Groups | None:
        """This layer's attention in parts, when the forward's rows attend in groups (lone
        chunks each on its own; decode rows of very different lengths); None otherwise."""
        view = self._view
        if not isinstance(view, _RaggedView) or not view.grouped or self._ring is not None:
            return None
        p, i = self._pool, self._layer
        return view.groups(p.keys[i], p.values[i])

    def prefill_by_ops(self) -> bool:
        """Whether this forward's attention over a prompt chunk runs `prefill_attention`."""
        return self._view.by_ops

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # NOTE: as mlx-lm's RotatingKVCache: a window layer's mask has its window even when the
        # model does not name one.
        if self._ring is not None:
            return self._view.mask(N, return_array, self._window, self._ring)
        return self._view.mask(N, return_array, window_size or self._window)


class StateCache:
    """What a recurrent layer sees: mlx-lm's `ArraysCache` protocol over the step's state slots.

    `cache[i]` is entry i's state for the forward's rows; assigning it writes the rows back.
    """

    def __init__(self, pool: KVPool, index: int, view: View) -> None:
        self._pool, self._index, self._view = pool, index, view

    def __getitem__(self, i: int) -> mx.array:
        return self._pool.states[self._index][i][self._view.state_rows]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self._pool.write_state(self._index, i, value, self._view.state_write)

    def __bool__(self) -> bool:  # NOTE: models test `if cache:`
        return True

    @property
    def lengths(self) -> mx.array | None:
        return self._view.lengths

    def advance(self, n: int) -> None:
        """NOTE: nothing to count: each step's view says where every row's tokens are."""

    def make_mask(self, N: int) -> mx.array | None:
        return self._view.ssm_mask(N)


# NOTE: what the model sees for one entry of its cache list (attention K/V or recurrent state).
EntryCache = LayerCache | StateCache


class KVPool:
    """Per-layer buffers: `pages` pages of `page_size` tokens, `slots` per-request rings and
    states, plus one scratch page and one scratch slot."""

    def __init__(
        self,
        layout: Layout,
        pages: int,
        page_size: int,
        slots: int,
        context: int,
        chunk: int,
        capacity: int | None = None,
        quant: KVQuant | None = None,
    ) -> None:
        """`pages` allocated now, up to `capacity` (default: `pages`) by `grow`; `quant`:
        full-attention pages quantized (`--kv-bits`; rings and state stay as they are)."""
        self.layout, self.shapes, self.quant = layout, list(layout.kv), quant
        self.pages, self.page_size, self.slots, self.context = pages, page_size, slots, context
        self.capacity = max(pages, capacity or pages)
        self.initial = pages  # NOTE: `shrink` goes no lower
        self.scratch_page, self.scratch_slot = 0, slots
        self.gathered_bytes = 0  # NOTE: K and V copied by attention's reads, since start
        self.rings = [
            None if s.window is None else ring_size(s.window, chunk, context) for s in self.shapes
        ]
        self.keys: list[Buffer] = [
            self._buffer(s, r, s.k_dim) for s, r in zip(self.shapes, self.rings, strict=True)
        ]
        self.values: list[Buffer] = [
            self._buffer(s, r, s.v_dim) for s, r in zip(self.shapes, self.rings, strict=True)
        ]
        self.states = [
            [mx.zeros((slots + 1, *shape), dtype) for shape, dtype in st.arrays]
            for st in layout.states
        ]
        mx.eval(self.kv_arrays(), self.states)

    def _buffer(self, shape: LayerShape, ring: int | None, dim: int) -> Buffer:
        if ring is not None:
            return mx.zeros((self.slots + 1, shape.kv_heads, ring, dim), shape.dtype)
        tokens = (self.pages + 1) * self.page_size
        if self.quant is not None:
            return QuantBuffer.zeros(shape.kv_heads, tokens, dim, shape.dtype, self.quant)
        return mx.zeros((shape.kv_heads, tokens, dim), shape.dtype)

    def kv_arrays(self) -> list[mx.array]:
        """Every K/V array (a quantized buffer's parts each)."""
        return [a for buf in self.keys + self.values for a in parts(buf)]

    @property
    def token_bytes(self) -> int:
        """K and V of one token over the full-attention layers (what a paged token holds)."""
        return bytes_per_token([s for s in self.shapes if s.window is None], self.quant)

    @property
    def nbytes(self) -> int:
        kv = sum(a.nbytes for a in self.kv_arrays())
        return kv + sum(a.nbytes for layer in self.states for a in layer)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grow(self, pages: int) -> int:
        """Hold `pages` pages (at most the capacity); only while no step is in flight. Returns
        how many were added. NOTE: a copy of what is held, once per doubling."""
        add = min(pages, self.capacity) - self.pages
        if add <= 0:
            return 0
        for i, ring in enumerate(self.rings):
            if ring is None:
                for bufs in (self.keys, self.values):
                    bufs[i] = rebuilt(
                        bufs[i], [_grown(a, add * self.page_size) for a in parts(bufs[i])]
                    )
                    mx.eval(parts(bufs[i]))  # NOTE: one layer at a time: the old one goes at once
        self.pages += add
        # NOTE: the old buffers go back to the system now: Metal's cache would keep them (up
        # to its limit), and a step rarely asks for their size again.
        mx.clear_cache()
        return add

    def shrink(self, pages: int) -> int:
        """Hold only `pages` pages (at least those allocated at start); only while no step is in
        flight and no page above `pages` is in use. Returns how many went."""
        cut = self.pages - max(pages, self.initial)
        if cut <= 0:
            return 0
        keep = (self.pages - cut + 1) * self.page_size
        for i, ring in enumerate(self.rings):
            if ring is None:
                for bufs in (self.keys, self.values):
                    # NOTE: a copy (a slice would keep the whole buffer alive), a layer at a time
                    bufs[i] = rebuilt(bufs[i], [mx.contiguous(a[:, :keep]) for a in parts(bufs[i])])
                    mx.eval(parts(bufs[i]))
        self.pages -= cut
        mx.clear_cache()
        return cut

    # -- forward views -----------------------------------------------------------------------
    def row_view(self, slot: int, table: list[int], start: int, n: int = 1) -> list[EntryCache]:
        """One request, `n` tokens at `start:`, int offset (a single stream's step)."""
        return self._caches(_RowView(self, slot, table, start, n))

    def ragged_view(
        self,
        plan: StepRows,
        kv_len: int,
        fused: bool = False,
        by_ops: bool = False,
        causal: bool = False,
        split: bool = False,
    ) -> list[EntryCache]:
        """A padded batch of rows (see `_RaggedView`); `kv_len` keys are read per row.
        `fused`: a decode reads keys in the kernel; `by_ops`: prompt chunks attend by MLX's ops
        (`prefill_attention`); `causal`: rows whose queries are their last keys attend by the
        fast op's causal kernel; `split`: a decode's rows may attend in groups by length."""
        return self._caches(_RaggedView(self, plan, kv_len, fused, by_ops, causal, split))

    def _caches(self, view: View) -> list[EntryCache]:
        # NOTE: one cache object per entry of the model's own cache list, in its order.
        return [
            LayerCache(self, i, view) if kind == "kv" else StateCache(self, i, view)
            for kind, i in self.layout.entries
        ]

    def table_array(self, tables: list[list[int]], width: int) -> mx.array:
        """`(R, width)` page ids, each table padded with the scratch page."""
        return mx.array(self.table_numpy(tables, width))

    def table_numpy(self, tables: list[list[int]], width: int) -> np.ndarray:
        pad = [self.scratch_page] * width
        rows = [t[:width] if len(t) >= width else (t + pad)[:width] for t in tables]
        return np.array(rows, dtype=np.int32).reshape(len(tables), width)

    def count_gather(self, rows: int, keys: int, buf: Buffer, run: bool) -> None:
        """Count what `gather` copies for `rows` rows of `keys` keys (whole pages; a run: none),
        K or V of one layer: `gathered_bytes`, against the KV held."""
        if not run:
            per_slot = sum(a.shape[0] * a.shape[2] * a.itemsize for a in parts(buf))
            self.gathered_bytes += rows * self.pages_for(keys) * self.page_size * per_slot

    def gather(
        self,
        tables: list[list[int]],
        keys: int,
        buf: Buffer,
        arr: mx.array | None = None,
        run: bool = False,
    ) -> mx.array:
        """`(R, kv_heads, keys, dim)`: the first `keys` positions of each row, from its pages
        (a quantized buffer's parts gathered, then dequantized)."""
        if isinstance(buf, QuantBuffer):
            if arr is None and not run:
                arr = self.table_array(tables, self.pages_for(keys))
            return buf.dequantize([self._gather(tables, keys, a, arr, run) for a in buf.parts])
        return self._gather(tables, keys, buf, arr, run)

    def _gather(
        self,
        tables: list[list[int]],
        keys: int,
        buf: mx.array,
        arr: mx.array | None = None,
        run: bool = False,
    ) -> mx.array:
        """`(R, kv_heads, keys, dim)`: the first `keys` positions of each row, from its pages.

        NOTE: a lone row whose pages are one run (`run`, `contiguous_run`) is a slice, no copy;
        otherwise one gather of the pages (CPU, 16 rows x 1,024 tokens: 2.6-2.8x the cost of
        slicing rows).
        """
        n, p = self.pages_for(keys), self.page_size
        if run:
            s0 = tables[0][0] * p
            return buf[:, s0 : s0 + keys][None]
        if arr is None:
            arr = self.table_array(tables, n)
        h, _, d = buf.shape
        pages = buf.reshape(h, self.pages + 1, p, d)[:, arr[:, :n]]
        return pages.reshape(h, len(tables), n * p, d)[:, :, :keys].transpose(1, 0, 2, 3)

    def update(self, layer: int, view: View, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        ring, n = self.rings[layer], k.shape[2]
        if ring is None:
            self.keys[layer] = view.write(self.keys[layer], k)
            self.values[layer] = view.write(self.values[layer], v)
            if view.fresh:
                return _as_stored(self.keys[layer], k), _as_stored(self.values[layer], v)
            # NOTE: grouped, our attention reads `groups()` and this gather, lazy, never runs;
            # a layer that reuses another's keys (KV shared across layers) attends over it.
            return view.read(self.keys[layer], n), view.read(self.values[layer], n)
        keys = view.write_ring(_plain(self.keys[layer]), k, ring)
        values = view.write_ring(_plain(self.values[layer]), v, ring)
        self.keys[layer], self.values[layer] = keys, values
        return view.read_ring(keys, n, ring), view.read_ring(values, n, ring)

    def write_state(self, layer: int, entry: int, value: mx.array, rows) -> None:
        buf = self.states[layer][entry]
        buf[rows] = value.astype(buf.dtype)
        self.states[layer][entry] = buf

    # -- between steps -------------------------------------------------------------------------
    def reset_slot(self, slot: int) -> None:
        """A new request's state is zero, what mlx-lm's models start from with an empty cache.

        NOTE: its ring needs no reset: a ring entry is only read once the row has written it.
        """
        for layer in self.states:
            for a in layer:
                a[slot : slot + 1] = 0

    def slot_arrays(self) -> list[mx.array]:
        """The per-slot buffers, in `read_slot`'s order: the rings' K, their V, then state."""
        bufs = zip(self.keys + self.values, self.rings * 2, strict=True)
        return [_plain(b) for b, r in bufs if r] + [a for st in self.states for a in st]

    def read_slot(self, slot: int) -> list[mx.array]:
        """A slot's rings and recurrent state (copies), in a fixed order `write_slot` takes."""
        return [mx.contiguous(a[slot : slot + 1]) for a in self.slot_arrays()]

    def write_slot(self, slot: int, arrays: list[mx.array]) -> None:
        for buf, a in zip(self.slot_arrays(), arrays, strict=True):
            buf[slot : slot + 1] = a

    def copy_tokens(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of token slots `src` to slots `dst` in every full layer (a shared
        prefix's partly filled page, before the new request writes after it)."""
        if not src:
            return
        # NOTE: the reads evaluated first, on their own: a write whose graph still reads the
        # buffer cannot reuse it, and copied the whole pool (H200, a 65 GiB pool: every prefix
        # hit with a partly filled page stalled the next step 2.7-4.9 s).
        self.write_tokens(dst, self.read_tokens(src))

    def paged_arrays(self) -> list[mx.array]:
        """The full layers' arrays in a fixed order: K then V of each layer, a quantized
        buffer's parts each (what `read_tokens` and `write_tokens` carry)."""
        full = [i for i, ring in enumerate(self.rings) if ring is None]
        return [a for i in full for buf in (self.keys[i], self.values[i]) for a in parts(buf)]

    def read_tokens(self, slots: list[int]) -> list[mx.array]:
        """`paged_arrays` at token slots `slots` (`(kv_heads, n, last)` each, as stored: codes
        and scales when quantized), evaluated: nothing pending reads the pool after it (see
        `copy_tokens`)."""
        s = mx.array(slots, dtype=mx.int32)
        out = [a[:, s] for a in self.paged_arrays()]
        mx.eval(out)
        return out

    def write_tokens(self, slots: list[int], arrays: list[mx.array]) -> None:
        """Write `read_tokens`' layout at token slots `slots`, as stored (no quantizing)."""
        d = slot_index(slots)
        targets = self.paged_arrays()
        assert len(arrays) == len(targets), "every array of every full layer"
        for buf, new in zip(targets, arrays, strict=True):
            buf[...] = mx.put_along_axis(buf, d, new, axis=1)
        mx.eval(targets)

    def state(self) -> list[mx.array]:
        """Every buffer, for `mx.async_eval` alongside a step's outputs."""
        return [*self.kv_arrays(), *self.recurrent_state()]

    def recurrent_state(self) -> list[mx.array]:
        """The recurrent layers' state buffers: a decode step writes them and reads them not."""
        return [a for layer in self.states for a in layer]


def _grown(a: mx.array, tokens: int) -> mx.array:
    """`a` with `tokens` zero slots more along its slot axis."""
    h, _, d = a.shape
    return mx.concatenate([a, mx.zeros((h, tokens, d), a.dtype)], axis=1)


def _plain(buf: Buffer) -> mx.array:
    """A ring's buffer: rings are never quantized."""
    assert isinstance(buf, mx.array), "a window ring is a plain buffer"
    return buf


def _as_stored(buf: Buffer, new: mx.array) -> mx.array:
    """A chunk's own K or V as attention reads them back from `buf`: through its quantization
    when the pages are quantized, so a prompt attends to what a later step will read (a
    preempted request recomputed, or a prefix hit, then equals the request computed once)."""
    if isinstance(buf, QuantBuffer):
        return buf.dequantize(buf.quantize(new))
    return new
