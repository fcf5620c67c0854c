"""A decode step's host cost and graph size, the engine against mlx-lm (for diagnosis).

On a GPU the decode step is bound by the host: building the forward in Python and MLX encoding
its kernels (`mx.async_eval`, ~5 us a graph node on CUDA) take longer than the device runs it.
This builds the scheduler as `launch` does (`--set K=V` changes EngineConfig fields), decodes
`--rows` greedy requests of `--prompt` tokens, and prints, over `--steps` chained decode steps:
the step, the launch (graph built and queued) and the `mx.async_eval` in it (medians), the peak
memory over the steps (a copy of a layer's KV buffer shows here), and the step's graph nodes by
primitive (`mx.export_to_dot`); then mlx-lm's own batch forward (its KVCache, argmax) on the
same model, timed and counted the same way.

  python3 scripts/profile_graph.py --model /tmp/llama1b --rows 128 --set warmup=off   # a GPU
"""

from __future__ import annotations

import argparse
import collections
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens of every row")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--set", action="append", default=[], help="EngineConfig field=value")
    return p.parse_args()


def nodes(*arrays) -> collections.Counter[str]:
    """The graph's primitives, counted (leaves, the arrays already evaluated, are not nodes)."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return collections.Counter(re.findall(r'label ="(\w+)", shape=rectangle', f.read()))


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms"


def engine(args, model, eos, rng: random.Random) -> None:
    import mlx.core as mx
    from profile_scheduler import config_from

    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    sched = Scheduler(config_from(args.set), model, eos)
    params = SamplingParams(max_tokens=1_000_000, temperature=0.0, ignore_eos=True)
    for i in range(args.rows):
        sched.submit(f"r{i}", [rng.randrange(sched.vocab) for _ in range(args.prompt)], params)
    # NOTE: until every row decodes and the steps chain: a fixed count of warm-up steps left
    # long prompts (128 rows x 4,000 tokens: 64 prefill steps) prefilling into the timed steps
    warm = 0
    while sched.running.prefilling() or sched.stats()["waiting"] or warm < 10:
        sched.step()
        warm = 0 if sched.running.prefilling() else warm + 1
    real, launch = mx.async_eval, sched.runner.launch
    evals: list[float] = []
    launches: list[float] = []
    graph: list[collections.Counter[str]] = []

    def timed_eval(*arrays):
        if not graph:
            graph.append(nodes(*arrays))
        t = time.perf_counter()
        real(*arrays)
        evals.append(time.perf_counter() - t)

    prefills: list[int] = []

    def timed_launch(batch, *a, **k):
        if batch.is_prefill:
            prefills.append(1)
            return launch(batch, *a, **k)
        mx.async_eval = timed_eval
        t = time.perf_counter()
        try:
            return launch(batch, *a, **k)
        finally:
            launches.append(time.perf_counter() - t)
            mx.async_eval = real

    sched.runner.launch = timed_launch
    mx.synchronize()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        sched.step()
    step = (time.perf_counter() - t0) / args.steps
    mx.synchronize()
    peak = (mx.get_peak_memory() - active) / 1e6
    print(
        f"engine, {args.rows} rows: step {step * 1e3:.2f} ms; launch {ms(launches)}, of it"
        f" async_eval {ms(evals)}; peak {peak:.0f} MB over a {sched.pool.nbytes / 1e9:.1f} GB pool"
    )
    stats = sched.stats()
    print(
        f"  {len(prefills)} prefill steps timed, {stats['decoding']} rows decoding, split calls"
        f" {stats['decode_attention_split_calls']}, fused {stats['decode_attention_fused_calls']},"
        f" masked {stats['decode_attention_masked_calls']}"
    )
    print(f"  {sum(graph[0].values())} nodes: {dict(graph[0].most_common(12))}")
    sched.shutdown()


def mlx_lm(args, model, rng: random.Random) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    vocab = model.args.vocab_size
    prompt = mx.array(
        [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.rows)]
    )
    model(prompt, cache=cache)
    mx.eval([c.state for c in cache])
    token = mx.zeros((args.rows, 1), dtype=mx.int32)
    evals, steps = [], []
    graph = None
    for _ in range(args.steps + 10):
        t = time.perf_counter()
        y = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)
        graph = graph or nodes(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        evals.append(time.perf_counter() - t1)
        token = y[:, None]
        y.tolist()
        steps.append(time.perf_counter() - t)
    print(f"mlx-lm, {args.rows} rows: step {ms(steps[10:])}, async_eval {ms(evals[10:])}")
    print(f"  {sum(graph.values())} nodes: {dict(graph.most_common(12))}")


def main() -> None:
    args = parse_args()
    from engine.cpu_backend import setup_cpu_backend

    # NOTE: before MLX is imported, as the scheduler does: without it a CPU run measured the
    # wheel's reference BLAS (a 16-row decode of the default model: 2.2 s a step, not ~0.15 s)
    setup_cpu_backend(None, log_line=False)
    from profile_scheduler import config_from

    from scheduler_proc.model_loader import load_for_scheduler

    model, eos = load_for_scheduler(args.model, config_from(args.set))
    engine(args, model, eos, random.Random(0))
    mlx_lm(args, model, random.Random(0))


if __name__ == "__main__":
    main()
