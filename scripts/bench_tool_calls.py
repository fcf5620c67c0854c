"""Forced tool calls against plain replies, in one run on one engine: `--concurrency` chat
requests at a time over HTTP, first with three tools and `tool_choice: required` (each reply held
to a tool's schema by the grammar), then the same chats unconstrained: the tools described in the
system message as the engine describes them to a model whose template has none
(`prepare.tools_told`), EOS ignored, `max_tokens` the forced replies' mean length, so that only
the constraint differs. The two phases take turns `--rounds` times, so drift on a noisy machine
hits both. Per phase: completion tokens per second of wall time; the forced calls are checked
against their schemas (`jsonschema`). Ends nonzero if a forced reply has no valid call.

It starts `mlx-engine launch` (launch defaults, `--model`) unless `--url` names a running server.

  .venv/bin/python scripts/bench_tool_calls.py                      # the default model, CPU
  python3 scripts/bench_tool_calls.py --model /tmp/llama1b          # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STRING = {"type": "string"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": props,
                "required": list(props),
                "additionalProperties": False,
            },
        },
    }
    for name, desc, props in (
        ("get_weather", "The weather in a city.", {"city": STRING, "days": {"type": "integer"}}),
        ("search", "Search the web.", {"query": STRING, "top_k": {"type": "integer"}}),
        (
            "send_mail",
            "Send an email.",
            {"to": STRING, "subject": STRING, "urgent": {"type": "boolean"}},
        ),
    )
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = (
    "What will the weather be in Lisbon over the next three days?",
    "Find me the three best papers on speculative decoding.",
    "Tell Ana by email that the build is broken, it is urgent.",
    "Is it going to rain in Oslo tomorrow?",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start mlx-engine)")
    p.add_argument("--model", default=None, help="for the started engine (default model)")
    p.add_argument("--concurrency", type=int, default=16)
    # NOTE: at temperature 1 about one forced reply in 50 rambles in a string up to
    # --call-tokens; with 32 a phase, the phase's wall time was that one row decoding alone
    # (0.53-0.55x, against 0.71x at 96 on the same engine)
    p.add_argument("--requests", type=int, default=96, help="per phase and round")
    p.add_argument("--call-tokens", type=int, default=256, help="the forced phase's max_tokens")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--parallel", action="store_true", help="parallel_tool_calls (default: one)")
    return p.parse_args()


def body(i: int, plain_tokens: int | None, args: argparse.Namespace) -> dict:
    """Request `i` of a phase: forced (`plain_tokens` None) or plain, that long."""
    from tokenizer_proc.prepare import tools_told

    chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
    out: dict = {"temperature": 1.0, "seed": i}
    if plain_tokens is None:
        forced = {"tools": TOOLS, "tool_choice": "required", "max_tokens": args.call_tokens}
        return out | forced | {"messages": chat, "parallel_tool_calls": args.parallel}
    told = tools_told(chat, TOOLS)
    return out | {"messages": told, "max_tokens": plain_tokens, "ignore_eos": True}


def check(message: dict) -> str | None:
    """Why a forced reply is not a valid call (None: it is)."""
    import jsonschema

    calls = message.get("tool_calls") or []
    if not calls:
        return f"no call: {str(message.get('content'))[:80]!r}"
    for call in calls:
        name, args = call["function"]["name"], call["function"]["arguments"]
        try:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
        except (KeyError, ValueError, jsonschema.ValidationError) as e:
            return f"{name}({args[:80]}): {type(e).__name__}"
    return None


async def phase(
    url: str, plain_tokens: int | None, args: argparse.Namespace
) -> tuple[float, int, list[str]]:
    """Completion tokens per second over the phase, the tokens, and each failed forced reply's
    reason; forced when `plain_tokens` is None."""
    import aiohttp

    gate = asyncio.Semaphore(args.concurrency)
    tokens, failures = 0, []

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal tokens
        request = body(i, plain_tokens, args)
        async with gate, http.post(url + "/v1/chat/completions", json=request) as r:
            reply = await r.json()
        if r.status != 200:
            failures.append(f"HTTP {r.status}: {str(reply)[:120]}")
            return
        tokens += reply["usage"]["completion_tokens"]
        choice = reply["choices"][0]
        why = check(choice["message"]) if plain_tokens is None else None
        if why and choice["finish_reason"] == "length":
            why = f"cut by --call-tokens: {why}"
        if why:
            failures.append(why)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(http, i) for i in range(args.requests)))
        return tokens / (time.perf_counter() - t0), tokens, failures


async def measure(url: str, args: argparse.Namespace) -> int:
    rates: dict[bool, list[float]] = {False: [], True: []}
    failures: list[str] = []
    # NOTE: warm-up: the first shapes, the grammar compiler's tokenizer
    _, tokens, _ = await phase(url, None, args)
    await phase(url, max(1, tokens // args.requests), args)
    for _ in range(args.rounds):
        rate, tokens, bad = await phase(url, None, args)
        rates[True].append(rate)
        failures += bad
        mean = max(1, round(tokens / args.requests))
        print(f"forced: {rate:7.1f} tok/s ({mean} tokens a reply)", flush=True)
        rate, _, _ = await phase(url, mean, args)
        rates[False].append(rate)
        print(f"plain : {rate:7.1f} tok/s", flush=True)
    plain, forced = (sum(rates[k]) / len(rates[k]) for k in (False, True))
    calls = args.requests * args.rounds
    print(f"forced / plain at concurrency {args.concurrency}: {forced / plain:.2f}x")
    print(f"forced replies: {calls}, without a valid call: {len(failures)}")
    for why in failures[:10]:
        print("  ", why)
    return 1 if failures else 0


def main() -> None:
    args = parse_args()
    from mlx_engine.bench.servers import engine_command, free_port, serve, unwind_on_sigterm

    unwind_on_sigterm()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            port = free_port()
            url = stack.enter_context(serve(engine_command(args.model, [], port), port))
        sys.exit(asyncio.run(measure(url, args)))


if __name__ == "__main__":
    main()
