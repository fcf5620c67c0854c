"""Speculative decoding (`--spec ngram`, or `--spec draft`) on an edit workload, in-process,
one stream.

The prompt holds a ~300-word text and asks for it back with one change, as an agent's edit
re-emits a file it was shown. The same request (greedy, or sampled with `--temperature` and a
seed) runs on a scheduler with `--spec off` and with `--spec ngram` (or, with `--draft-model`,
`--spec draft`), taking turns, `--repeats` times each, the best kept; the outputs must be
identical.
Reported: output tok/s (first token to last, and submit to last), the ratio, and the proposed /
accepted tokens.

  .venv/bin/python scripts/bench_spec.py                    # default model, k 8, n 3
  .venv/bin/python scripts/bench_spec.py --spec-k 4 --max-tokens 200 --repeats 1
  .venv/bin/python scripts/bench_spec.py --temperature 0.7 --top-p 0.95   # sampled, seeded
  .venv/bin/python scripts/bench_spec.py --draft-model DIR --spec-k 4      # a draft model
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour, and for most "
    "of the year its keeper had nobody to talk to but the gulls. Every evening he climbed the "
    "one hundred and twelve steps to the lamp room, trimmed the wick, polished the great lens "
    "with a soft cloth and wrote the state of the sea in a leather book. In the spring the "
    "fishing boats came back from the south, and the harbour filled with voices, nets and the "
    "smell of tar. The keeper liked the boats best at dawn, when they slipped out one by one "
    "past the rock and their wakes caught the first light. He knew every captain by the shape "
    "of his hull and the sound of his engine, and he could tell from the way a boat sat in the "
    "water whether it was coming home full or empty. One winter a storm tore the roof from the "
    "store house and carried half of his firewood into the sea. For three weeks no boat could "
    "reach the rock, and he burned the old chairs, then the shelves, then the spare oars, to "
    "keep the lamp room warm enough for the oil to flow. When the weather finally broke, the "
    "youngest captain in the harbour rowed out with bread, coffee and a letter from the town "
    "council thanking him for keeping the light burning through the worst storm anyone could "
    "remember. The keeper read the letter twice, folded it into the leather book and went back "
    "up the steps to trim the wick. Years later, when the light was made automatic and the "
    "keeper moved to a small house above the harbour, the letter was the only thing he took "
    "from the lamp room apart from the book itself, and he kept both on the shelf by his bed."
)
INSTRUCTION = (
    "Repeat the following text exactly, word for word, but write 'winter' instead of 'spring'. "
    "Output only the text.\n\n"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--spec-k", type=int, default=8)
    ap.add_argument("--spec-ngram", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="the synchronous loop (no overlap)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1, help="the sampled request's seed")
    ap.add_argument(
        "--draft-model", default=None, help="--spec draft with this draft instead of ngram"
    )
    args = ap.parse_args()

    from engine.cpu_backend import setup_cpu_backend

    # NOTE: before MLX is imported: an optimized BLAS (the reference one is ~3 GFLOP/s)
    print(setup_cpu_backend(None, log_line=False).describe())
    from engine.config import EngineConfig
    from engine.models import load, resolve_model_dir
    from engine.sampling_params import SamplingParams
    from scheduler_proc.model_loader import load_for_scheduler

    path = str(resolve_model_dir(args.model))
    _, tokenizer = load(path)
    messages = [{"role": "user", "content": INSTRUCTION + TEXT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    base = EngineConfig(
        model=path,
        max_total_tokens=8192,
        context_length=4096,
        disable_overlap=args.sync,
        spec_k=args.spec_k,
        spec_ngram=args.spec_ngram,
    )
    model, eos = load_for_scheduler(path, base)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    sampling = "greedy" if params.greedy else f"T {args.temperature}, top-p {args.top_p}"
    print(
        f"prompt {len(prompt)} tokens, max_tokens {args.max_tokens}, k {args.spec_k}, "
        f"n {args.spec_ngram}, {'sync' if args.sync else 'overlap'} loop, {sampling}"
    )
    from dataclasses import replace

    from scheduler_proc.scheduler import Scheduler

    # NOTE: the prefix cache off, so every run prefills; the modes take turns, so a machine
    # whose load changes during the run weighs on both alike
    spec = "draft" if args.draft_model else "ngram"
    draft = load_for_scheduler(args.draft_model, base)[0] if args.draft_model else None
    on = replace(base, spec=spec, draft_model=args.draft_model, disable_radix_cache=True)
    scheds = {
        "off": Scheduler(replace(base, disable_radix_cache=True), model, eos),
        spec: Scheduler(on, model, eos, draft=draft),
    }
    results: dict[str, dict[str, Any]] = {}
    for i in range(args.repeats):
        for mode, sched in scheds.items():
            run = _run(sched, f"r{i}", prompt, params)
            if mode not in results or run["decode_tps"] > results[mode]["decode_tps"]:
                results[mode] = run
    off, on = results["off"], results[spec]
    same = off["tokens"] == on["tokens"]
    for mode, r in results.items():
        print(
            f"  spec {mode:5}: {len(r['tokens'])} tokens, decode {r['decode_tps']:.1f} tok/s, "
            f"end to end {r['e2e_tps']:.1f} tok/s, proposed {r['proposed']}, "
            f"accepted {r['accepted']}"
        )
    print(
        f"ratio (decode tok/s): {on['decode_tps'] / off['decode_tps']:.2f}x; "
        f"end to end {on['e2e_tps'] / off['e2e_tps']:.2f}x; identical output: {same}"
    )
    print("output:", tokenizer.decode(on["tokens"])[:300].replace("\n", " "), "...")
    if not same:
        sys.exit(1)


def _run(sched: Any, rid: str, prompt: list[int], params: Any) -> dict[str, Any]:
    """One request, alone, to its end: its tokens, tok/s and what speculation did."""
    before = sched.stats()
    t0 = time.perf_counter()
    sched.submit(rid, prompt, params)
    tokens: list[int] = []
    first = None
    while sched.has_work():
        for out in sched.step():
            if out.token_ids and first is None:
                first = time.perf_counter()
            tokens += out.token_ids
    end = time.perf_counter()
    stats = sched.stats()
    assert first is not None
    return {
        "tokens": tokens,
        "decode_tps": (len(tokens) - 1) / max(end - first, 1e-9),
        "e2e_tps": len(tokens) / (end - t0),
        "proposed": stats["spec_proposed_tokens"] - before["spec_proposed_tokens"],
        "accepted": stats["spec_accepted_tokens"] - before["spec_accepted_tokens"],
    }


if __name__ == "__main__":
    main()
