"""What the HTTP API costs against the ZMQ SDK: one launched engine, the same workload through
both, measured in the same run (ratios, never absolute times across runs).

Each round streams `--requests` greedy requests (random token-id prompts, fixed output length,
EOS ignored) with `--concurrency` in flight (closed loop):
  - alternate rounds: all of them through the SDK (`AsyncEngineClient.stream`), then all through
    `POST /v1/completions` with `stream: true` (aiohttp client, SSE parsed here), or the reverse;
  - a mixed round: half the streams through each at once, sharing the engine's batches, so load
    changes of a busy machine between rounds cannot favour either side.
Every client runs in its own process (the SDK's I/O thread and an asyncio HTTP client in one
interpreter would compete for its GIL and measure each other). Time to first token is the time
to the first non-empty text on both sides (what a caller can show; the detokenizer may hold a
first token's text back until the next one). Reported: output throughput (best round) and the
HTTP/SDK ratio, TTFT p50 over every request, the mixed rounds' TTFT and end-to-end p50, and
the front door's (tokenizer process's) CPU time per output token on each side, which a busy
machine's noise barely touches.
Targets: >= 0.95x throughput, TTFT p50 within +2 ms.

  .venv/bin/python scripts/bench_http.py                     # default model, launch defaults
  .venv/bin/python scripts/bench_http.py --model DIR --engine-args "--max-total-tokens 8192"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_engine.bench.servers import free_port  # noqa: E402


@dataclass
class Round:
    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    front_cpu_s: float = 0.0  # CPU time of the tokenizer process (the front door) in this round

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="extra `mlx-engine launch` options")
    p.add_argument("--launch-log", default=None, help="write the engine's log to this file")
    # a client process (internal)
    p.add_argument("--client", choices=["sdk", "http"], help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--part", default="0/1", help=argparse.SUPPRESS)
    return p.parse_args()


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    # NOTE: ids from the low range are real tokens of every vocabulary this runs with
    return [
        [rng.randrange(20, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]


def greedy(args: argparse.Namespace) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}


# --- a client process ---------------------------------------------------------------------------


async def sdk_stream(c: Any, ids: list[int], args: argparse.Namespace, out: Round) -> None:
    t0, first = time.perf_counter(), None
    async for chunk in c.stream(input_ids=ids, **greedy(args)):
        if first is None and chunk.text:
            first = time.perf_counter() - t0
        out.tokens += len(chunk.token_ids)
    out.ttfts.append(first or 0.0)
    out.e2e.append(time.perf_counter() - t0)


async def http_stream(session: Any, args: argparse.Namespace, ids: list[int], out: Round) -> None:
    t0, first = time.perf_counter(), None
    body = {"model": "bench", "prompt": ids, "stream": True, **greedy(args)}
    body["stream_options"] = {"include_usage": True}
    async with session.post(args.base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if event.get("usage"):
                out.tokens += event["usage"]["completion_tokens"]
    out.ttfts.append(first or 0.0)
    out.e2e.append(time.perf_counter() - t0)


async def client_round(args: argparse.Namespace) -> Round:
    """This process's share of the jobs (`--part k/n`), `--concurrency` in flight, after 'go'."""
    import aiohttp

    from engine.client import AsyncEngineClient

    k, n = (int(x) for x in args.part.split("/"))
    jobs = prompts(args)[k::n]
    out = Round()
    gate = asyncio.Semaphore(args.concurrency)
    async with (
        AsyncEngineClient(args.address, timeout=600) as c,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session,
    ):

        async def one(ids: list[int]) -> None:
            async with gate:
                if args.client == "sdk":
                    await sdk_stream(c, ids, args, out)
                else:
                    await http_stream(session, args, ids, out)

        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in jobs))
        out.seconds = time.perf_counter() - t0
    return out


