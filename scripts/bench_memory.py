#!/usr/bin/env python3
"""Memory under a steady mixed load: MLX's cache as Metal leaves it, and as the engine sets it.

The in-process engine serves `--concurrency` closed-loop clients for `--minutes`: short and long
prompts (some sharing a prefix, so the prefix cache holds pages), outputs of 16-192 tokens. Every
`--sample-s` the run samples MLX's active and cached memory, the process's RSS and the KV pool.
After the load it idles a few seconds (the pool shrinks, the cache is cleared) and samples again.
The peak is reported against the bound: KV budget + weights + 10 %.

Each policy runs in a process of its own, one after the other, on MLX's CPU backend with the
cache limit of the policy (the CPU's own is 32 MiB):
  metal-default  what Metal's allocator allows: it keeps freed buffers until active + cache
                 reach 95 % of the recommended working set (emulated here as 3/4 of RAM, what
                 macOS recommends on larger Macs): the engine on a Mac without its own limit;
  engine         the limit the engine sets on Metal (scheduler_proc/memory_limits.py).

  .venv/bin/python scripts/bench_memory.py --minutes 3
  .venv/bin/python scripts/bench_memory.py --policy engine --max-total-tokens 65536
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("metal-default", "engine")
BOUND_MARGIN = 1.10
WORKING_SET_SHARE = 0.75  # NOTE: macOS's recommended working set, of RAM, on larger Macs
IDLE_S = 3.0  # NOTE: the engine goes idle after 1 s (scheduler_proc/loop_rules.py)
PREFIXES, PREFIX_LEN = 4, 256


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded)")
    p.add_argument("--minutes", type=float, default=30.0, help="load per policy")
    p.add_argument("--policy", choices=(*POLICIES, "both"), default="both")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="the KV budget")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--long-share", type=float, default=0.2, help="prompts of 1-3k tokens")
    p.add_argument("--sample-s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    return p.parse_args()


@dataclass
class Figures:
    policy: str
    cache_limit: int
    kv_budget: int
    weights: int
    bound: int
    rss_start: int  # before the engine
    peak_mlx: int = 0  # active + cache
    peak_active: int = 0
    peak_cache: int = 0
    peak_rss: int = 0
    peak_pool: int = 0
    idle_mlx: int = 0  # after the load, once idle
    idle_rss: int = 0
    idle_pool: int = 0
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    minutes: list[dict[str, int]] = field(default_factory=list)  # each minute's peaks


class Sampler(threading.Thread):
    """MLX's counters and the RSS, every `period` s (MLX's getters only read counters)."""

    def __init__(self, fig: Figures, sched: Any, period: float) -> None:
        super().__init__(daemon=True)
        self.fig, self.sched, self.period = fig, sched, period
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.sample()

    def sample(self) -> tuple[int, int, int]:
        import mlx.core as mx
        import psutil

        fig = self.fig
        active, cache = mx.get_active_memory(), mx.get_cache_memory()
        rss, pool = psutil.Process().memory_info().rss, self.sched.pool.nbytes
        fig.peak_mlx = max(fig.peak_mlx, active + cache)
        fig.peak_active, fig.peak_cache = max(fig.peak_active, active), max(fig.peak_cache, cache)
        fig.peak_rss, fig.peak_pool = max(fig.peak_rss, rss), max(fig.peak_pool, pool)
        minute = int((time.monotonic() - self.t0) // 60)
        while len(fig.minutes) <= minute:
            fig.minutes.append({"mlx": 0, "rss": 0, "pool": 0})
        row = fig.minutes[minute]
        row["mlx"], row["rss"] = max(row["mlx"], active + cache), max(row["rss"], rss)
        row["pool"] = max(row["pool"], pool)
        return active + cache, rss, pool


def metal_default_limit() -> int:
    import psutil

    return int(0.95 * WORKING_SET_SHARE * psutil.virtual_memory().total)


def prompt(
    rng: random.Random, vocab: int, prefixes: list[list[int]], long_share: float
) -> list[int]:
    n = rng.randint(1024, 3072) if rng.random() < long_share else rng.randint(32, 512)
    head = rng.choice(prefixes) if rng.random() < 0.3 else []
    return head + [rng.randrange(vocab) for _ in range(n)]


async def load(client: Any, args: argparse.Namespace, vocab: int, fig: Figures) -> None:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    end = time.monotonic() + args.minutes * 60

    async def one_client(k: int) -> None:
        mine = random.Random(args.seed * 1000 + k)
        while time.monotonic() < end:
            ids = prompt(mine, vocab, prefixes, args.long_share)
            max_tokens = mine.randint(16, 192)
            r = await client.generate(input_ids=ids, max_tokens=max_tokens, temperature=0.7)
            fig.requests += 1
            fig.tokens += r.usage.completion_tokens

    await asyncio.gather(*(one_client(k) for k in range(args.concurrency)))


def run_policy(args: argparse.Namespace) -> Figures:
    """One policy in this process: start the engine, set the cache limit, load, idle."""
    import psutil

    from engine.config import EngineConfig
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(EngineConfig(), log_line=False)  # NOTE: before MLX is imported
    import mlx.core as mx

    from engine.client import AsyncEngineClient
    from engine.memory import weights_bytes
    from mlx_engine.inprocess import InProcessEngine

    rss_start = psutil.Process().memory_info().rss
    engine = InProcessEngine(args.model, max_total_tokens=args.max_total_tokens)
    sched = engine.sched
    limit = metal_default_limit() if args.policy == "metal-default" else sched.limits.cache
    mx.set_cache_limit(limit)
    plan = sched.kv_plan
    kv, weights = (
        plan.budget.tokens * plan.budget.bytes_per_token,
        weights_bytes(sched.runner.model),
    )
    bound = int(BOUND_MARGIN * (kv + weights))
    fig = Figures(args.policy, limit, kv, weights, bound, rss_start)
    sampler = Sampler(fig, sched, args.sample_s)
    sampler.start()
    t0 = time.monotonic()

    async def serve() -> None:
        async with AsyncEngineClient("", timeout=3600, transport=engine) as client:
            await load(client, args, int(sched.vocab), fig)
            fig.seconds = time.monotonic() - t0
            await asyncio.sleep(IDLE_S)

    asyncio.run(serve())
    sampler.stop.set()
    sampler.join()
    fig.idle_mlx, fig.idle_rss, fig.idle_pool = sampler.sample()
    return fig


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def report(figs: list[Figures]) -> None:
    f0 = figs[0]
    print(
        f"bound: KV budget {_gib(f0.kv_budget)} GiB + weights {_gib(f0.weights)} GiB + 10 % = "
        f"{_gib(f0.bound)} GiB"
    )
    head = (
        "policy         cache limit  peak MLX (active+cache)  peak cache  peak pool  "
        "peak RSS (- start)  idle MLX  idle RSS  req  tok/s"
    )
    print(head)
    for f in figs:
        within = "within" if f.peak_mlx <= f.bound else "OVER"
        print(
            f"{f.policy:<14} {_gib(f.cache_limit):>8} GiB  {_gib(f.peak_mlx):>7} GiB ({within})"
            f"{_gib(f.peak_cache):>14}  {_gib(f.peak_pool):>9}  "
            f"{_gib(f.peak_rss):>6} ({_gib(f.peak_rss - f.rss_start)}) GiB  "
            f"{_gib(f.idle_mlx):>8}  {_gib(f.idle_rss):>8}  {f.requests:>3}  "
            f"{f.tokens / max(f.seconds, 1e-9):5.1f}"
        )
    for f in figs:
        per_minute = ", ".join(_gib(m["mlx"]) for m in f.minutes)
        print(f"{f.policy}: MLX active+cache peak per minute (GiB): {per_minute}")


def main() -> None:
    args = parse()
    if args.policy != "both":
        fig = run_policy(args)
        print("FIGURES " + json.dumps(asdict(fig)), flush=True)
        report([fig])
        return
    figs = []
    for policy in POLICIES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--policy", policy]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("FIGURES "))
        figs.append(Figures(**json.loads(line.removeprefix("FIGURES "))))
        print(f"{policy}: done ({figs[-1].requests} requests)", flush=True)
    report(figs)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(f) for f in figs], indent=1))


if __name__ == "__main__":
    main()
