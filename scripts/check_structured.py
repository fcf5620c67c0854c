"""Constrained outputs that parse: many seeded samples at temperature 1, in the scheduler.

Kinds: a JSON schema, a regex, and one forced tool call in mlx-lm's json_tools syntax (the grammar
`tool_choice: required` builds over two tools). Every sample runs to its grammar's end or its
token limit; a sample that ends ("stop") must parse and match, one cut at the limit is counted
apart. Prints, per kind: samples, parsed, failed, cut, and the first failures.

  .venv/bin/python scripts/check_structured.py                   # tiny random model, 1000 each
  .venv/bin/python scripts/check_structured.py --model default --samples 1000
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "tags"],
    "additionalProperties": False,
}
PHONE = r"\+[0-9]{1,3} \([0-9]{3}\) [0-9]{3}-[0-9]{4}"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "now", "parameters": NO_ARGS}},
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
]


def person_ok(text: str) -> bool:
    v = json.loads(text)
    return (
        set(v) == {"name", "age", "admin", "tags"}
        and isinstance(v["name"], str)
        and len(v["name"]) <= 12
        and isinstance(v["age"], int)
        and 0 <= v["age"] <= 120
        and isinstance(v["admin"], bool)
        and isinstance(v["tags"], list)
        and len(v["tags"]) <= 3
        and set(v["tags"]) <= {"a", "b", "c"}
    )


def tool_ok(text: str) -> bool:
    calls = re.findall(r"<tool_call>\n?(.*?)\n?</tool_call>", text, re.S)
    if not calls or "".join(f"<tool_call>{c}</tool_call>" for c in calls) != text.replace("\n", ""):
        return False
    for raw in calls:
        call = json.loads(raw)
        if call.get("name") == "now":
            ok = call.get("arguments") == {}
        else:
            args = call.get("arguments", {})
            ok = call.get("name") == "weather" and set(args) == {"city", "days"}
            ok = ok and isinstance(args["city"], str) and len(args["city"]) <= 10
            ok = ok and args["days"] in (1, 2, 3)
        if not ok or set(call) != {"name", "arguments"}:
            return False
    return True


def kinds() -> dict[str, tuple[dict[str, Any], Any]]:
    from mlx_lm.tool_parsers import json_tools

    from tokenizer_proc import tool_choice

    shim = SimpleNamespace(
        has_tool_calling=True,
        tool_parser=json_tools.parse_tool_call,
        tool_call_start="<tool_call>",
        tool_call_end="</tool_call>",
        tool_call_start_tokens=None,
        tool_call_end_tokens=None,
    )
    tool = tool_choice.grammar(shim, TOOLS, "required", parallel=False)
    return {
        "json_schema": ({"json_schema": PERSON}, person_ok),
        "regex": ({"regex": PHONE}, lambda t: re.fullmatch(PHONE, t) is not None),
        "tool_choice=required": ({"grammar": tool}, tool_ok),
    }


def run(model_dir: Path, samples: int, batch: int, max_tokens: int) -> int:
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams
    from engine.tokenizer_loader import load_tokenizer
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.scheduler import Scheduler

    config = EngineConfig(model=str(model_dir), max_running_requests=batch)
    model, eos = load_for_scheduler(str(model_dir), config)
    tok = load_tokenizer(model_dir)
    sched = Scheduler(config, model, eos, tokenizer_file=model_dir / "tokenizer.json")
    rng = random.Random(0)
    bad_total = 0
    for name, (extra, check) in kinds().items():
        t0 = time.perf_counter()
        outs: dict[str, list[int]] = {}
        ends: dict[str, str] = {}
        for i in range(samples):
            prompt = tok.encode(f"Sample {i}: {rng.random():.6f}")
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, **extra)
            sched.submit(f"{name}{i}", prompt, params)
            outs[f"{name}{i}"] = []
        while sched.has_work():
            for c in sched.step():
                outs[c.rid] += c.token_ids
                if c.finish_reason is not None:
                    ends[c.rid] = c.finish_reason
        failed, cut = [], 0
        for rid, ids in outs.items():
            text = tok.decode([t for t in ids if t not in eos])  # NOTE: as the detokenizer does
            if ends[rid] == "length":
                cut += 1
                continue
            try:
                ok = ends[rid] == "stop" and check(text)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failed.append((rid, ends[rid], text[:120]))
        bad_total += len(failed)
        parsed = samples - cut - len(failed)
        print(
            f"{model_dir.name} {name}: {samples} samples, {parsed} parsed, {len(failed)} failed, "
            f"{cut} cut at {max_tokens} tokens ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        for f in failed[:5]:
            print("   ", f)
    return bad_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny (random), default, or a model dir")
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None)
    from engine.models import resolve_model_dir

    if args.model == "tiny":
        from engine.random_model import TINY_LLAMA, make_random_model

        out = Path(tempfile.mkdtemp(prefix="check-structured-"))
        model_dir = make_random_model(out, TINY_LLAMA, tokenizer_from=resolve_model_dir(None))
    else:
        model_dir = resolve_model_dir(None if args.model == "default" else args.model)
    sys.exit(1 if run(model_dir, args.samples, args.batch, args.max_tokens) else 0)


if __name__ == "__main__":
    main()
