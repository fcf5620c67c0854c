#!/usr/bin/env python3
"""Micro-benchmark of the Linux CPU path: model step times and mlx-lm's BatchGenerator, per variant.

Each variant runs in its own subprocess, because the BLAS must be in place before `mlx.core` is
imported; all variants run in one invocation so the printed ratios compare like with like on a
noisy machine. Usage: .venv/bin/python scripts/bench_cpu.py [--batches 1,8,32] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# NOTE: name -> (cpu_blas, cpu_dequantize). "reference" is stock mlx-cpu: what mlx-lm gets today.
VARIANTS: dict[str, tuple[str, str]] = {
    "reference": ("reference", "off"),
    "openblas": ("auto", "off"),
    "openblas+f32": ("auto", "on"),
    "reference+f32": ("reference", "on"),
}
DEFAULT_VARIANTS = "reference,openblas,openblas+f32"


def main() -> None:
    args = _parse()
    if args.child:
        _child(args)
        return
    model = args.model or str(_default_model())
    results = {v: _run_child(v, model, args) for v in args.variants.split(",")}
    _report(results, args)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="mlx-lm model dir (default: embedded SmolLM2)")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps timed (median)")
    p.add_argument("--gen-batch", type=int, default=32, help="BatchGenerator batch (0: skip)")
    p.add_argument("--gen-tokens", type=int, default=4, help="tokens per BatchGenerator request")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def _default_model() -> Path:
    from engine.models import resolve_model_dir

    return resolve_model_dir(None)


def _run_child(variant: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, "--model", model]
    cmd += ["--batches", args.batches, "--prompt-len", str(args.prompt_len)]
    cmd += ["--decode-steps", str(args.decode_steps), "--gen-batch", str(args.gen_batch)]
    cmd += ["--gen-tokens", str(args.gen_tokens)]
    print(f"# running {variant} ...", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- child: one variant


def _child(args: argparse.Namespace) -> None:
    from engine.config import EngineConfig
    from engine.cpu_backend import setup_cpu_backend

    blas, deq = VARIANTS[args.child]
    config = EngineConfig(cpu_blas=blas, cpu_dequantize=deq)
    info = setup_cpu_backend(config, log_line=False)
    model, load_s, weight_mb = _load(args.model, config)
    out: dict[str, Any] = {"blas": info.describe(), "load_s": load_s, "weights_mb": weight_mb}
    out["steps"] = {b: _steps(model, b, args) for b in _batches(args)}
    if args.gen_batch:
        out["batchgen"] = _batchgen(model, args)
    out["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(out))


def _batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.batches.split(",")]


def _load(path: str, config: Any) -> tuple[Any, float, float]:
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from engine.cpu_dequantize import maybe_dequantize
    from engine.memory import weights_bytes

    t0 = time.perf_counter()
    model, _ = load_model(Path(path))
    model = maybe_dequantize(model, config)
    mx.eval(model.parameters())
    return model, time.perf_counter() - t0, weights_bytes(model) / 1e6


def _steps(model: Any, batch: int, args: argparse.Namespace) -> dict[str, float]:
    """Prefill of batch x prompt-len tokens, then the median of decode steps at that batch."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(0)
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (batch, args.prompt_len))
    prefill = _timed(lambda: model(prompt, cache=cache))
    token = mx.random.randint(0, 1000, (batch, 1))
    decode = sorted(_timed(lambda: model(token, cache=cache)) for _ in range(args.decode_steps))
    return {"prefill_s": prefill, "decode_s": decode[len(decode) // 2]}


def _timed(fn: Any) -> float:
    import mlx.core as mx

    t0 = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t0


def _batchgen(model: Any, args: argparse.Namespace) -> dict[str, float]:
    """mlx-lm's own BatchGenerator on the same model: prompt phase, then decode tokens/s."""
    from mlx_lm.generate import BatchGenerator

    n, length = args.gen_batch, args.prompt_len
    gen = BatchGenerator(model, max_tokens=args.gen_tokens, prefill_batch_size=n)
    gen.insert([[(i * 7 + j) % 1000 + 1 for j in range(length)] for i in range(n)])
    t0 = time.perf_counter()
    first, tokens = None, 0
    while responses := gen.next_generated():
        first = first or time.perf_counter()
        tokens += len(responses)
    end = time.perf_counter()
    gen.close()
    assert first is not None
    return {"prompt_s": first - t0, "decode_tok_s": (tokens - n) / max(end - first, 1e-9)}


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------- report


def _report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    base_name = next(iter(results))
    base = results[base_name]
    print(f"\nprompt {args.prompt_len} tokens/sequence; ratios are speedups vs {base_name}")
    for name, r in results.items():
        print(f"  {name:14s} {r['blas']}")
        print(f"  {'':14s} weights {r['weights_mb']:.0f} MB, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(
        f"\n{'variant':14s} {'batch':>5s} {'prefill s':>10s} {'x':>6s} {'decode ms':>10s} "
        f"{'tok/s':>8s} {'x':>6s}"
    )
    for name, r in results.items():
        for b, s in r["steps"].items():
            ref = base["steps"][b]
            print(
                f"{name:14s} {b:>5s} {s['prefill_s']:10.3f} {ref['prefill_s'] / s['prefill_s']:6.1f}"
                f" {s['decode_s'] * 1e3:10.1f} {int(b) / s['decode_s']:8.1f}"
                f" {ref['decode_s'] / s['decode_s']:6.1f}"
            )
    if args.gen_batch:
        _report_batchgen(results, base, args)


def _report_batchgen(results: dict[str, Any], base: dict[str, Any], args: Any) -> None:
    print(f"\nmlx-lm BatchGenerator, {args.gen_batch} requests x {args.gen_tokens} tokens")
    print(f"{'variant':14s} {'prompt s':>9s} {'x':>6s} {'decode tok/s':>13s} {'x':>6s}")
    b0 = base["batchgen"]
    for name, r in results.items():
        g = r["batchgen"]
        print(
            f"{name:14s} {g['prompt_s']:9.2f} {b0['prompt_s'] / g['prompt_s']:6.1f}"
            f" {g['decode_tok_s']:13.1f} {g['decode_tok_s'] / b0['decode_tok_s']:6.1f}"
        )


if __name__ == "__main__":
    main()
