"""How much `--kv-bits` changes what a model says: greedy answers and their logprobs against
plain KV, in-process (the scheduler the engine runs, its launch defaults otherwise).

For each setting, every prompt is answered greedily for `--tokens` tokens with the chosen
token's logprob. Reported against plain KV: prompts answered identically, the mean tokens before
an answer first differs, and the chosen tokens' logprob error (mean, p99, max) over the
positions where both answers still agree (past a difference the two condition on other text).

    .venv/bin/python scripts/kv_quant_quality.py [--model DIR] [--prompts 32] [--tokens 256]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from engine.config import EngineConfig
from engine.cpu_backend import setup_cpu_backend

TOPICS = (
    "the history of the printing press",
    "how a compiler turns code into machine instructions",
    "why the sky is blue",
    "the rules of chess",
    "how vaccines train the immune system",
    "the water cycle",
    "how to bake bread at home",
    "what a neural network learns",
    "the causes of the first world war",
    "how a bicycle stays upright",
    "photosynthesis",
    "how to write a good cover letter",
    "the life cycle of a star",
    "how TCP differs from UDP",
    "the plot of a classic detective story",
    "how credit cards work",
)
ASKS = ("Explain {} to a beginner.", "Write a short essay about {}.", "Summarize {} in steps.")


def prompts(tokenizer, n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        text = rng.choice(ASKS).format(rng.choice(TOPICS))
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            )
        else:
            ids = tokenizer.encode(text)
        out[f"p{i}"] = list(ids)
    return out


def answer(model, config: EngineConfig, asks: dict[str, list[int]], n: int):
    from engine.sampling_params import SamplingParams
    from scheduler_proc.scheduler import Scheduler

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    sched = Scheduler(config, model, [])
    for rid, ids in asks.items():
        sched.submit(rid, ids, params)
    got: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in asks}
    t0 = time.perf_counter()
    while sched.has_work():
        for chunk in sched.step():
            got[chunk.rid][0].extend(chunk.token_ids)
            got[chunk.rid][1].extend(lp.logprob for lp in chunk.logprobs)
    return got, time.perf_counter() - t0, sched.pool.token_bytes


def compare(plain, other, n: int) -> str:
    same, agree, errors = 0, [], []
    for rid, (want, lps) in plain.items():
        got, got_lps = other[rid]
        k = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), n)
        same += k == n
        agree.append(k)
        errors += [abs(a - b) for a, b in zip(lps[:k], got_lps[:k], strict=True)]
    e = np.asarray(errors or [0.0])
    return (
        f"identical {same}/{len(plain)}, tokens before a difference {np.mean(agree):.0f} of {n}, "
        f"logprob error mean {e.mean():.4f} p99 {np.percentile(e, 99):.4f} max {e.max():.4f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None, help="for a weights-only model directory")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument(
        "--noise",
        type=int,
        default=0,
        help="also plain KV with this many rows a step: how far batching alone moves answers",
    )
    args = ap.parse_args()
    setup_cpu_backend()  # NOTE: before MLX is imported
    from engine.models import resolve_model_dir
    from engine.tokenizer_loader import load_tokenizer
    from scheduler_proc.model_loader import load_for_scheduler

    base = EngineConfig(model=args.model)
    model, _ = load_for_scheduler(args.model, base)
    tokenizer = load_tokenizer(resolve_model_dir(args.tokenizer or args.model))
    asks = prompts(tokenizer, args.prompts)
    plain, secs, size = answer(model, base, asks, args.tokens)
    print(f"plain KV: {size} bytes a token, {secs:.1f} s", flush=True)
    if args.noise:
        rows = EngineConfig(model=args.model, max_running_requests=args.noise)
        got, secs, _ = answer(model, rows, asks, args.tokens)
        print(
            f"plain KV, {args.noise} rows at a time (the noise floor): {compare(plain, got, args.tokens)}"
        )
    for bits in (int(b) for b in args.bits.split(",") if b):
        config = EngineConfig(model=args.model, kv_bits=bits, kv_group_size=args.group)
        got, secs, qsize = answer(model, config, asks, args.tokens)
        print(
            f"--kv-bits {bits} (group {args.group}): {qsize} bytes a token "
            f"({size / qsize:.2f}x the tokens), {secs:.1f} s; {compare(plain, got, args.tokens)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
