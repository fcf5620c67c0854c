"""Benchmark the scheduler against mlx-lm's BatchGenerator and single-stream generation.

One run, one model, one workload for every engine, so the printed ratios compare like with like:
  - closed-loop throughput at each concurrency (all requests queued at t=0),
  - a staggered-arrival variant (requests arrive at a fixed rate while others decode),
  - single-request decode tok/s against mlx_lm.generate.generate_step.
Workload (DESIGN.md §7 / issue 4): prompt lengths uniform in [32, 1024], max_tokens uniform in
[32, 256], ignore_eos, fixed seed. `--max-prompt` / `--max-tokens` / `--num-requests` shrink it.

  .venv/bin/python scripts/bench_scheduler.py                       # default model, full workload
  .venv/bin/python scripts/bench_scheduler.py --num-requests 8 --max-tokens 32 --max-prompt 128 \
      --concurrency 1,4 --single-tokens 32                          # a quick run
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after start (staggered variant)


@dataclass
class Result:
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_p50(self) -> float:
        return statistics.median(self.ttft) if self.ttft else 0.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--single-tokens", type=int, default=128, help="single-stream decode length")
    p.add_argument("--stagger-concurrency", type=int, default=16)
    p.add_argument(
        "--stagger-interval", type=float, default=0.0, help="s between arrivals; 0: auto"
    )
    p.add_argument("--blas", default="auto", help="auto | reference | path (engine.cpu_backend)")
    p.add_argument("--dequantize", default="auto", help="auto | on | off (engine.cpu_dequantize)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of: closed, stagger, single")
    return p.parse_args()


def make_workload(args: argparse.Namespace, vocab: int, interval: float) -> Workload:
    rng = random.Random(args.seed)
    n = args.num_requests
    lo_t, hi_t = min(args.min_tokens, args.max_tokens), args.max_tokens
    lo_p, hi_p = min(args.min_prompt, args.max_prompt), args.max_prompt
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo_p, hi_p))] for _ in range(n)]
    return Workload(
        prompts, [rng.randint(lo_t, hi_t) for _ in range(n)], [i * interval for i in range(n)]
    )


# -- engines ----------------------------------------------------------------------------------
def run_ours(model, eos, wl: Workload, concurrency: int, staggered: bool) -> Result:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    ctx = max(len(p) for p in wl.prompts) + max(wl.max_tokens) + 1
    config = EngineConfig(
        max_running_requests=concurrency, context_length=ctx, max_total_tokens=concurrency * ctx
    )
    sched = Scheduler(config, model, eos)
    first: dict[str, float] = {}
    submitted, total, n = 0, 0, len(wl.prompts)
    start = time.perf_counter()
    while submitted < n or sched.has_work():
        now = time.perf_counter() - start
        while submitted < n and (not staggered or wl.arrivals[submitted] <= now):
            params = SamplingParams(
                max_tokens=wl.max_tokens[submitted], temperature=0.0, ignore_eos=True
            )
            sched.submit(str(submitted), wl.prompts[submitted], params)
            submitted += 1
        if not sched.has_work():
            time.sleep(max(0.0, wl.arrivals[submitted] - now))
            continue
        for out in sched.step():
            total += len(out.token_ids)
            first.setdefault(out.rid, time.perf_counter() - start)
    seconds = time.perf_counter() - start
    sched.shutdown()
    ttft = [first[str(i)] - (wl.arrivals[i] if staggered else 0.0) for i in range(n)]
    return Result(total, seconds, ttft)


def run_batch_generator(model, wl: Workload, concurrency: int, staggered: bool) -> Result:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=max(wl.max_tokens),
        completion_batch_size=concurrency,
        prefill_batch_size=min(concurrency, 8),
    )
    first: dict[int, float] = {}
    uid_to_i: dict[int, int] = {}
    submitted, total, done, n = 0, 0, 0, len(wl.prompts)
    start = time.perf_counter()
    while done < n:
        now = time.perf_counter() - start
        batch = []
        while submitted < n and (not staggered or wl.arrivals[submitted] <= now):
            batch.append(submitted)
            submitted += 1
        if batch:
            uids = gen.insert([wl.prompts[i] for i in batch], [wl.max_tokens[i] for i in batch])
            uid_to_i.update(zip(uids, batch, strict=True))
        if submitted == done:  # nothing in flight: wait for the next arrival
            time.sleep(max(0.0, wl.arrivals[submitted] - now))
            continue
        _, responses = gen.next()
        for r in responses:
            total += 1
            first.setdefault(r.uid, time.perf_counter() - start)
            done += r.finish_reason is not None
    seconds = time.perf_counter() - start
    gen.close()
    arrivals = {uid: (wl.arrivals[i] if staggered else 0.0) for uid, i in uid_to_i.items()}
    return Result(total, seconds, [first[u] - arrivals[u] for u in first])


def single_stream_mlx_lm(model, prompt: list[int], n: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    times = []
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    for _ in steps:
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def single_stream_ours(model, eos, prompt: list[int], n: int) -> float:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    ctx = len(prompt) + n + 1
    sched = Scheduler(
        EngineConfig(max_running_requests=1, context_length=ctx, max_total_tokens=ctx), model, eos
    )
    sched.submit("s", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    while sched.has_work():
        for out in sched.step():
            times += [time.perf_counter()] * len(out.token_ids)
    sched.shutdown()
    return (len(times) - 1) / (times[-1] - times[0])


# -- report -----------------------------------------------------------------------------------
def closed_loop(model, eos, wl: Workload, concurrencies: list[int]) -> None:
    print("\n== closed loop: all requests queued at t=0 (generated tok/s) ==")
    print(
        f"{'conc':>5} {'ours':>9} {'BatchGen':>9} {'ratio':>6} {'ttft50 ours':>12} {'ttft50 BG':>10}"
    )
    for c in concurrencies:
        ours = run_ours(model, eos, wl, c, staggered=False)
        bg = run_batch_generator(model, wl, c, staggered=False)
        print(
            f"{c:>5} {ours.tok_s:>9.1f} {bg.tok_s:>9.1f} {ours.tok_s / bg.tok_s:>6.2f}"
            f" {ours.ttft_p50():>12.2f} {bg.ttft_p50():>10.2f}",
            flush=True,
        )


def staggered(model, eos, wl: Workload, concurrency: int) -> None:
    print(f"\n== staggered arrivals every {wl.arrivals[1] if len(wl.arrivals) > 1 else 0:.2f}s, "
          f"concurrency {concurrency} ==")  # fmt: skip
    ours = run_ours(model, eos, wl, concurrency, staggered=True)
    bg = run_batch_generator(model, wl, concurrency, staggered=True)
    print(f"ours {ours.tok_s:.1f} tok/s ttft50 {ours.ttft_p50():.2f}s | BatchGenerator "
          f"{bg.tok_s:.1f} tok/s ttft50 {bg.ttft_p50():.2f}s | ratio {ours.tok_s / bg.tok_s:.2f}")  # fmt: skip


def single(model, eos, prompt: list[int], n: int) -> None:
    print(f"\n== single stream, prompt {len(prompt)}, {n} tokens (decode tok/s) ==")
    ref = single_stream_mlx_lm(model, prompt, n)
    ours = single_stream_ours(model, eos, prompt, n)
    print(f"ours {ours:.2f} | mlx-lm generate_step {ref:.2f} | ratio {ours / ref:.2f}")


def main() -> None:
    args = parse_args()
    from engine.config import EngineConfig
    from engine.cpu_backend import setup_cpu_backend

    config = EngineConfig(cpu_blas=args.blas, cpu_dequantize=args.dequantize)
    info = setup_cpu_backend(config, log_line=False)
    from engine.offline import load_for_scheduler
    from scheduler_proc.kv_cache import probe_model

    model, eos = load_for_scheduler(args.model, config)
    vocab = probe_model(model)[1]
    skip = set(args.skip.split(","))
    print(info.describe(), f"| model {args.model or 'default SmolLM2-135M'} | vocab {vocab}")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wl = make_workload(args, vocab, 0.0)
    warm = Workload(wl.prompts[:2], [4, 4], [0.0, 0.0])
    run_ours(model, eos, warm, 2, False), run_batch_generator(model, warm, 2, False)
    if "single" not in skip:
        single(model, eos, wl.prompts[0][: args.max_prompt], args.single_tokens)
    if "closed" not in skip:
        closed_loop(model, eos, wl, concurrencies)
    if "stagger" not in skip:
        interval = args.stagger_interval or _auto_interval(model, eos, wl, args.stagger_concurrency)
        staggered(model, eos, make_workload(args, vocab, interval), args.stagger_concurrency)


def _auto_interval(model, eos, wl: Workload, concurrency: int) -> float:
    """An arrival interval that keeps about `concurrency` requests in flight."""
    probe = Workload(wl.prompts[:concurrency], wl.max_tokens[:concurrency], [0.0] * concurrency)
    r = run_ours(model, eos, probe, concurrency, staggered=False)
    return r.seconds / concurrency


if __name__ == "__main__":
    main()
