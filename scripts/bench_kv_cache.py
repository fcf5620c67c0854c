"""Measure the KV-cache operations that decide the design (docs/kv_cache.md).

Per operation, on SmolLM2-135M-shaped layers (30 layers, 3 KV heads, head_dim 64):
  - admit one request into a running batch of B: mlx-lm BatchKVCache.extend vs a row write
  - retire one request: BatchKVCache.filter vs moving the last row into the hole
  - one decode step's KV write + attention: row slice K[:B, :, :L] vs a paged gather

  .venv/bin/python scripts/bench_kv_cache.py [--batch 32] [--length 1024] [--dtype float16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

from scheduler_proc.kv_cache import KVPool, LayerShape, StepRows  # noqa: E402

LAYERS, HEADS, DIM = 30, 3, 64


def timed(fn, repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def batch_cache(b: int, length: int, dtype) -> list[BatchKVCache]:
    caches = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * b)
        k = mx.random.normal((b, HEADS, length, DIM)).astype(dtype)
        c.update_and_fetch(k, k)
        caches.append(c)
    mx.eval([c.state[:2] for c in caches])
    return caches


def bench_batchkv(b: int, length: int, dtype) -> tuple[float, float]:
    def admit():
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

    def retire():
        caches = batch_cache(b, length, dtype)
        t = time.perf_counter()
        for c in caches:
            c.filter(list(range(1, b)))
        mx.eval([c.state[:2] for c in caches])
        return time.perf_counter() - t

    return min(admit() for _ in range(3)) * 1e3, min(retire() for _ in range(3)) * 1e3


def bench_rows(b: int, length: int, dtype) -> tuple[float, float, float]:
    shapes = [LayerShape(HEADS, DIM, DIM, dtype)] * LAYERS
    pool = KVPool(shapes, b + 1, length + 64)
    for _ in range(b):
        pool.alloc()
    k = mx.random.normal((1, HEADS, length // 2, DIM)).astype(dtype)
    mx.eval(k)

    def admit():
        row = pool.alloc()
        pool.row_view(row, 0)
        for i in range(LAYERS):
            pool.update(i, k, k)
        mx.eval(pool.state())
        pool.pop_row()

    def retire():
        pool.copy_row(b - 1, 0, length)
        mx.eval(pool.state())

    step_k = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)
    mx.eval(step_k)

    q = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)

    def decode():
        pool.ragged_view(StepRows(list(range(b)), [length - 1] * b, [1] * b, 1), length)
        outs = [_attend(q, *pool.update(i, step_k, step_k)) for i in range(LAYERS)]
        mx.eval(outs, pool.state())

    return timed(admit), timed(retire), timed(decode)


def bench_paged_decode(b: int, length: int, dtype, page: int = 16) -> float:
    pages = b * (length // page) + b
    store = [mx.zeros((pages, HEADS, page, DIM), dtype) for _ in range(LAYERS)]
    mx.eval(store)
    table = mx.array([[r * (length // page) + p for p in range(length // page)] for r in range(b)])
    step_k = mx.random.normal((b, HEADS, DIM)).astype(dtype)
    slot_page = table[:, -1]
    q = mx.random.normal((b, HEADS, 1, DIM)).astype(dtype)

    def decode():
        outs = []
        for i in range(LAYERS):
            store[i][slot_page, :, page - 1] = step_k
            kv = store[i][table]  # (b, pages, H, page, D): the gather a paged read needs
            k = kv.transpose(0, 2, 1, 3, 4).reshape(b, HEADS, length, DIM)
            outs.append(_attend(q, k, k))
        mx.eval(outs, store)

    return timed(decode)


def _attend(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--dtype", default="float16")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    b, n = a.batch, a.length
    print(f"B={b} L={n} {a.dtype}, {LAYERS} layers x {HEADS} heads x {DIM} (all layers, ms)")
    bk_admit, bk_retire = bench_batchkv(b, n, dtype)
    s_admit, s_retire, s_decode = bench_rows(b, n, dtype)
    paged = bench_paged_decode(b, n, dtype)
    print(
        f"admit one request:  BatchKVCache.extend {bk_admit:8.2f} | row write      {s_admit:8.2f}"
    )
    print(
        f"retire one request: BatchKVCache.filter {bk_retire:8.2f} | row move       {s_retire:8.2f}"
    )
    print(f"decode write+attn:  row slice           {s_decode:8.2f} | paged gather   {paged:8.2f}")


if __name__ == "__main__":
    main()
