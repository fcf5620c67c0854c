"""Benchmark the scheduler against mlx-lm's BatchGenerator and single-stream generation.

One run, one model, one workload for every engine, so the printed ratios compare like with like:
  - closed-loop throughput at each concurrency (all requests queued at t=0), each engine freshly
    built: the first pass is reported as cold (what the first users after start see), a second
    pass over the same workload as warm;
  - a staggered-arrival variant (requests arrive at a fixed rate while others decode),
  - single-request decode tok/s against mlx_lm.generate.generate_step,
  - what a short prompt costs with the launch-default KV pool and with a small one.
The engine runs the launch defaults (EngineConfig, as `mlx-engine launch` builds it: its KV pages
and --max-running-requests from the budget) unless `--max-running-requests` is given; at a given
concurrency the driver keeps at most that many requests in the engine (the rest wait on the client
side), as BatchGenerator's batch size does.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from scheduler_proc.scheduler import Scheduler


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]  # seconds after start (staggered variant)


@dataclass(frozen=True)
class Engine:
    """The engine under test: its model and the launch-like config every scheduler starts from."""

    model: Any
    eos: Any
    config: EngineConfig

    def scheduler(self, **changes: Any) -> Scheduler:
        from scheduler_proc.scheduler import Scheduler

        return Scheduler(replace(self.config, **changes), self.model, self.eos)


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
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=0,
        help="the engine's; 0: from the KV budget, as `mlx-engine launch` defaults to",
    )
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
def run_ours(
    eng: Engine, wl: Workload, concurrency: int, staggered: bool, sched: Scheduler | None = None
) -> Result:
    from engine.sampling_params import SamplingParams

    own = sched is None
    sched = sched or eng.scheduler()
    first: dict[str, float] = {}
    submitted, done, total, n = 0, 0, 0, len(wl.prompts)
    start = time.perf_counter()
    while submitted < n or sched.has_work():
        now = time.perf_counter() - start
        # NOTE: at most `concurrency` requests in the engine, as in BatchGenerator's batch: the
        # engine's own limit is the launch default's, not the concurrency.
        while (
            submitted < n
            and submitted - done < concurrency
            and (not staggered or wl.arrivals[submitted] <= now)
        ):
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
            done += out.finish_reason is not None
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


def single_stream_ours(eng: Engine, prompt: list[int], n: int) -> float:
    from engine.sampling_params import SamplingParams

    sched = eng.scheduler()
    sched.submit("s", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    while sched.has_work():
        for out in sched.step():
            times += [time.perf_counter()] * len(out.token_ids)
    sched.shutdown()
    return (len(times) - 1) / (times[-1] - times[0])


# -- report -----------------------------------------------------------------------------------
def closed_loop(eng: Engine, wl: Workload, concurrencies: list[int], again: Workload) -> None:
    """Cold: the first pass after start; warm: a second pass with other prompts of the same
    lengths (the same prompts again would be prefix-cache hits, which BatchGenerator lacks)."""
    print("\n== closed loop: all requests queued at t=0, `conc` at a time in each engine "
          "(generated tok/s; TTFT p50 s) ==")  # fmt: skip
    print(f"{'conc':>5} {'pass':>5} {'ours':>9} {'BatchGen':>9} {'ratio':>6} "
          f"{'ttft50 ours':>12} {'ttft50 BG':>10} {'new shapes':>10}")  # fmt: skip
    for c in concurrencies:
        sched, gen = eng.scheduler(), new_batch_generator(eng.model, wl, c)
        stats = sched.stats()
        print(f"      engine warm-up {stats['warm_up_s']:.1f} s, {stats['shapes_warmed']} shapes, "
              f"max running requests {stats['kv_slots_total']}")  # fmt: skip
        for label, w in (("cold", wl), ("warm", again)):
            ours = run_ours(eng, w, c, staggered=False, sched=sched)
            bg = run_batch_generator(eng.model, w, c, staggered=False, gen=gen)
            print(
                f"{c:>5} {label:>5} {ours.tok_s:>9.1f} {bg.tok_s:>9.1f} "
                f"{ours.tok_s / bg.tok_s:>6.2f} {ours.ttft_p50():>12.2f} {bg.ttft_p50():>10.2f}"
                f" {ours.shapes:>10}",
                flush=True,
            )
        sched.shutdown()
        gen.close()


def prompt_cost(eng: Engine) -> None:
    """A step's cost must not depend on the pool: a short prompt, default pool vs a small one."""
    from engine.sampling_params import SamplingParams

    print("\n== one prompt, max_tokens=1 (seconds): launch-default KV pool vs a small pool ==")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    small = dict(max_total_tokens=8192, context_length=1024)
    for label, changes in (("default", {}), ("small", small)):
        sched = eng.scheduler(**changes)
        times: dict[int, float] = {}
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


