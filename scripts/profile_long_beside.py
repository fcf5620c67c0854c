"""Long prompts beside decoding chats, in-process: the chats' inter-token gaps (for diagnosis).

Builds the scheduler as `mlx-engine launch` does (EngineConfig defaults, overlap, warm-up), lets
`--chats` requests decode, records every chat's gap between tokens for `--alone-steps` steps,
then submits `--long` prompts of `--long-len` tokens and records the gaps until every long one
has its first token; then the same long prompts once more with no chat running. Prints the gaps'
p50 / p99 alone and beside, their ratio, the long prompts' TTFT, and the step medians.
`--set K=V` changes one EngineConfig field (scripts/profile_scheduler.py). The figures users get
come from scripts/bench_long_context.sh over HTTP; this says where the time goes.

  python3 scripts/profile_long_beside.py --model /tmp/llama1b --set long_prefill_chunk=256
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
    p.add_argument("--model", required=True)
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--chat-prompt", default="128:512", help="chat prompt tokens LOW:HIGH")
    p.add_argument("--alone-steps", type=int, default=300)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-len", type=int, default=30000)
    p.add_argument("--set", action="append", default=[], help="EngineConfig field=value")
    return p.parse_args()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


class Clock:
    """Steps the scheduler, timing each chat's tokens and each long prompt's first one."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.last: dict[str, float] = {}
        self.first: dict[str, float] = {}

    def run(self, steps: int | None = None, until: set[str] | None = None) -> list[float]:
        gaps: list[float] = []
        n = 0
        while (steps is None or n < steps) and (until is None or not until <= set(self.first)):
            outs = self.sched.step()
            now = time.perf_counter()
            n += 1
            for out in outs:
                if not out.token_ids:
                    continue
                if out.rid.startswith("chat") and out.rid in self.last:
                    gaps.append((now - self.last[out.rid]) / len(out.token_ids))
                self.last[out.rid] = now
                self.first.setdefault(out.rid, now)
        return gaps


def main() -> None:
    args = parse_args()
    import logging

    from profile_scheduler import config_from

    from engine.sampling_params import SamplingParams
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.scheduler import Scheduler

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    config = config_from(args.set)
    model, eos = load_for_scheduler(args.model, config)
    sched = Scheduler(config, model, eos)
    rng = random.Random(0)
    lo, hi = (int(x) for x in args.chat_prompt.split(":"))
    chat = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    clock = Clock(sched)
    for i in range(args.chats):
        sched.submit(
            f"chat{i}", [rng.randrange(sched.vocab) for _ in range(rng.randint(lo, hi))], chat
        )
    clock.run(until={f"chat{i}" for i in range(args.chats)})
    alone = clock.run(steps=args.alone_steps)

    def long_wave(tag: str) -> list[float]:
        rids = {f"{tag}{i}" for i in range(args.long)}
        t0 = time.perf_counter()
        for rid in sorted(rids):
            sched.submit(rid, [rng.randrange(sched.vocab) for _ in range(args.long_len)], first)
        gaps = clock.run(until=rids)
        ttft = sorted(clock.first[r] - t0 for r in rids)
        print(f"  {tag}: TTFT {', '.join(f'{t:.2f}' for t in ttft)} s")
        return gaps

    before = sched.stats()
    beside = long_wave("long")
    mid = sched.stats()
    tail = clock.run(steps=20)  # NOTE: the long rows finish; the chats' chain comes back
    for i in range(args.chats):
        sched.abort(f"chat{i}")
    clock.run(steps=3)
    long_wave("solo")
    after = sched.stats()
    steps = {k: mid[k] - before[k] for k in ("steps_prefill", "steps_decode", "steps_chained")}
    print(f"config: {args.set or 'defaults'}; beside the long prompts: {steps}")
    print(
        f"  chats alone p50 / p99 {pct(alone, 0.5):.1f} / {pct(alone, 0.99):.1f} ms; beside"
        f" {pct(beside, 0.5):.1f} / {pct(beside, 0.99):.1f} ms (ratio"
        f" {pct(beside, 0.5) / pct(alone, 0.5):.2f}x / {pct(beside, 0.99) / pct(alone, 0.99):.2f}x);"
        f" mean {statistics.fmean(beside) * 1e3:.1f} ms; after {pct(tail, 0.5):.1f} ms"
    )
    print("  exit:", {k: v for k, v in after.items() if k.startswith("step_")})
    sched.shutdown()


if __name__ == "__main__":
    main()
