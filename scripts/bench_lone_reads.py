"""Lone chunks' key reads: one step of `--rows` lone chunks over the real paged pool, per layer.

A step of lone chunks (`--long-prefill-chunk`: several long prompts' later chunks, each row
attending on its own by the causal kernel) reads every row's keys from its pages. This times
that step's attention, every layer: the pool's own reads (`KVPool.ragged_view(...).groups`:
rows reading as many keys gathered, and dequantized, together) against gathering each row alone
(what it did before), at bf16 and with 8-bit pages. Pages are shuffled, as a busy pool's are.

  python3 scripts/bench_lone_reads.py                      # a GPU: 16 rows of 512 over 1.5-3k keys
  .venv/bin/python scripts/bench_lone_reads.py --rows 4 --layers 2 --keys 1024
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from scheduler_proc.kv_cache import KVPool, StepRows  # noqa: E402
from scheduler_proc.kv_layout import LayerShape, Layout  # noqa: E402
from scheduler_proc.kv_quant import KVQuant  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--width", type=int, default=512, help="a lone chunk's tokens")
    p.add_argument("--keys", default="1536,3072", help="keys each row reads, comma-separated")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", default="32/8", help="query/KV heads (a 1B Llama's)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def make_pool(args, keys: int, bits: int) -> tuple[KVPool, list[list[int]]]:
    kv_heads = int(args.heads.split("/")[1])
    layout = Layout.attention_only(
        [LayerShape(kv_heads, args.dim, args.dim, mx.bfloat16)] * args.layers
    )
    per_row = -(-keys // args.page)
    pages = per_row * args.rows * 2
    quant = KVQuant(bits, 64) if bits else None
    pool = KVPool(
        layout, pages, args.page, slots=args.rows + 1, context=keys, chunk=args.width, quant=quant
    )
    ids = list(range(1, pages + 1))
    random.Random(0).shuffle(ids)
    return pool, [ids[i * per_row : (i + 1) * per_row] for i in range(args.rows)]


def step_attention(args, pool: KVPool, tables: list[list[int]], keys: int, alone: bool) -> float:
    """Median ms of one step's attention over every layer (its reads and the causal kernel)."""
    heads = int(args.heads.split("/")[0])
    start = keys - args.width
    plan = StepRows(
        slots=list(range(args.rows)),
        tables=tables,
        starts=[start] * args.rows,
        lengths=[args.width] * args.rows,
        width=args.width,
    )
    q = mx.random.normal((args.rows, heads, args.width, args.dim)).astype(mx.bfloat16)
    mx.eval(q)

    def once() -> None:
        caches = pool.ragged_view(plan, keys, causal=True)
        outs = []
        for layer, cache in enumerate(caches):
            if alone:
                for i, table in enumerate(tables):
                    k = pool.gather([table], keys, pool.keys[layer])
                    v = pool.gather([table], keys, pool.values[layer])
                    outs.append(attend(q[i : i + 1], k, v))
                continue
            for part in cache.groups().parts:
                outs.append(attend(q[part.rows], part.keys, part.values))
        mx.eval(outs)

    once()
    times = []
    for _ in range(args.repeats):
        mx.synchronize()
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def attend(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask="causal")


def main() -> None:
    args = parse_args()
    print(f"{mx.default_device()}: {args.rows} lone rows of {args.width}, {args.layers} layers")
    print(f"{'keys':>6} {'bits':>4} {'alone ms':>9} {'grouped ms':>11}")
    for keys in (int(k) for k in args.keys.split(",")):
        for bits in (0, 8):
            pool, tables = make_pool(args, keys, bits)
            alone = step_attention(args, pool, tables, keys, alone=True)
            grouped = step_attention(args, pool, tables, keys, alone=False)
            print(f"{keys:>6} {bits or 16:>4} {alone:>9.1f} {grouped:>11.1f}")


if __name__ == "__main__":
    main()
