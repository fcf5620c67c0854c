"""One decode step of B rows: the engine's scheduler vs mlx-lm's plain KVCache, same model, one run.

Both sides hold B sequences of `--context` cached tokens and decode greedily; a step is the forward,
the argmax and the host copy of the B tokens. mlx-lm's side is its fastest case: every row the same
length, so one int offset and no mask. The engine runs its sync loop (no overlap, so the figure is
the step's cost, not hidden behind the next one) on its paged pool, each request's pages as the
allocator hands them (the prompt's in one run, decode's a page at a time); a ragged variant where
row lengths differ; and with `--shuffle-pages`, the pool's free pages shuffled first, so every
row's keys are gathered from pages scattered across the pool.

  .venv/bin/python scripts/bench_decode_step.py --batch 64 --context 128          # CPU, default model
  python3 scripts/bench_decode_step.py --random llama-1b --batch 64 --context 600   # a GPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument(
        "--random",
        choices=["llama-1b", "gemma3-small", "qwen3next-small"],
        help="a random-weight model instead (engine.random_model.RANDOM_SHAPES)",
    )
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument(
        "--shuffle-pages", action="store_true", help="also run with the free pages shuffled"
    )
    return p.parse_args()


def load(args: argparse.Namespace):
    from engine.config import EngineConfig
    from engine.random_model import random_model_dir
    from scheduler_proc.model_loader import load_for_scheduler

    path = str(random_model_dir(args.random)) if args.random else args.model
    return load_for_scheduler(path, EngineConfig())


def mlx_lm_steps(model, prompts: list[list[int]], steps: int) -> list[float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts), cache=cache)
    tokens = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tokens)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(tokens[:, None], cache=cache)
        tokens = mx.argmax(logits[:, -1, :], axis=-1)
        tokens.tolist()
        times.append(time.perf_counter() - t)
    return times


def engine_steps(
    model, eos, prompts: list[list[int]], steps: int, shuffle: bool = False
) -> tuple[list[float], int]:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    # NOTE: a context as long as the run needs, so the pages hold the whole batch to its end.
    ctx = max(len(p) for p in prompts) + steps + 16
    config = EngineConfig(
        max_running_requests=len(prompts), context_length=ctx, disable_overlap=True
    )
    sched = Scheduler(config, model, eos)
    hold_pages(sched, [len(p) + steps + 8 for p in prompts], shuffle)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.submit(str(i), p, params)
    while sched.stats()["decoding"] < len(prompts):
        sched.step()
    sched.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t)
    stats = sched.stats()
    shapes = int(stats["shapes_seen"] - stats["shapes_warmed"])
    sched.shutdown()
    return times, shapes


def hold_pages(sched: Scheduler, lengths: list[int], shuffle: bool) -> None:
    """Every page the run needs allocated before it starts, the free list shuffled if asked.

    NOTE: off CUDA the pool grows by doubling as tokens arrive; a doubling inside a timed step
    would be measured as that step.
    """
    if sched.running.slots < len(lengths):
        raise SystemExit(f"memory holds {sched.running.slots} requests, fewer than the batch")
    need = sum(sched.pool.pages_for(n) for n in lengths)
    if not sched.kv.room(need):
        raise SystemExit(f"memory holds {sched.kv.pages.available} KV pages, {need} needed")
    if shuffle:
        # NOTE: every free page taken, then given back in random order: the free list's order.
        pages = sched.kv.pages
        ids = pages.alloc(pages.available)
        random.Random(0).shuffle(ids)
        pages.release(ids)


def main() -> None:
    args = parse_args()
    from engine.cpu_backend import setup_cpu_backend

    info = setup_cpu_backend(None, log_line=False)
    model, eos = load(args)
    import mlx.core as mx

    vocab = model(mx.array([[0]])).shape[-1]
    rng = random.Random(0)
    same = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(args.batch)]
    ragged = [p[: rng.randint(args.context // 2, args.context)] for p in same]
    print(f"{info.describe()} | {mx.default_device()} | B={args.batch} context={args.context}")
    mlx_lm_steps(model, same[:2], 2)  # warm kernels for both
    ref = statistics.median(mlx_lm_steps(model, same, args.steps))
    times, shapes = engine_steps(model, eos, same, args.steps)
    ours = statistics.median(times)
    ours_ragged = statistics.median(engine_steps(model, eos, ragged, args.steps)[0])
    shuffled = ""
    if args.shuffle_pages:
        mixed = statistics.median(engine_steps(model, eos, same, args.steps, shuffle=True)[0])
        shuffled = f" | engine, shuffled pages {mixed * 1e3:.2f}"
    print(f"decode step ms: mlx-lm KVCache {ref * 1e3:.2f} | engine {ours * 1e3:.2f} "
          f"(ratio {ours / ref:.2f}) | engine, ragged rows {ours_ragged * 1e3:.2f}{shuffled} "
          f"| new shapes {shapes}")  # fmt: skip


if __name__ == "__main__":
    main()
