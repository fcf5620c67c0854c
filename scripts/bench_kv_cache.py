"""Measure the KV-cache operations that decide the design (docs/kv_cache.md).

Per operation, on SmolLM2-135M-shaped layers (30 layers, 3 KV heads, head_dim 64), B running
requests of L tokens:
  - admit one request of L/2 tokens into the running batch: mlx-lm BatchKVCache.extend vs the
    paged pool (its pages from the allocator, its K/V written by a prefill's one scatter)
  - retire one request: BatchKVCache.filter vs its pages back to the free list
  - one decode step's KV write + attention: BatchKVCache (one contiguous batch, a slice) vs the
    paged pool's gather of each row's pages, as the allocator hands them (one run per request);
    `--shuffle-pages` adds the same over pages shuffled across the pool

  .venv/bin/python scripts/bench_kv_cache.py [--batch 32] [--length 1024] [--dtype float16] \
      [--page-size 32] [--shuffle-pages]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

from scheduler_proc.kv_cache import EntryCache, KVPool, LayerCache, StepRows  # noqa: E402
from scheduler_proc.kv_layout import LayerShape, Layout  # noqa: E402
from scheduler_proc.pages import PageAllocator  # noqa: E402

LAYERS, HEADS, DIM = 30, 3, 64


def timed(
    fn: Callable[[], object], repeat: int = 5, undo: Callable[[], object] | None = None
) -> float:
    """Best of `repeat` calls, in ms; `undo` (untimed) puts back what a call changed."""
    fn()
    if undo is not None:
        undo()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if undo is not None:
            undo()
    return best * 1e3


# -- mlx-lm -----------------------------------------------------------------------------------
def batch_cache(b: int, length: int, dtype: mx.Dtype) -> list[BatchKVCache]:
    caches = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * b)
        k = mx.random.normal((b, HEADS, length, DIM)).astype(dtype)
        c.update_and_fetch(k, k)
        caches.append(c)
    mx.eval([c.state[:2] for c in caches])
    return caches


def bench_batchkv(b: int, length: int, dtype: mx.Dtype) -> tuple[float, float, float]:
    def admit() -> float:
        caches = batch_cache(b, length, dtype)
        new = []
        for _ in range(LAYERS):
            one = KVCache()
            k = mx.random.normal((1, HEADS, length // 2, DIM)).astype(dtype)
            one.update_and_fetch(k, k)
            new.append(BatchKVCache.merge([one]))
        mx.eval([c.state[:2] for c in new])
        t = time.perf_counter()
        for c, n in zip(caches, new, strict=True):
            c.extend(n)
        mx.eval([c.state[:2] for c in caches])
        return time.perf_counter() - t

    def retire() -> float:
        caches = batch_cache(b, length, dtype)
        t = time.perf_counter()
        for c in caches:
            c.filter(list(range(1, b)))
        mx.eval([c.state[:2] for c in caches])
        return time.perf_counter() - t

    admit_ms = min(admit() for _ in range(3)) * 1e3
    retire_ms = min(retire() for _ in range(3)) * 1e3
    return admit_ms, retire_ms, bench_batchkv_decode(b, length, dtype)


def bench_batchkv_decode(b: int, length: int, dtype: mx.Dtype) -> float:
    """Rows of `length - 1` tokens write their `length`-th; every row alike, so no mask."""
    caches = batch_cache(b, length - 1, dtype)
    step_k = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)
    q = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)
    mx.eval(step_k, q)

    def decode() -> None:
        outs = [_attend(q, *c.update_and_fetch(step_k, step_k)) for c in caches]
        mx.eval(outs, [c.state[:2] for c in caches])

    def rewind() -> None:  # NOTE: back to `length - 1` tokens, so every call costs the same
        for c in caches:
            c.trim(1)

    return timed(decode, undo=rewind)


# -- the paged pool ---------------------------------------------------------------------------
def paged_pool(b: int, length: int, dtype: mx.Dtype, page: int) -> tuple[KVPool, PageAllocator]:
    """A pool for B requests of `length` tokens and one of `length // 2` (slot B), every page
    allocated at once, as the scheduler's pool on CUDA."""
    layout = Layout.attention_only([LayerShape(HEADS, DIM, DIM, dtype)] * LAYERS)
    pages = -(-length // page) * b + -(-(length // 2) // page)
    pool = KVPool(layout, pages, page, slots=b + 1, context=length, chunk=length)
    return pool, PageAllocator(pool.pages, page)


def row_tables(pages: PageAllocator, b: int, length: int, shuffle: bool) -> list[list[int]]:
    """B page tables as the allocator hands them (one ascending run each), or shuffled."""
    tables = [pages.alloc(pages.pages_for(length)) for _ in range(b)]
    if not shuffle:
        return tables
    ids = [p for t in tables for p in t]
    random.Random(0).shuffle(ids)
    n = len(tables[0])
    return [ids[i * n : (i + 1) * n] for i in range(b)]


def bench_paged(b: int, length: int, dtype: mx.Dtype, page: int) -> tuple[float, float, float]:
    pool, pages = paged_pool(b, length, dtype, page)
    tables = row_tables(pages, b, length, shuffle=False)
    half = length // 2
    k = mx.random.normal((1, HEADS, half, DIM)).astype(dtype)
    mx.eval(k)

    def admit() -> None:
        table = pages.alloc(pages.pages_for(half))
        for c in attention(pool.ragged_view(StepRows([b], [table], [0], [half], half), half)):
            c.update_and_fetch(k, k)
        mx.eval(pool.state())
        pages.release(table)

    def retire() -> None:
        # NOTE: nothing moves on the device: the request's pages go back to the free list.
        pages.release(tables[0])

    def readmit() -> None:
        tables[0] = pages.alloc(pages.pages_for(length))

    admit_ms, retire_ms = timed(admit), timed(retire, undo=readmit)
    return admit_ms, retire_ms, paged_decode(pool, tables, length, dtype)


def bench_shuffled_decode(b: int, length: int, dtype: mx.Dtype, page: int) -> float:
    pool, pages = paged_pool(b, length, dtype, page)
    return paged_decode(pool, row_tables(pages, b, length, shuffle=True), length, dtype)


def paged_decode(pool: KVPool, tables: list[list[int]], length: int, dtype: mx.Dtype) -> float:
    """Rows of `length - 1` tokens write their `length`-th, through the engine's ragged view."""
    b = len(tables)
    step_k = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)
    q = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)
    mx.eval(step_k, q)
    plan = StepRows(list(range(b)), tables, [length - 1] * b, [1] * b, 1)

    def decode() -> None:
        caches = attention(pool.ragged_view(plan, length))
        outs = [_attend(q, *c.update_and_fetch(step_k, step_k)) for c in caches]
        mx.eval(outs, pool.state())

    return timed(decode)


