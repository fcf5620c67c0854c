"""Where a loaded scheduler's time goes, in-process, at the launch defaults (for diagnosis).

Runs the scheduler as `mlx-engine launch` builds it (EngineConfig defaults, overlap on, warm-up)
on a closed loop of `--concurrency` clients, `--num-requests` requests of uniform random prompt
lengths and a fixed output length, and prints, per wave (the first after warm-up, then a warm
one): output tok/s, the steps run by kind, the median step of each kind (`step_times.py`), and
the KV pages' tokens per token held at the peak (sampled every 8 steps). `--set K=V` changes
one EngineConfig field (e.g. `--set max_total_tokens=600000`) to compare against the defaults.
Figures users get come from `mlx-engine bench` over HTTP; this says why they are what they are.

  python3 scripts/profile_scheduler.py --random llama-1b --concurrency 128   # a GPU
  .venv/bin/python scripts/profile_scheduler.py --concurrency 16 --num-requests 16 \
      --prompt 16:64 --output 16                                            # CPU, default model
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--random", choices=["llama-1b", "gemma3-small", "qwen3next-small"])
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt", default="160:640", help="prompt tokens LOW:HIGH")
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="EngineConfig field=value")
    p.add_argument(
        "--host", action="store_true", help="also split each wave's time: graph building, waiting"
    )
    return p.parse_args()


class HostSplit:
    """Where the host's time goes: building and queueing graphs (`Runner.launch`, by kind),
    waiting for the device (`_listed`, the tokens' `.tolist()`), and the rest of `step()`.
    A step whose wait is near zero while the device idles is bound by the host."""

    def __init__(self, sched) -> None:
        import scheduler_proc.scheduler as module

        self.times: dict[str, list[float]] = {}
        launch, listed = sched.runner.launch, module._listed

        def timed_launch(batch, *args, **kwargs):
            with self.timer("build_prefill" if batch.is_prefill else "build_decode"):
                return launch(batch, *args, **kwargs)

        def timed_listed(a):
            with self.timer("wait"):
                return listed(a)

        sched.runner.launch, module._listed = timed_launch, timed_listed

    @contextlib.contextmanager
    def timer(self, key: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times.setdefault(key, []).append(time.perf_counter() - t)

    def report(self, wall: float) -> dict:
        """Each part's total share of the wall time and its median call (ms); then reset."""
        out = {}
        for key, xs in sorted(self.times.items()):
            out[key] = f"{sum(xs) / wall:.0%}, median {statistics.median(xs) * 1e3:.2f} ms"
        self.times = {}
        return out


def config_from(sets: list[str]):
    """EngineConfig defaults, with `field=value` changes (typed as the field's default)."""
    from engine.config import EngineConfig

    defaults = EngineConfig()
    changes: dict[str, object] = {}
    for item in sets:
        key, _, value = item.partition("=")
        if not hasattr(defaults, key):
            raise SystemExit(f"EngineConfig has no field {key!r}")
        kind = type(getattr(defaults, key))
        changes[key] = value.lower() in ("1", "true", "on") if kind is bool else kind(value)
    return dataclasses.replace(defaults, **changes)  # type: ignore[arg-type]


def _timed_step(sched, split: HostSplit):
    with split.timer("step"):
        return sched.step()


def wave(
    sched,
    prompts: list[list[int]],
    output: int,
    concurrency: int,
    tag: str,
    split: HostSplit | None = None,
) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    before = dict(sched.stats())
    queue = list(enumerate(prompts))
    live, tokens, steps = 0, 0, 0
    peak = (0, 0)  # NOTE: KV tokens the requests hold, and their pages' tokens, at the peak
    t0 = time.perf_counter()
    while queue or live:
        while queue and live < concurrency:
            i, p = queue.pop(0)
            sched.submit(f"{tag}-{i}", p, params)
            live += 1
        outs = sched.step() if split is None else _timed_step(sched, split)
        for chunk in outs:
            tokens += len(chunk.token_ids)
            live -= chunk.finish_reason is not None
        steps += 1
        if steps % 8 == 0:
            now = sched.stats()
            peak = max(peak, (now["kv_tokens_in_use"], now["kv_request_tokens_allocated"]))
    wall = time.perf_counter() - t0
    after = sched.stats()
    diff = {k: after[k] - before.get(k, 0) for k in after if k.startswith("steps_")}
    medians = {k: v for k, v in after.items() if k.startswith("step_median")}
    held = {"kv_peak_tokens": peak[0], "kv_pages_per_token": round(peak[1] / max(1, peak[0]), 3)}
    host = {} if split is None else {"host": split.report(wall)}
    return {
        "wall_s": round(wall, 2),
        "tok_s": round(tokens / wall),
        **diff,
        **medians,
        **held,
        **host,
    }


def main() -> None:
    args = parse_args()
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None, log_line=False)
    import logging

    import mlx.core as mx

    from engine.random_model import random_model_dir
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.scheduler import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    config = config_from(args.set)
    path = str(random_model_dir(args.random)) if args.random else args.model
    model, eos = load_for_scheduler(path, config)
    t = time.perf_counter()
    sched = Scheduler(config, model, eos)
    print(
        f"{mx.default_device()} built in {time.perf_counter() - t:.1f} s; {args.set or 'defaults'}"
    )
    lo, hi = (int(x) for x in args.prompt.split(":"))
    rng = random.Random(0)
    vocab = sched.vocab
    split = HostSplit(sched) if args.host else None
    for w in range(args.waves):
        prompts = [
            [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
            for _ in range(args.num_requests)
        ]
        print(f"wave {w}:", wave(sched, prompts, args.output, args.concurrency, f"w{w}", split))
    print("exit:", {k: v for k, v in sched.stats().items() if "step" in k or "decode_att" in k})
    sched.shutdown()


if __name__ == "__main__":
    main()
