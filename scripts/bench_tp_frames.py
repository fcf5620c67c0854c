"""The tensor-parallel frame path alone: what each `--tp-frames` carrier costs per loop iteration.

Two (or --tp) ranks formed as the engine forms them (engine/distributed.py), each iteration as
`ReplicatedLoop._iterate` runs it: the frame's `start`, a stand-in step, the frame's `finish`.
The stand-in step keeps the overlap loop's shape: the next "forward" (`--layers` matmuls of
`--dim`, each followed by an `all_sum` as a sharded model's are) is queued with `async_eval`, then
the previous one is waited for. Rank 0 posts a small command every `--post-every` iterations.
Prints, per carrier, rank 0's p50 / p90 of an iteration and of the wait in `finish()`.

CPU (ring):  .venv/bin/python scripts/bench_tp_frames.py --frames tcp,collective
Two GPUs:    NCCL_NVLS_ENABLE=0 python3 scripts/bench_tp_frames.py --backend nccl --dim 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--frames", default="tcp,collective", help="carriers to measure, in order")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backend", default="auto", help="ring, nccl or auto")
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--dim", type=int, default=128, help="stand-in step: matmul size (0: no step)")
    p.add_argument("--layers", type=int, default=4, help="stand-in step: matmul + all_sum pairs")
    p.add_argument("--post-every", type=int, default=8)
    p.add_argument("--rank", default=None, help=argparse.SUPPRESS)  # internal: a rank's plan
    return p.parse_args()


def rank_main(args: argparse.Namespace, frames: str) -> None:
    from engine.distributed import RankPlan, pin_share

    raw = json.loads(args.rank)
    plan = RankPlan(**{**raw, "hosts": tuple(tuple(h) for h in raw["hosts"])})
    plan.enter()
    pin_share(plan)
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None, log_line=False)
    import mlx.core as mx

    from engine.config import EngineConfig
    from engine.distributed import join_group
    from engine.messages.to_scheduler import Abort
    from scheduler_proc.rank import open_channel

    group = join_group(plan)
    bcast = open_channel(EngineConfig(tp_frames=frames), group, plan)
    w = mx.random.normal((args.dim, args.dim)) / args.dim**0.5 if args.dim else None

    def forward(x: mx.array) -> mx.array:
        for _ in range(args.layers):
            x = mx.distributed.all_sum(x @ w, group=group)
        return x

    x = mx.ones((8, args.dim)) if args.dim else None
    in_flight = None
    iters, waits = [], []
    for it in range(1, args.iterations + 1):
        t0 = time.perf_counter()
        if plan.rank == 0 and it % args.post_every == 0:
            bcast.post(Abort(f"r{it}"))
        bcast.start(it, 7)
        if x is not None:
            nxt = forward(x)
            mx.async_eval(nxt)  # NOTE: the next step queued, then the one in flight read
            if in_flight is not None:
                in_flight.tolist()
            in_flight, x = nxt, nxt * 0.5
        t1 = time.perf_counter()
        bcast.finish()
        t2 = time.perf_counter()
        iters.append(t2 - t0)
        waits.append(t2 - t1)
    if in_flight is not None:
        in_flight.tolist()  # NOTE: no rank leaves with a collective pending
    bcast.close()
    if plan.rank == 0:
        skip = len(iters) // 10  # NOTE: the first tenth warms up
        print("FIGURES " + json.dumps({"iteration": iters[skip:], "wait": waits[skip:]}))


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e6


def run(args: argparse.Namespace, frames: str) -> dict[str, float]:
    from engine.config import EngineConfig
    from engine.distributed import topology

    run_dir = Path(tempfile.mkdtemp(prefix="bench-tp-frames-"))
    topo = topology(EngineConfig(tp=args.tp, tp_backend=args.backend), run_dir)
    assert topo is not None
    procs = []
    for rank in range(args.tp):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--frames", frames]
        cmd += ["--rank", json.dumps(topo.plan(rank).__dict__)]
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, stdout=out, text=True, cwd=ROOT))
    try:
        text = procs[0].communicate(timeout=600)[0]
    finally:
        for p in procs:
            p.wait(30) if p.poll() is None else None
    lines = [ln for ln in text.splitlines() if ln.startswith("FIGURES ")]
    if not lines:
        raise RuntimeError(f"--tp-frames {frames}: rank 0 gave no figures:\n{text[-3000:]}")
    got = json.loads(lines[-1][len("FIGURES ") :])
    return {f"{k} p{q}": pct(got[k], q) for k in ("iteration", "wait") for q in (50, 90)}


def main() -> None:
    args = parse()
    from mlx_engine.bench.servers import unwind_on_sigterm

    unwind_on_sigterm()
    kinds = [f.strip() for f in args.frames.split(",") if f.strip()]
    if args.rank is not None:
        rank_main(args, kinds[-1])
        return
    print(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, {vars(args)}", flush=True)
    print("| --tp-frames | iteration p50 us | p90 | wait in finish() p50 us | p90 |")
    print("|---|---|---|---|---|")
    for frames in kinds:
        f = run(args, frames)
        print(
            f"| {frames} | {f['iteration p50']:.0f} | {f['iteration p90']:.0f} | "
            f"{f['wait p50']:.0f} | {f['wait p90']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
