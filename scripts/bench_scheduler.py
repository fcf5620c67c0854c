"""Benchmark the scheduler against mlx-lm's BatchGenerator and single-stream generation.

One run, one model, one workload for every engine, so the printed ratios compare like with like:
  - closed-loop throughput at each concurrency (all requests queued at t=0), each engine freshly
    built: the first pass is reported as cold (what the first users after start see), a second
    pass over the same workload as warm;
  - a staggered-arrival variant (requests arrive at a fixed rate while others decode),
  - single-request decode tok/s against mlx_lm.generate.generate_step,
  - what a short prompt costs with the launch-default KV pool and with a small one.
The engine runs the launch defaults (its KV pool sized by EngineConfig, as `mlx-engine launch`
does), with --max-running-requests set to the concurrency, as BatchGenerator's batch size is.
Workload: prompt lengths uniform in [32, 1024], max_tokens uniform in
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
    shapes: int = 0  # distinct step shapes the engine created (0: not counted)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def ttft_p50(self) -> float:
        return statistics.median(self.ttft) if self.ttft else 0.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument(
        "--random",
        choices=["llama-1b", "gemma3-small", "qwen3next-small"],
        help="a random-weight model instead (engine.random_model.RANDOM_SHAPES)",
    )
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
    p.add_argument("--skip", default="", help="comma list of: closed, stagger, single, prompt")
    return p.parse_args()


def make_workload(args: argparse.Namespace, vocab: int, interval: float, salt: int = 0) -> Workload:
    rng = random.Random(args.seed + salt)
    n = args.num_requests
    lo_t, hi_t = min(args.min_tokens, args.max_tokens), args.max_tokens
    lo_p, hi_p = min(args.min_prompt, args.max_prompt), args.max_prompt
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo_p, hi_p))] for _ in range(n)]
    return Workload(
        prompts, [rng.randint(lo_t, hi_t) for _ in range(n)], [i * interval for i in range(n)]
    )


# -- engines ----------------------------------------------------------------------------------
def new_scheduler(model, eos, concurrency: int):
    from engine.config import EngineConfig
    from scheduler_proc.scheduler import Scheduler

    return Scheduler(EngineConfig(max_running_requests=concurrency), model, eos)


def run_ours(model, eos, wl: Workload, concurrency: int, staggered: bool, sched=None) -> Result:
    from engine.sampling_params import SamplingParams

    own = sched is None
    sched = sched or new_scheduler(model, eos, concurrency)
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
    stats = sched.stats()
    shapes = int(stats["shapes_seen"] - stats["shapes_warmed"])
    if own:
        sched.shutdown()
    ttft = [first[str(i)] - (wl.arrivals[i] if staggered else 0.0) for i in range(n)]
    return Result(total, seconds, ttft, shapes)


def new_batch_generator(model, wl: Workload, concurrency: int):
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(
        model,
        max_tokens=max(wl.max_tokens),
        completion_batch_size=concurrency,
        prefill_batch_size=min(concurrency, 8),
    )


def run_batch_generator(model, wl: Workload, concurrency: int, staggered: bool, gen=None) -> Result:
    own = gen is None
    gen = gen or new_batch_generator(model, wl, concurrency)
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
    if own:
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

    sched = Scheduler(EngineConfig(max_running_requests=1), model, eos)
    sched.submit("s", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    while sched.has_work():
        for out in sched.step():
            times += [time.perf_counter()] * len(out.token_ids)
    sched.shutdown()
    return (len(times) - 1) / (times[-1] - times[0])


# -- report -----------------------------------------------------------------------------------
def closed_loop(model, eos, wl: Workload, concurrencies: list[int], again: Workload) -> None:
    """Cold: the first pass after start; warm: a second pass with other prompts of the same
    lengths (the same prompts again would be prefix-cache hits, which BatchGenerator lacks)."""
    print("\n== closed loop: all requests queued at t=0 (generated tok/s; TTFT p50 s) ==")
    print(f"{'conc':>5} {'pass':>5} {'ours':>9} {'BatchGen':>9} {'ratio':>6} "
          f"{'ttft50 ours':>12} {'ttft50 BG':>10} {'new shapes':>10}")  # fmt: skip
    for c in concurrencies:
        sched, gen = new_scheduler(model, eos, c), new_batch_generator(model, wl, c)
        stats = sched.stats()
        print(f"      engine warm-up {stats['warm_up_s']:.1f} s, {stats['shapes_warmed']} shapes")
        for label, w in (("cold", wl), ("warm", again)):
            ours = run_ours(model, eos, w, c, staggered=False, sched=sched)
            bg = run_batch_generator(model, w, c, staggered=False, gen=gen)
            print(
                f"{c:>5} {label:>5} {ours.tok_s:>9.1f} {bg.tok_s:>9.1f} "
                f"{ours.tok_s / bg.tok_s:>6.2f} {ours.ttft_p50():>12.2f} {bg.ttft_p50():>10.2f}"
                f" {ours.shapes:>10}",
                flush=True,
            )
        sched.shutdown()
        gen.close()


def prompt_cost(model, eos) -> None:
    """A step's cost must not depend on the pool: a short prompt, default pool vs a small one."""
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    print("\n== one prompt, max_tokens=1 (seconds): launch-default KV pool vs a small pool ==")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for label, config in (("default", EngineConfig()), ("small", EngineConfig(
        max_total_tokens=8192, context_length=1024))):  # fmt: skip
        sched = Scheduler(config, model, eos)
        times = {}
        for n in (1, 40, 1, 40):  # NOTE: the second of each is the figure (first runs warm up)
            sched.submit(f"p{len(times)}-{n}", list(range(1, n + 1)), params)
            t = time.perf_counter()
            while sched.has_work():
                sched.step()
            times[n] = time.perf_counter() - t
        gib = sched.pool.nbytes / 2**30
        print(f"{label:>8} pool {gib:.2f} GiB: 1-token {times[1]:.3f} | 40-token {times[40]:.3f}"
              f" | ratio {times[40] / times[1]:.2f}")  # fmt: skip
        sched.shutdown()


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
    from engine.random_model import random_model_dir
    from scheduler_proc.kv_cache import probe_model
    from scheduler_proc.model_loader import load_for_scheduler

    path = str(random_model_dir(args.random)) if args.random else args.model
    model, eos = load_for_scheduler(path, config)
    vocab = probe_model(model)[1]
    skip = set(args.skip.split(","))
    print(
        info.describe(),
        f"| model {args.random or args.model or 'default SmolLM2-135M'} | vocab {vocab}",
    )
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wl = make_workload(args, vocab, 0.0)
    warm = Workload(wl.prompts[:2], [4, 4], [0.0, 0.0])
    run_ours(model, eos, warm, 2, False), run_batch_generator(model, warm, 2, False)
    if "prompt" not in skip:
        prompt_cost(model, eos)
    if "single" not in skip:
        single(model, eos, wl.prompts[0][: args.max_prompt], args.single_tokens)
    if "closed" not in skip:
        closed_loop(model, eos, wl, concurrencies, make_workload(args, vocab, 0.0, salt=1))
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
