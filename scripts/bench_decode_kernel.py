"""The fused paged decode kernel alone against MLX's fused attention over a dense cache (a GPU).

For each row length: `--rows` rows of one query each, GQA heads as the model has them, keys in
pages shuffled across a pool (as a long run leaves them) read by `decode_attention` (its tiled
kernel and its lanes-over-keys kernel), against
`mx.fast.scaled_dot_product_attention` over a dense (rows, KV heads, length, dim) cache (what
mlx-lm's batch cache reads). Prints each one's median time and the bandwidth it reached
(K and V bytes read / time).

  python3 scripts/bench_decode_kernel.py --rows 128 --lengths 500,2000,4000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--lengths", default="500,2000,4000")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    return p.parse_args()


def timed(fn, iters: int) -> float:
    """Median seconds of `fn()` evaluated alone (after three warm-up runs)."""
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(iters):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one_length(args: argparse.Namespace, length: int) -> str:
    """One row length: each kernel's median time and bandwidth, a line."""
    import mlx.core as mx

    from scheduler_proc import decode_attention as da

    dtype = mx.bfloat16
    lengths = [length] * args.rows
    q, k, v, keys = da._random_case(
        args.heads, args.kv_heads, args.dim, lengths, args.page_size, dtype
    )
    dense = (args.rows, args.kv_heads, length, args.dim)
    dense_k = mx.random.normal(dense).astype(dtype)
    dense_v = mx.random.normal(dense).astype(dtype)
    mx.eval(q, k, v, dense_k, dense_v)
    scale = args.dim**-0.5
    bytes_read = 2 * args.rows * args.kv_heads * length * args.dim * dtype.size
    n = da.split_count(args.rows * args.kv_heads, length)
    runs = {
        "tiles": lambda: da.decode_attention(q, k, v, keys, scale, lanes=False),
        "lanes": lambda: da.decode_attention(q, k, v, keys, scale, lanes=True),
        "dense fused": lambda: mx.fast.scaled_dot_product_attention(
            q, dense_k, dense_v, scale=scale
        ),
    }
    cells = []
    for name, fn in runs.items():
        t = timed(fn, args.iters)
        cells.append(f"{name} {t * 1e6:.0f} us ({bytes_read / t / 1e9:.0f} GB/s)")
    return f"{args.rows} rows x {length} keys ({n} splits): " + ", ".join(cells)


def main() -> None:
    args = parse_args()
    for length in (int(x) for x in args.lengths.split(",")):
        print(one_length(args, length))


if __name__ == "__main__":
    main()
