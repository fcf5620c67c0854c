"""Decode attention alone, B rows of different lengths: the fused kernel vs MLX's own op.

Per configuration, the time of one attention call (16 chained calls per evaluation, as 16 layers):
  - `mlx equal`: `mx.fast.scaled_dot_product_attention` over a slice, every row as long as the
    longest, no mask (mlx-lm's batched case, and MLX's fused decode kernel on CUDA);
  - `mlx mask`: the same slice with a per-row boolean mask (the engine's masked path);
  - `fused`: `scheduler_proc.decode_attention` over the whole pool buffers and row lengths.
It also prints the fused output's largest difference from the masked one (rows alike).

  python3 scripts/bench_decode_attention.py                      # a GPU: the kernel
  .venv/bin/python scripts/bench_decode_attention.py --batch 4   # elsewhere: its masked twin
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
    p.add_argument("--batch", default="16,64,128", help="comma list of row counts")
    p.add_argument("--context", default="600", help="longest row (comma list); rows from half")
    p.add_argument("--row-len", type=int, default=4096, help="pool row length (buffer keys)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    return p.parse_args()


def timed(fn, iters: int) -> float:
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) / 16


def chain(q, step):
    """16 attention calls, each on the last one's output (16 layers' worth per evaluation)."""

    def run():
        x = q
        for _ in range(16):
            x = step(x)
        return x

    return run


def measure(args: argparse.Namespace, b: int) -> str:
    import mlx.core as mx

    from scheduler_proc import decode_attention as da

    mx.random.seed(b)
    lens = mx.random.randint(args.keys // 2, args.keys + 1, (b,)).astype(mx.int32)
    lens[0] = args.keys
    shape = (b + 1, args.kv_heads, args.row_len, args.dim)
    k = mx.random.normal(shape).astype(mx.bfloat16)
    v = mx.random.normal(shape).astype(mx.bfloat16)
    q = mx.random.normal((b, args.heads, 1, args.dim)).astype(mx.bfloat16)
    mx.eval(k, v, q, lens)
    n, scale = args.keys, args.dim**-0.5
    mask = (mx.arange(n)[None] < lens[:, None])[:, None, None]
    ks, vs = k[:b, :, :n], v[:b, :, :n]
    sdpa = mx.fast.scaled_dot_product_attention
    equal = timed(chain(q, lambda x: sdpa(x, ks, vs, scale=scale)), args.iters)
    masked = timed(chain(q, lambda x: sdpa(x, ks, vs, scale=scale, mask=mask)), args.iters)
    one = timed(chain(q, lambda x: da.decode_attention(x, k, v, lens, scale, splits=1)), args.iters)
    fused = timed(chain(q, lambda x: da.decode_attention(x, k, v, lens, scale, n)), args.iters)
    diff = da.decode_attention(q, k, v, lens, scale, n) - sdpa(q, ks, vs, scale=scale, mask=mask)
    err = mx.max(mx.abs(diff.astype(mx.float32))).item()
    splits = da.split_count(b * args.kv_heads, n)
    return (f"B={b:4d} keys<={n} | us per call: mlx equal {equal * 1e6:8.1f} | mlx mask "
            f"{masked * 1e6:8.1f} | fused one pass {one * 1e6:8.1f} | fused {splits} split(s) "
            f"{fused * 1e6:8.1f} | fused/equal {fused / equal:.2f} | max |fused - mask| "
            f"{err:.2e}")  # fmt: skip


def main() -> None:
    args = parse_args()
    import mlx.core as mx

    from scheduler_proc import decode_attention as da

    print(f"{mx.default_device()} | kernel: {da.available()} | heads {args.heads}/{args.kv_heads}"
          f" dim {args.dim} bf16 | buffers of {args.row_len} keys")  # fmt: skip
    for context in args.context.split(","):
        args.keys = int(context)
        for b in args.batch.split(","):
            print(measure(args, int(b)), flush=True)


if __name__ == "__main__":
    main()
