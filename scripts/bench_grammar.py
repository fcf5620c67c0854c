"""Structured output's cost: llguidance masks per step, and constrained rows in the scheduler.

1. Masks alone: N matchers of a JSON schema walk a generation (a random allowed token per row per
   step); the host time to fill the step's N masks, and per row.
2. The scheduler in-process (launch defaults, overlap on): N rows with a share of them held to a
   regex (`--mix`), output tok/s against all free rows, and how many steps chained.

  .venv/bin/python scripts/bench_grammar.py                      # tiny random model, N = 32
  .venv/bin/python scripts/bench_grammar.py --model DIR --rows 16 --tokens 64 --mix 0,0.25,1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "email", "age", "tags", "address"],
}


def masks_alone(tokenizer_file: Path, vocab: int, rows: int, steps: int) -> None:
    import numpy as np
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from llguidance.numpy import fill_next_token_bitmask_par

    from engine.constraints import grammar_of
    from engine.sampling_params import SamplingParams

    tok = LLTokenizer(str(tokenizer_file), n_vocab=vocab)
    grammar = grammar_of(SamplingParams(json_schema=SCHEMA))
    assert grammar is not None
    rng = random.Random(0)
    for threads in (1, 2):
        executor = LLExecutor(num_threads=threads)
        matchers = [LLMatcher(tok, grammar, log_level=0) for _ in range(rows)]
        masks = np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)
        times = []
        for _ in range(steps):
            live = [(m, i) for i, m in enumerate(matchers) if not m.is_stopped()]
            if not live:
                break
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(executor, live, masks)
            times.append(time.perf_counter() - t0)
            for m, i in live:
                bits = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:vocab]
                m.consume_token(rng.choice(np.flatnonzero(bits).tolist()))
        med = statistics.median(times) * 1e3
        print(
            f"masks, {rows} rows, {threads} thread(s): median {med:.2f} ms a step "
            f"({med * 1e3 / rows:.0f} us a row), p90 {sorted(times)[len(times) * 9 // 10] * 1e3:.2f}"
            f" ms, {len(times)} steps"
        )


def in_scheduler(model_dir: Path, rows: int, tokens: int, mixes: list[float]) -> None:
    """Each mix: that share of the rows held to a regex (none can end early), the rest free;
    tok/s against the all-free run of the same process."""
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.scheduler import Scheduler

    config = EngineConfig(model=str(model_dir))
    model, eos = load_for_scheduler(str(model_dir), config)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(rows)]
    free = SamplingParams(max_tokens=tokens, seed=3, ignore_eos=True)
    held = SamplingParams(max_tokens=tokens, seed=3, ignore_eos=True, regex="[a-z ]+")
    base = None
    for mix in [0.0, *mixes]:  # NOTE: the first all-free run warms up (compiles, caches)
        sched = Scheduler(config, model, eos, tokenizer_file=model_dir / "tokenizer.json")
        n = round(mix * rows)
        for i, p in enumerate(prompts):
            sched.submit(f"r{i}", p, held if i < n else free)
        t0 = time.perf_counter()
        while sched.has_work():
            sched.step()
        dt = time.perf_counter() - t0
        stats = sched.stats()
        rate = stats["generated_tokens"] / dt
        if base is None:
            base = rate
            continue
        print(
            f"scheduler, {rows} rows, {n} held to a regex: {rate:.0f} tok/s ({rate / base:.2f}x the "
            f"warm-up's all-free run), {stats['steps_chained']} of {stats['steps_launched']} steps "
            f"chained, mask time {stats['grammar_mask_s'] * 1e3:.0f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model dir (default: a tiny random llama)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--mix", default="0,0.25,1", help="shares of constrained rows, comma list")
    args = ap.parse_args()
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None)
    model_dir = args.model or _tiny_model()
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    masks_alone(model_dir / "tokenizer.json", vocab, args.rows, args.tokens)
    in_scheduler(model_dir, args.rows, args.tokens, [float(m) for m in args.mix.split(",")])


def _tiny_model() -> Path:
    from engine.models import resolve_model_dir
    from engine.random_model import TINY_LLAMA, make_random_model

    out = Path(tempfile.mkdtemp(prefix="bench-grammar-"))
    return make_random_model(out, TINY_LLAMA, tokenizer_from=resolve_model_dir(None))


if __name__ == "__main__":
    main()