def staggered(eng: Engine, wl: Workload, concurrency: int) -> None:
    print(f"\n== staggered arrivals every {wl.arrivals[1] if len(wl.arrivals) > 1 else 0:.2f}s, "
          f"concurrency {concurrency} ==")  # fmt: skip
    ours = run_ours(eng, wl, concurrency, staggered=True)
    bg = run_batch_generator(eng.model, wl, concurrency, staggered=True)
    print(f"ours {ours.tok_s:.1f} tok/s ttft50 {ours.ttft_p50():.2f}s | BatchGenerator "
          f"{bg.tok_s:.1f} tok/s ttft50 {bg.ttft_p50():.2f}s | ratio {ours.tok_s / bg.tok_s:.2f}")  # fmt: skip


def single(eng: Engine, prompt: list[int], n: int) -> None:
    print(f"\n== single stream, prompt {len(prompt)}, {n} tokens (decode tok/s) ==")
    ref = single_stream_mlx_lm(eng.model, prompt, n)
    ours = single_stream_ours(eng, prompt, n)
    print(f"ours {ours:.2f} | mlx-lm generate_step {ref:.2f} | ratio {ours / ref:.2f}")


def main() -> None:
    args = parse_args()
    from engine.config import EngineConfig
    from engine.cpu_backend import setup_cpu_backend

    config = EngineConfig(
        cpu_blas=args.blas,
        cpu_dequantize=args.dequantize,
        max_running_requests=args.max_running_requests,
    ).validate()
    info = setup_cpu_backend(config, log_line=False)
    from engine.random_model import random_model_dir
    from scheduler_proc.kv_layout import probe_model
    from scheduler_proc.model_loader import load_for_scheduler

    path = str(random_model_dir(args.random)) if args.random else args.model
    model, eos = load_for_scheduler(path, config)
    eng = Engine(model, eos, config)
    vocab = probe_model(model)[1]
    skip = set(args.skip.split(","))
    print(
        info.describe(),
        f"| model {args.random or args.model or 'default SmolLM2-135M'} | vocab {vocab}",
        f"| engine --max-running-requests {args.max_running_requests or 'auto'}",
    )
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    wl = make_workload(args, vocab, 0.0)
    warm = Workload(wl.prompts[:2], [4, 4], [0.0, 0.0])
    run_ours(eng, warm, 2, False), run_batch_generator(model, warm, 2, False)
    if "prompt" not in skip:
        prompt_cost(eng)
    if "single" not in skip:
        single(eng, wl.prompts[0][: args.max_prompt], args.single_tokens)
    if "closed" not in skip:
        closed_loop(eng, wl, concurrencies, make_workload(args, vocab, 0.0, salt=1))
    if "stagger" not in skip:
        interval = args.stagger_interval or _auto_interval(eng, wl, args.stagger_concurrency)
        staggered(eng, make_workload(args, vocab, interval), args.stagger_concurrency)


def _auto_interval(eng: Engine, wl: Workload, concurrency: int) -> float:
    """An arrival interval that keeps about `concurrency` requests in flight."""
    probe = Workload(wl.prompts[:concurrency], wl.max_tokens[:concurrency], [0.0] * concurrency)
    r = run_ours(eng, probe, concurrency, staggered=False)
    return r.seconds / concurrency


if __name__ == "__main__":
    main()