def attention(caches: list[EntryCache]) -> list[LayerCache]:
    """A forward's attention caches: every entry, with `Layout.attention_only`."""
    return [c for c in caches if isinstance(c, LayerCache)]


def _attend(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV page")
    p.add_argument("--shuffle-pages", action="store_true", help="also decode over shuffled pages")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    b, n, page = a.batch, a.length, a.page_size
    print(f"B={b} L={n} {a.dtype}, {LAYERS} layers x {HEADS} heads x {DIM}, pages of {page} "
          f"tokens (all layers, ms)")  # fmt: skip
    bk_admit, bk_retire, bk_decode = bench_batchkv(b, n, dtype)
    p_admit, p_retire, p_decode = bench_paged(b, n, dtype, page)
    shuffled = ""
    if a.shuffle_pages:
        shuffled = f" | shuffled pages {bench_shuffled_decode(b, n, dtype, page):8.2f}"
    print(f"admit one request:  BatchKVCache.extend {bk_admit:8.2f} | page alloc + write "
          f"{p_admit:8.2f}")  # fmt: skip
    print(f"retire one request: BatchKVCache.filter {bk_retire:8.2f} | pages freed       "
          f"{p_retire:8.2f}")  # fmt: skip
    print(f"decode write+attn:  BatchKVCache slice  {bk_decode:8.2f} | paged gather      "
          f"{p_decode:8.2f}{shuffled}")  # fmt: skip


if __name__ == "__main__":
    main()
