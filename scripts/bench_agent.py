"""An agent-shaped conversation through Anthropic's Messages API and the official `anthropic`
client: a long system prompt (~`--system-tokens` tokens of instructions and three tool specs),
then `--turns` streamed turns, each after the first carrying the assistant's last reply, a
`tool_use` block and its `tool_result`, as a coding agent's loop does. Per turn: time to the
first event (the first token), input tokens, the tokens read from the prefix cache, and the
model's `tool_use` blocks, each input checked against its tool's schema (`jsonschema`).

It starts `mlx-engine launch` (launch defaults, `--model`) unless `--url` names a running server.
With `--tools` the tools go in the request's `tools`, and `--force` says on which turns
`tool_choice` is `any` (a forced call, held to the tool's schema; default: the first turn's);
without, they are described in the system prompt.

  .venv/bin/python scripts/bench_agent.py --tools                  # the default model, CPU
  python3 scripts/bench_agent.py --model /tmp/llama1b --tools      # a GPU
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _schema(required: dict[str, dict], optional: dict[str, dict] | None = None) -> dict:
    return {
        "type": "object",
        "properties": {**required, **(optional or {})},
        "required": list(required),
        "additionalProperties": False,
    }


STRING = {"type": "string"}
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file of the repository and return its text.",
        "input_schema": _schema({"path": STRING}, {"start_line": {"type": "integer"}}),
    },
    {
        "name": "run_tests",
        "description": "Run the test suite, or one test file, and return the failures.",
        "input_schema": _schema({"path": STRING}, {"verbose": {"type": "boolean"}}),
    },
    {
        "name": "edit_file",
        "description": "Replace one exact string in a file with another.",
        "input_schema": _schema({"path": STRING, "old": STRING, "new": STRING}),
    },
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start mlx-engine)")
    p.add_argument("--model", default=None, help="for the started engine (default model)")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=6)
    # NOTE: a forced call (`--tools`) needs room to close: at 16 the first turn's was cut, no call
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tools", action="store_true", help="send the tools as the request's tools")
    p.add_argument(
        "--force",
        choices=("first", "every", "never"),
        default="first",
        help="the turns whose tool_choice is any (with --tools)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def system_prompt(words: int, rng: random.Random, tools_inline: bool) -> str:
    vocab = "the code test file function error value module change review branch build".split()
    text = "You are a coding agent working in a repository. " + " ".join(
        rng.choice(vocab) for _ in range(words)
    )
    if tools_inline:
        text += "\nTools:\n" + "\n".join(json.dumps(t) for t in TOOLS)
    return text


def forced(i: int, args: argparse.Namespace) -> bool:
    return args.tools and (args.force == "every" or (args.force == "first" and i == 0))


def turn(client, system: str, messages: list, args: argparse.Namespace, i: int) -> tuple:
    extra: dict = {"tools": TOOLS} if args.tools else {}
    if forced(i, args):
        extra["tool_choice"] = {"type": "any"}
    t0 = time.perf_counter()
    first = None
    with client.messages.stream(
        model="m",
        system=system,
        messages=messages,
        max_tokens=args.max_tokens,
        extra_body={"temperature": 0.0, "ignore_eos": True},
        **extra,
    ) as stream:
        # NOTE: the server sends nothing before the first token, so the first event times it
        # (a turn that only calls a tool has no text delta)
        for _ in stream:
            first = first or time.perf_counter()
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    uses = [b for b in final.content if b.type == "tool_use"]
    u = final.usage
    ttft = ((first or time.perf_counter()) - t0) * 1e3
    row = {
        "ttft_ms": round(ttft),
        "input": u.input_tokens + u.cache_read_input_tokens,
        "cached": u.cache_read_input_tokens,
        "tool_use": [f"{b.name}({json.dumps(b.input)})" for b in uses],
        "invalid": [b.name for b in uses if not valid(b.name, b.input)],
    }
    return row, text, uses


def valid(name: str, args: object) -> bool:
    import jsonschema

    if name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(args, SCHEMAS[name])
    except jsonschema.ValidationError:
        return False
    return True


def conversation(client, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    # NOTE: about 1.3 tokens per word with the default model's tokenizer
    system = system_prompt(int(args.system_tokens / 1.3), rng, not args.tools)
    messages: list = [{"role": "user", "content": "Fix the failing test in tests/test_x.py."}]
    rows = []
    for i in range(args.turns):
        row, text, uses = turn(client, system, messages, args, i)
        rows.append(row)
        # NOTE: the model's own call goes back into the history when it made one
        if uses and not row["invalid"]:
            use = {"type": "tool_use", "id": uses[0].id, "name": uses[0].name}
            use["input"] = uses[0].input
        else:
            tool = TOOLS[i % len(TOOLS)]["name"]
            use = {"type": "tool_use", "id": f"toolu_{i}", "name": tool}
            use["input"] = {"path": "x.py"}
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": f"ok {i} " * 20}
        content = ([{"type": "text", "text": text}] if text else []) + [use]
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": [result]},
        ]
    return rows


def main() -> None:
    args = parse_args()
    import contextlib

    import anthropic

    from mlx_engine.bench.servers import engine_command, free_port, serve, unwind_on_sigterm

    unwind_on_sigterm()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            port = free_port()
            url = stack.enter_context(serve(engine_command(args.model, [], port), port))
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
        rows = conversation(client, args)
    for i, row in enumerate(rows):
        print(f"turn {i + 1}: {row}")
    later = rows[1:]
    if later:
        worst = max(r["ttft_ms"] for r in later) / max(1, rows[0]["ttft_ms"])
        cached = all(r["cached"] > 0 for r in later)
        print(f"later turns: TTFT at most {worst:.2f}x the first's; every one cached: {cached}")
    calls = sum(len(r["tool_use"]) for r in rows)
    bad = sum(len(r["invalid"]) for r in rows)
    print(f"tool_use blocks: {calls}, failing their schema: {bad}")
    missing = [i + 1 for i, r in enumerate(rows) if forced(i, args) and not r["tool_use"]]
    if bad or missing:
        sys.exit(f"forced turns without a call: {missing}; calls failing their schema: {bad}")


if __name__ == "__main__":
    main()
