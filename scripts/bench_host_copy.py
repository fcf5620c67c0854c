"""What the disk tier's host copies cost chained steps, in-process (for diagnosis).

On CUDA a host view of an MLX array moves its buffer into managed memory with a synchronous copy
(MLX's `Buffer::raw_ptr`), and the freed buffer goes back to MLX's cache, where a later step's
allocation may take it. This runs chained "steps" (`--layers` matmuls of `--tokens` x `--dim`,
two in flight, each one's small result read back, as the overlap loop does) and, every `--every`
steps with nothing in flight (as the engine flushes), gathers `--flush-mb` from a pool into one
`disk_tier.HostCopy`, the engine's own, whose host copy is made by the variant:

  none    no flush at all (the baseline)
  gather  the gather only, never copied to the host
  writer  on a writer thread, then written to a file and dropped (what the engine does)
  here    on the step's thread at the flush, nothing in flight; written by the writer
  hold    as writer, but each copy is kept (up to --hold-gb), so its buffer never goes back to
          MLX's cache

A flush waits while the writer is busy (the engine bounds its queue too). Per variant: the step's
median, p99 and mean (a flush's own time is in the step after it), and the flushes made.

  python3 scripts/bench_host_copy.py                      # a GPU: every variant, ~15 s each
  .venv/bin/python scripts/bench_host_copy.py --dim 256 --tokens 64 --seconds 3
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from scheduler_proc.disk_tier import HostCopy  # noqa: E402

VARIANTS = ("none", "gather", "writer", "here", "hold")
HEADS, DIM = 8, 64  # NOTE: the pool's shape per token (a 1B Llama's KV heads), bf16
TOKEN_BYTES = HEADS * DIM * 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dim", type=int, default=4096, help="the steps' matmul size")
    p.add_argument("--tokens", type=int, default=512, help="rows of a step's activations")
    p.add_argument("--layers", type=int, default=32, help="matmuls a step")
    p.add_argument("--every", type=int, default=10, help="steps between flushes")
    p.add_argument("--flush-mb", type=int, default=64)
    p.add_argument("--pool-gb", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=8.0, help="each variant's run")
    p.add_argument("--hold-gb", type=float, default=8.0, help="most the hold variant keeps")
    return p.parse_args()


class Writer:
    """The disk writer's part: make the host arrays (the copy, unless made already), write them
    to a file, drop them."""

    def __init__(self, folder: Path) -> None:
        self.jobs: queue.Queue[HostCopy | None] = queue.Queue()
        self.path = folder / "flush.bin"
        self.copy_s = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def copied(self, nbytes: int, seconds: float) -> None:
        self.copy_s += seconds

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            with open(self.path, "wb") as f:
                for a in job.arrays():
                    f.write(np.ascontiguousarray(a).data)
            del job
            self.jobs.task_done()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


def run(variant: str, args: argparse.Namespace, folder: Path) -> str:
    mx.random.seed(0)
    weights = [mx.random.normal((args.dim, args.dim)).astype(mx.bfloat16) for _ in range(4)]
    tokens = int(args.pool_gb * (1 << 30)) // TOKEN_BYTES
    pool = mx.zeros((HEADS, tokens, DIM), mx.bfloat16)
    mx.eval(weights, pool)
    per_flush = (args.flush_mb << 20) // TOKEN_BYTES
    writer = Writer(folder)
    held: list[HostCopy] = []
    hold = int(args.hold_gb * (1 << 30)) // (args.flush_mb << 20) if variant == "hold" else 0

    def step(x: mx.array) -> tuple[mx.array, mx.array]:
        for i in range(args.layers):
            x = (x @ weights[i % len(weights)]) * 0.01
        return x, x[0, :4].sum()

    def flush(k: int) -> None:
        start = (k * 7919) % max(1, tokens - per_flush)
        index = mx.array(np.arange(start, start + per_flush, dtype=np.int32))
        host = HostCopy([mx.take(pool, index, axis=1)], writer.copied)
        if variant == "gather":
            return
        if variant == "here":
            host.arrays()
        if len(held) < hold:  # NOTE: its host views keep the copied buffer alive
            held.append(host)
        writer.jobs.put(host)

    x, s = step(mx.random.normal((args.tokens, args.dim)).astype(mx.bfloat16))
    mx.async_eval(x, s)
    times, flushes, n = [], 0, 0
    last = time.perf_counter()
    end = last + args.seconds
    while time.perf_counter() < end:
        nx, ns = step(x)
        mx.async_eval(nx, ns)  # NOTE: the next step is queued before this one's result is read
        s.item()
        now = time.perf_counter()
        times.append(now - last)
        last, x, s, n = now, nx, ns, n + 1
        if variant != "none" and n % args.every == 0 and writer.jobs.unfinished_tasks == 0:
            ns.item()  # NOTE: nothing in flight, as at the engine's settle
            flush(n)
            flushes += 1
    writer.close()
    times = sorted(times[len(times) // 10 :])
    p99 = times[int(len(times) * 0.99)]
    return (
        f"{variant:7s} {len(times):6d} steps: median {statistics.median(times) * 1e3:.2f} ms, "
        f"p99 {p99 * 1e3:.2f} ms, mean {statistics.mean(times) * 1e3:.2f} ms; "
        f"{flushes} flushes, host copies {writer.copy_s * 1e3:.0f} ms"
    )


def main() -> None:
    args = parse_args()
    print(f"# {mx.default_device()}, MLX {getattr(mx, '__version__', '?')}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
            print(run(variant, args, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
