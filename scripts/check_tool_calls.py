"""Forced tool calls that parse and hold to their schemas: many seeded samples at temperature 1
per tool-call format, in the scheduler.

Each format's model (tests/tool_formats.py) is the default tokenizer with a template from which
mlx-lm infers that format, over tiny random weights or the default model's. The grammar is the
engine's own for the request (`tool_choice.force`: the format's syntax where it has one, else
the generic JSON form), over three tools (no arguments; a string, a bounded integer, a string
enum and a boolean; an untyped enum, an unbounded number, a nested object and an array). Every
sample that ends must be, to the engine's parser for the request (`tool_calls.for_request`:
mlx-lm's parser of the format, or the generic form's), only calls to those tools (one without
parallel calls) whose arguments `jsonschema` finds valid; one cut at the token limit is
counted apart. Modes: `required` (parallel_tool_calls false), `parallel` (true), `named` (one
named tool). Prints, per format and mode: samples, valid, failed, cut, and the first failures.

  .venv/bin/python scripts/check_tool_calls.py --format qwen3_coder --samples 1000
  .venv/bin/python scripts/check_tool_calls.py --format all --modes required,parallel
  .venv/bin/python scripts/check_tool_calls.py --format pythonic --model default --samples 200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODES = ("required", "parallel", "named")
# NOTE: parallel calls run on (a random model writes another call about as often as it ends)
PARALLEL_TOKENS = 400


def request(mode: str) -> Any:
    import tool_formats as tf

    if mode == "named":
        return tf.request(choice={"type": "function", "function": {"name": "get_weather"}})
    return tf.request(parallel=mode == "parallel")


def check(sampler: Any, label: str, mode: str, samples: int, max_tokens: int) -> int:
    """Sample one mode and print its line; the number of failures."""
    import tool_formats as tf

    from tokenizer_proc import tool_choice

    msg = request(mode)
    limit = PARALLEL_TOKENS if mode == "parallel" else max_tokens
    form = "generic" if tool_choice.generic_form(msg, sampler.tokenizer) else "native"
    t0 = time.perf_counter()
    failed, cut, texts = [], 0, set()
    for seed, start in enumerate(range(0, samples, 256)):
        for end, text in sampler.sample(msg, min(256, samples - start), limit, seed=seed):
            texts.add(text)
            if end == "length":
                cut += 1
                continue
            why = tf.verify(sampler.tokenizer, msg, text) if end == "stop" else f"ended {end}"
            if why is not None:
                failed.append((why, text[:200]))
    valid = samples - cut - len(failed)
    print(
        f"{label} {mode} ({form} form): {samples} samples, {valid} valid, {len(failed)} failed, "
        f"{cut} cut at {limit} tokens, {len(texts)} distinct ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    for why, text in failed[:5]:
        print(f"    {why}: {text!r}")
    return len(failed)


def main() -> None:
    from engine.cpu_backend import setup_cpu_backend

    # NOTE: before anything imports mlx.core (tool_formats does)
    setup_cpu_backend(None)
    import tool_formats as tf

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    formats = [*tf.FORMATS, tf.GENERIC]
    ap.add_argument("--format", default="all", help=f"all, or one of {', '.join(formats)}")
    ap.add_argument("--model", default="tiny", choices=["tiny", "default"])
    ap.add_argument("--samples", type=int, default=1000, help="per format and mode")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    chosen = formats if args.format == "all" else args.format.split(",")
    modes = args.modes.split(",")
    if set(chosen) - set(formats) or set(modes) - set(MODES):
        ap.error(f"formats: {', '.join(formats)}; modes: {', '.join(MODES)}")
    from engine.models import resolve_model_dir

    base = resolve_model_dir(None)
    weights = base if args.model == "default" else None
    failures = 0
    with tempfile.TemporaryDirectory(prefix="check-tool-calls-") as tmp:
        for fmt in chosen:
            model_dir = tf.make_format_model(fmt, Path(tmp) / fmt, base, weights)
            sampler = tf.Sampler(model_dir, args.batch)
            for mode in modes:
                label = f"{args.model} {fmt}"
                failures += check(sampler, label, mode, args.samples, args.max_tokens)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
