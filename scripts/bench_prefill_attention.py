"""Prompt-chunk attention: MLX's fast op with a mask against `prefill_attention` (MLX's ops).

For each (rows, width, keys) shape, a causal chunk at the end of each row's keys: the first call
(what a shape first seen after READY costs) and the steady median, and the peak memory above
what the inputs hold. This decided `--prefill-attention auto` (docs/kv_cache.md):

  python3 scripts/bench_prefill_attention.py                     # a GPU: the shapes below
  .venv/bin/python scripts/bench_prefill_attention.py --shapes 2x8x32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = (
    "128x64x256,128x64x512,64x128x1024,16x512x1024,8x1024x2048,"
    "1x2048x8192,1x256x32768,4x256x32768,1x2048x32768"
)


def timed(fn, *args) -> tuple[float, float, float]:
    """(first call ms, steady median ms, peak MiB above the inputs)."""
    import mlx.core as mx

    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.perf_counter()
    mx.eval(fn(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return first * 1e3, sorted(times)[2] * 1e3, (mx.get_peak_memory() - base) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help="comma list of ROWSxWIDTHxKEYS")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    import mlx.core as mx

    from scheduler_proc import prefill_attention

    scale = args.dim**-0.5

    def fast(q, k, v, mask):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    def ops(q, k, v, mask):
        return prefill_attention.attention(q, k, v, scale, mask)

    def causal(q, k, v, mask):
        # NOTE: one row's chunk at the end of its keys needs no array mask: the fast op's
        # bottom-right causal mask is the same attention (cuDNN builds per shape on CUDA).
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    print(f"{mx.default_device()} heads {args.heads}/{args.kv_heads} dim {args.dim} bf16")
    for shape in args.shapes.split(","):
        rows, width, keys = (int(x) for x in shape.split("x"))
        q = mx.random.normal((rows, args.heads, width, args.dim)).astype(mx.bfloat16)
        k = mx.random.normal((rows, args.kv_heads, keys, args.dim)).astype(mx.bfloat16)
        v = mx.random.normal((rows, args.kv_heads, keys, args.dim)).astype(mx.bfloat16)
        query = keys - width + mx.arange(width)
        mask = mx.broadcast_to(
            (mx.arange(keys)[None] <= query[:, None])[None, None], (rows, 1, width, keys)
        )
        mx.eval(q, k, v, mask)
        line = f"rows {rows:4d} width {width:5d} keys {keys:6d}"
        kinds = (("fast", fast), ("ops", ops)) + ((("causal", causal),) if rows == 1 else ())
        for name, fn in kinds:
            first, steady, peak = timed(fn, q, k, v, mask)
            line += f" | {name}: first {first:6.1f} ms, steady {steady:6.2f} ms, {peak:6.0f} MiB"
        if rows == 1:  # NOTE: the causal string must be the masked attention, not just fast
            gap = mx.abs(causal(q, k, v, mask) - ops(q, k, v, mask)).max().item()
            line += f" | causal vs ops max |diff| {gap:.3g}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
