"""Short rows decoding beside one long row, in-process: their time a step, with and without it.

Builds the scheduler as `mlx-engine launch` does (EngineConfig defaults, overlap, warm-up), lets
`--short` requests of `--short-len` prompt tokens decode for `--steps` steps alone, then adds one
request of `--long-len` tokens and, once it decodes too, times `--steps` steps more. Prints the
step time (the short rows' inter-token time) both ways, their ratio, and the bytes the attention's
reads copied a step against the KV the rows hold (`KVPool.gathered_bytes`). `--set K=V` changes
one EngineConfig field (e.g. `fused_decode=off` on a GPU, to time the gathered path).

  .venv/bin/python scripts/bench_skewed_decode.py --long-len 8000            # CPU, default model
  .venv/bin/python scripts/bench_skewed_decode.py --long-len 8000 --unfolded # as before the fold
  python3 scripts/bench_skewed_decode.py --model /tmp/llama1b --set fused_decode=off
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--short", type=int, default=15)
    p.add_argument("--short-len", type=int, default=200)
    p.add_argument("--long-len", type=int, default=30000)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--set", action="append", default=[], help="EngineConfig field=value")
    p.add_argument(
        "--unfolded",
        action="store_true",
        help="one-token rows' query heads not folded on the CPU (decode_attention.folded)",
    )
    return p.parse_args()


def timed_steps(sched, steps: int) -> tuple[float, float]:
    """(median seconds a step, gathered bytes a step over the KV held) over `steps` steps."""
    held = sched.running.tokens_in_use() * sched.pool.token_bytes
    before = sched.pool.gathered_bytes
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (sched.pool.gathered_bytes - before) / (steps * held)


def main() -> None:
    args = parse_args()
    import logging

    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None, log_line=False)  # NOTE: before MLX is imported (its BLAS on Linux)
    from profile_scheduler import config_from

    from engine.sampling_params import SamplingParams
    from scheduler_proc import decode_attention
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.scheduler import Scheduler

    if args.unfolded:
        decode_attention._fold_heads = lambda: False  # NOTE: as before the fold, to compare
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    config = config_from(args.set)
    model, eos = load_for_scheduler(args.model, config)
    sched = Scheduler(config, model, eos)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)

    def submit(rid: str, n: int) -> None:
        sched.submit(rid, [rng.randrange(sched.vocab) for _ in range(n)], params)

    for i in range(args.short):
        submit(f"s{i}", args.short_len)
    while sched.running.n_decode < args.short:
        sched.step()
    alone, alone_read = timed_steps(sched, args.steps)
    submit("long", args.long_len)
    t0 = time.perf_counter()
    while sched.running.n_decode < args.short + 1:
        sched.step()
    prefill_s = time.perf_counter() - t0
    beside, beside_read = timed_steps(sched, args.steps)
    print(f"short rows {args.short} x {args.short_len} tokens, long row {args.long_len} tokens")
    print(f"step alone {alone * 1e3:.1f} ms (gathered {alone_read:.2f}x held)")
    print(f"step beside the long row {beside * 1e3:.1f} ms (gathered {beside_read:.2f}x held)")
    print(f"ratio {beside / alone:.2f}x; the long row's prefill {prefill_s:.1f} s")


if __name__ == "__main__":
    main()
