"""Decode attention alone, B rows of different lengths: the fused kernel vs MLX's own op.

Each row's keys sit in pages of `--page-size` slots shuffled across one pool buffer per K and V,
as the paged KV cache holds them. Per configuration, the time of one attention call (16 chained
calls per evaluation, as 16 layers):
  - `mlx equal`: `mx.fast.scaled_dot_product_attention` over contiguous rows (gathered once,
    untimed), every row as long as the longest, no mask (mlx-lm's batched case, and MLX's fused
    decode kernel on CUDA);
  - `mlx mask`: the same rows with a per-row boolean mask;
  - `paged mask`: the kernel's masked twin, the pages gathered then masked (the engine's masked
    path);
  - `fused`: `scheduler_proc.decode_attention` through the page table, in one pass and split.
It also prints the fused output's largest difference from the masked twin's.

  python3 scripts/bench_decode_attention.py                      # a GPU: the kernel
  .venv/bin/python scripts/bench_decode_attention.py --batch 4   # elsewhere: its masked twin
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="16,64,128", help="comma list of row counts")
    p.add_argument("--context", default="600", help="longest row (comma list); rows from half")
    p.add_argument("--row-len", type=int, default=4096, help="pool slots per row (pool size)")
    p.add_argument("--page-size", type=int, default=32, help="slots per page")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args()


def timed(fn: Callable[[], Any], iters: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) / 16


def chain(q: Any, step: Callable[[Any], Any]) -> Callable[[], Any]:
    """16 attention calls, each on the last one's output (16 layers' worth per evaluation)."""

    def run():
        x = q
        for _ in range(16):
            x = step(x)
        return x

    return run


def paged_pool(args: argparse.Namespace, b: int, keys: int) -> tuple[Any, Any, Any]:
    """K, V (1, KVH, S, D) for b rows of `--row-len` slots and a scratch page, and the step's
    PagedKeys: row lengths from keys // 2 to keys (row 0 the longest), pages shuffled."""
    import mlx.core as mx

    from scheduler_proc.decode_attention import PagedKeys

    p = args.page_size
    per_row = max(-(-args.row_len // p), -(-keys // p))
    width = -(-keys // p)
    mx.random.seed(b)
    order = (1 + mx.random.permutation(b * per_row)).reshape(b, per_row)  # NOTE: 0 the scratch
    lens = mx.random.randint(keys // 2, keys + 1, (b,)).astype(mx.int32)
    lens[0] = keys
    shape = (1, args.kv_heads, (1 + b * per_row) * p, args.dim)
    k = mx.random.normal(shape).astype(mx.bfloat16)
    v = mx.random.normal(shape).astype(mx.bfloat16)
    table = order[:, :width].astype(mx.int32)
    mx.eval(k, v, lens, table)
    return k, v, PagedKeys(lens, keys, table, p)


def measure(args: argparse.Namespace, b: int, n: int) -> str:
    import mlx.core as mx

    from scheduler_proc import decode_attention as da

    k, v, keys = paged_pool(args, b, n)
    q = mx.random.normal((b, args.heads, 1, args.dim)).astype(mx.bfloat16)
    scale = args.dim**-0.5
    mask = (mx.arange(n)[None] < keys.lengths[:, None])[:, None, None]
    ks, vs = (
        da._gather(k, keys.table, keys.page_size, n),
        da._gather(v, keys.table, keys.page_size, n),
    )
    mx.eval(q, ks, vs)
    sdpa = mx.fast.scaled_dot_product_attention
    run = {
        "equal": lambda x: sdpa(x, ks, vs, scale=scale),
        "mask": lambda x: sdpa(x, ks, vs, scale=scale, mask=mask),
        "paged": lambda x: da._masked(x, k, v, keys, scale),
        "one": lambda x: da.decode_attention(x, k, v, keys, scale, splits=1),
        "fused": lambda x: da.decode_attention(x, k, v, keys, scale),
    }
    us = {name: timed(chain(q, step), args.iters) * 1e6 for name, step in run.items()}
    diff = da.decode_attention(q, k, v, keys, scale) - da._masked(q, k, v, keys, scale)
    err = mx.max(mx.abs(diff.astype(mx.float32))).item()
    splits = da.split_count(b * args.kv_heads, n)
    return (f"B={b:4d} keys<={n} | us per call: mlx equal {us['equal']:8.1f} | mlx mask "
            f"{us['mask']:8.1f} | paged mask {us['paged']:8.1f} | fused one pass {us['one']:8.1f}"
            f" | fused {splits} split(s) {us['fused']:8.1f} | fused/equal "
            f"{us['fused'] / us['equal']:.2f} | max |fused - mask| {err:.2e}")  # fmt: skip


def main() -> None:
    args = parse_args()
    import mlx.core as mx

    from scheduler_proc import decode_attention as da

    print(f"{mx.default_device()} | kernel: {da.available()} | heads {args.heads}/{args.kv_heads}"
          f" dim {args.dim} bf16 | pools of {args.row_len} slots per row in pages of "
          f"{args.page_size}")  # fmt: skip
    for context in args.context.split(","):
        for b in args.batch.split(","):
            print(measure(args, int(b), int(context)), flush=True)


if __name__ == "__main__":
    main()
