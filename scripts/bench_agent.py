"""An agent-shaped conversation through Anthropic's Messages API and the official `anthropic`
client: a long system prompt (~`--system-tokens` tokens of instructions and three tool specs),
then `--turns` streamed turns, each after the first carrying the assistant's last reply, a
`tool_use` block and its `tool_result`, as a coding agent's loop does. Per turn: time to the first
text delta, input tokens, and the tokens read from the prefix cache.

It starts `mlx-engine launch` (launch defaults, `--model`) unless `--url` names a running server.
With `--tools` the tools go in the request's `tools` (the model's template must take them);
without, they are described in the system prompt (the default model's template has no tools).

  .venv/bin/python scripts/bench_agent.py                          # the default model, CPU
  python3 scripts/bench_agent.py --model /tmp/llama1b --tools      # a GPU, a tool-calling model
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = [
    {
        "name": name,
        "description": f"{name.replace('_', ' ')}: {desc}",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name, desc in (
        ("read_file", "read a file of the repository and return its text"),
        ("run_tests", "run the test suite, or one test file, and return the failures"),
        ("edit_file", "replace one exact string in a file with another"),
    )
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start mlx-engine)")
    p.add_argument("--model", default=None, help="for the started engine (default model)")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tools", action="store_true", help="send the tools as the request's tools")
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


def turn(client, system: str, messages: list, args: argparse.Namespace) -> tuple[dict, str]:
    extra = {"tools": TOOLS} if args.tools else {}
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
        for _ in stream.text_stream:
            first = first or time.perf_counter()
        final = stream.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    u = final.usage
    ttft = ((first or time.perf_counter()) - t0) * 1e3
    row = {
        "ttft_ms": round(ttft),
        "input": u.input_tokens + u.cache_read_input_tokens,
        "cached": u.cache_read_input_tokens,
    }
    return row, text


def conversation(client, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    # NOTE: about 1.3 tokens per word with the default model's tokenizer
    system = system_prompt(int(args.system_tokens / 1.3), rng, not args.tools)
    messages: list = [{"role": "user", "content": "Fix the failing test in tests/test_x.py."}]
    rows = []
    for i in range(args.turns):
        row, text = turn(client, system, messages, args)
        rows.append(row)
        tool = TOOLS[i % len(TOOLS)]["name"]
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": tool, "input": {"path": "x.py"}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"ok {i} " * 20}
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text or "."}, use]},
            {"role": "user", "content": [result]},
        ]
    return rows


def main() -> None:
    args = parse_args()
    import contextlib

    import anthropic

    from mlx_engine.bench.servers import engine_command, free_port, serve

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


if __name__ == "__main__":
    main()