# --- the run ------------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> subprocess.Popen:
    """Start the engine; sets args.address, args.base and args.front_pid (the tokenizer's)."""
    from engine.client import EngineClient
    from engine.errors import EngineDead

    zmq_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--zmq-port", str(zmq_port)]
    cmd += ["--port", str(http_port), *shlex.split(args.engine_args)]
    cmd += ["--model", args.model] if args.model else []
    log_path = args.launch_log or tempfile.mkstemp(prefix="bench-http-", suffix=".log")[1]
    proc = subprocess.Popen(cmd, stderr=open(log_path, "w"))  # noqa: SIM115
    args.address, args.base = f"tcp://127.0.0.1:{zmq_port}", f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            EngineClient(args.address, connect_timeout=2.0).close()
            break
        except EngineDead:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
    args.front_pid = int(
        re.findall(r"tokenizer ready \(pid (\d+)\)", Path(log_path).read_text())[0]
    )
    return proc


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_clients(args: argparse.Namespace, sides: list[str], **overrides: Any) -> dict[str, Round]:
    """One client process per side, each with its share of the jobs and of the concurrency,
    started together."""
    base = [sys.executable, __file__, "--address", args.address, "--base", args.base]
    settings = {**vars(args), **overrides}
    for name in ("requests", "prompt_len", "max_tokens", "seed"):
        base += [f"--{name.replace('_', '-')}", str(settings[name])]
    conc = str(max(1, settings["concurrency"] // len(sides)))
    procs = {
        side: subprocess.Popen(
            [*base, "--client", side, "--concurrency", conc, "--part", f"{k}/{len(sides)}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k, side in enumerate(sides)
    }
    for p in procs.values():
        assert p.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    cpu0 = cpu_seconds(args.front_pid)
    for p in procs.values():
        p.stdin.write("go\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
    out = {}
    for side, p in procs.items():
        stdout, _ = p.communicate(timeout=1800)
        out[side] = Round(**json.loads(stdout.strip().splitlines()[-1]))
    spent, tokens = cpu_seconds(args.front_pid) - cpu0, sum(r.tokens for r in out.values())
    for r in out.values():
        r.front_cpu_s = spent * r.tokens / tokens  # NOTE: a mixed round shares it by tokens
    return out


def measure(args: argparse.Namespace) -> dict[str, list[Round]]:
    run_clients(args, ["sdk", "http"], max_tokens=8)  # NOTE: warm-up: first-seen shapes, caches
    results: dict[str, list[Round]] = {"sdk": [], "http": [], "mixed-sdk": [], "mixed-http": []}
    for i in range(args.rounds):
        order = ["sdk", "http"] if i % 2 == 0 else ["http", "sdk"]
        for side in order:
            results[side].append(run_clients(args, [side])[side])
            show(f"round {i} {side}", results[side][-1])
        for side, r in run_clients(args, order).items():
            results[f"mixed-{side}"].append(r)
            show(f"round {i} mixed-{side}", r)
    return results


def show(label: str, r: Round) -> None:
    ttft, e2e = statistics.median(r.ttfts) * 1e3, statistics.median(r.e2e) * 1e3
    cpu = r.front_cpu_s / r.tokens * 1e6
    print(
        f"{label:20s} {r.tok_s:8.1f} tok/s  TTFT p50 {ttft:7.1f} ms  e2e p50 {e2e:7.1f} ms"
        f"  front-door CPU {cpu:5.1f} us/token",
        flush=True,
    )


def report(args: argparse.Namespace, results: dict[str, list[Round]]) -> None:
    def p50(side: str, key: str) -> float:
        return statistics.median([t for r in results[side] for t in getattr(r, key)]) * 1e3

    best = {side: max(r.tok_s for r in results[side]) for side in ("sdk", "http")}
    print(
        f"\nmodel={args.model or 'default'} requests={args.requests} concurrency="
        f"{args.concurrency} prompt={args.prompt_len} max_tokens={args.max_tokens} "
        f"rounds={args.rounds}"
    )
    print(f"{'':12s}{'tok/s (best)':>14s}{'TTFT p50 ms':>14s}{'e2e p50 ms':>14s}")
    for side in results:
        tok_s = f"{best[side]:14.1f}" if side in best else " " * 14
        print(f"{side:12s}{tok_s}{p50(side, 'ttfts'):14.1f}{p50(side, 'e2e'):14.1f}")
    ttft = p50("http", "ttfts") - p50("sdk", "ttfts")
    mixed = p50("mixed-http", "ttfts") - p50("mixed-sdk", "ttfts")
    e2e = p50("mixed-http", "e2e") / p50("mixed-sdk", "e2e")
    ratio = best["http"] / best["sdk"]
    cpu = {
        side: sum(r.front_cpu_s for r in results[side]) / sum(r.tokens for r in results[side])
        for side in ("sdk", "http")
    }
    print(f"alternate rounds: HTTP/SDK throughput {ratio:.3f}x, TTFT p50 {ttft:+.1f} ms")
    print(
        f"front-door CPU per output token: SDK {cpu['sdk'] * 1e6:.1f} us, "
        f"HTTP {cpu['http'] * 1e6:.1f} us ({cpu['http'] / cpu['sdk']:.2f}x)"
    )
    print(f"mixed rounds (same batches): TTFT p50 {mixed:+.1f} ms, e2e p50 HTTP/SDK {e2e:.3f}x")


def main() -> None:
    args = parse()
    if args.client:
        print(json.dumps(asdict(asyncio.run(client_round(args)))), flush=True)
        return
    proc = launch(args)
    try:
        report(args, measure(args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
