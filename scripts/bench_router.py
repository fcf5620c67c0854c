#!/usr/bin/env python3
"""Engines behind Shepherd Model Gateway (smg) against one engine alone: the multi-turn agents
workload of `mlx-engine bench`, and each setup's prefix-cache hit rate from the engines' counters.

    .venv/bin/python scripts/bench_router.py --random tiny --engines 2 --users 32

It starts `--engines` engines and smg in front of them with the command line
`mlx-engine supervisor-conf --router smg` writes (mlx_engine/router_conf.py), then runs the same
workload twice: against the first engine alone, and through smg. Each run is
`mlx-engine bench --url URL --workload multiturn` with `--users` users of `--turns` turns at
concurrency `--users` (after its cold wave); the caches are flushed before each. Printed per
setup: requests, errors, hit rate (prompt tokens the engines' prefix caches served over all
prompt tokens, summed over the engines), each engine's share of the prompt tokens, output
tokens/s and TTFT p50. On one host the engines share its cores: the throughput of several is no
figure of scale-out there, the hit rate and the errors are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_engine import router_conf  # noqa: E402
from mlx_engine.bench.servers import free_port, serve, unwind_on_sigterm  # noqa: E402

HIT, PROMPT = "mlx_engine_prefix_cache_hit_tokens_total", "mlx_engine_prompt_tokens_total"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a model directory or .gguf (default: the default model)")
    src.add_argument("--random", choices=["tiny"], help="a tiny random model (CPU-quick)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=512, help="words of the shared system prompt")
    p.add_argument("--input-len", default="64:256", help="words of each user message: LOW:HIGH")
    p.add_argument("--output-len", default="32")
    p.add_argument("--launch-args", default="", help="extra `mlx-engine launch` options")
    p.add_argument("--out", type=Path, default=Path("bench-results/router"))
    return p.parse_args()


def main() -> None:
    args = parse()
    unwind_on_sigterm()
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        model = _model(args, stack)
        urls = [_engine(model, args, i, stack) for i in range(args.engines)]
        name = _get(urls[0] + "/v1/models")["data"][0]["id"]
        port = free_port()
        smg = stack.enter_context(
            serve(
                router_conf.smg_command(urls, name, port=port), port, log=_log(args, "smg", stack)
            )
        )
        _wait_workers(smg, len(urls))
        rows = [
            _measure("one engine", urls[0], urls[:1], args),
            _measure(f"{len(urls)} engines behind smg", smg, urls, args),
        ]
    _print(rows, args)


def _model(args: argparse.Namespace, stack: ExitStack) -> str | None:
    if args.random != "tiny":
        return args.model
    from engine.models import resolve_model_dir
    from engine.random_model import TINY_LLAMA, make_random_model

    out = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"
    return str(make_random_model(out, TINY_LLAMA, tokenizer_from=resolve_model_dir(None)))


SDK_PORTS: dict[str, int] = {}  # NOTE: engine URL -> its SDK port, which keys its control token


def _engine(model: str | None, args: argparse.Namespace, i: int, stack: ExitStack) -> str:
    http, sdk = free_port(), free_port()
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--port", str(http)]
    cmd += ["--zmq-port", str(sdk), *(["--model", model] if model else [])]
    cmd += args.launch_args.split()
    url = stack.enter_context(serve(cmd, http, log=_log(args, f"engine{i}", stack)))
    SDK_PORTS[url] = sdk
    return url


def _log(args: argparse.Namespace, name: str, stack: ExitStack) -> Any:
    return stack.enter_context(open(args.out / f"{name}.log", "w"))


def _measure(label: str, url: str, engines: list[str], args: argparse.Namespace) -> dict:
    for e in engines:
        _flush(e)
    before = [_counters(e) for e in engines]
    out = args.out / label.replace(" ", "-")
    cmd = [sys.executable, "-m", "mlx_engine.cli", "bench", "--url", url]
    cmd += ["--workload", "multiturn", "--num-requests", str(args.users * args.turns)]
    cmd += ["--turns", str(args.turns), "--concurrency", str(args.users)]
    cmd += ["--system-len", str(args.system_len), "--input-len", args.input_len]
    cmd += ["--output-len", args.output_len, "--no-progress", "--out", str(out)]
    print(f"# {label}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = [_counters(e) for e in engines]
    hits = [a[HIT] - b[HIT] for a, b in zip(after, before, strict=True)]
    prompt = [a[PROMPT] - b[PROMPT] for a, b in zip(after, before, strict=True)]
    result = json.loads((out / "bench.json").read_text())["engines"][0]
    runs = [result["cold"], *(lv["warm"] for lv in result["levels"])]
    warm = result["levels"][-1]["warm"]
    return {
        "setup": label,
        "requests": sum(r["requests"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "hit_rate": sum(hits) / max(sum(prompt), 1),
        "shares": [p / max(sum(prompt), 1) for p in prompt],
        "output_tok_s": warm["output_throughput"],
        "ttft_p50_ms": warm["ttft"]["p50"] * 1000,
    }


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    print("| setup | requests | errors | hit rate | engines' shares | output tok/s | TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        shares = " / ".join(f"{s:.2f}" for s in r["shares"])
        print(
            f"| {r['setup']} | {r['requests']} | {r['errors']} | {r['hit_rate']:.3f} | {shares} "
            f"| {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} |"
        )
    print(f"hit rate through smg / one engine: {rows[1]['hit_rate'] / rows[0]['hit_rate']:.3f}")
    (args.out / "router.json").write_text(json.dumps(rows, indent=2))


# --- HTTP ----------------------------------------------------------------------------------------


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    pairs = (line.split(" ", 1) for line in lines if line and not line.startswith("#"))
    return {name: float(value) for name, value in pairs}


def _flush(url: str) -> None:
    """The engine's prefix cache emptied, with the control token its owner's processes may read."""
    from engine import control_token

    token = control_token.read(SDK_PORTS[url])
    req = urllib.request.Request(url + "/flush_cache", method="POST")
    req.add_header("Authorization", f"Bearer {token}")
    urllib.request.urlopen(req, timeout=30).close()


def _wait_workers(url: str, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        workers = _get(url + "/workers")["workers"]
        if sum(w["is_healthy"] and w["status"] == "ready" for w in workers) == n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"smg did not register {n} engines within {timeout:g} s")


if __name__ == "__main__":
    main()
