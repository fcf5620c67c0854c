"""What the HTTP API costs against the ZMQ SDK: one launched engine, the same workload through
both, measured alternately in the same run (DESIGN.md §7).

Each round streams `--requests` greedy requests (random token-id prompts, fixed output length)
with `--concurrency` in flight (closed loop), once through the SDK (`AsyncEngineClient.stream`) and
once through `POST /v1/completions` with `stream: true` (aiohttp client, SSE parsed here). Reported:
output throughput of each side (best round), the HTTP/SDK ratio, and time to first token p50 over
every request of every round. Targets (issue 10): >= 0.95x throughput, TTFT p50 within +2 ms.

  .venv/bin/python scripts/bench_http.py                     # default model, launch defaults
  .venv/bin/python scripts/bench_http.py --model DIR --engine-args "--max-total-tokens 8192"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Round:
    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)

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
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    # NOTE: ids from the low range are real tokens of every vocabulary this runs with
    return [
        [rng.randrange(20, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]


def greedy(args: argparse.Namespace) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}


# --- the two clients ----------------------------------------------------------------------------


async def sdk_round(address: str, jobs: list[list[int]], args: argparse.Namespace) -> Round:
    from engine.client import AsyncEngineClient

    out = Round()
    gate = asyncio.Semaphore(args.concurrency)
    async with AsyncEngineClient(address, timeout=600) as c:

        async def one(ids: list[int]) -> None:
            async with gate:
                t0, first = time.perf_counter(), None
                async for chunk in c.stream(input_ids=ids, **greedy(args)):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - t0
                    out.tokens += len(chunk.token_ids)
                out.ttfts.append(first or 0.0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in jobs))
        out.seconds = time.perf_counter() - t0
    return out


async def http_round(base: str, jobs: list[list[int]], args: argparse.Namespace) -> Round:
    import aiohttp

    out = Round()
    gate = asyncio.Semaphore(args.concurrency)
    options = {"stream": True, "stream_options": {"include_usage": True}, **greedy(args)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(ids: list[int]) -> None:
            async with gate:
                t0, first = time.perf_counter(), None
                body = {"model": "bench", "prompt": ids, **options}
                async with session.post(base + "/v1/completions", json=body) as r:
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

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in jobs))
        out.seconds = time.perf_counter() - t0
    return out


# --- the run ------------------------------------------------------------------------------------


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
    from engine.client import EngineClient
    from engine.errors import EngineDead

    zmq_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--zmq-port", str(zmq_port)]
    cmd += ["--port", str(http_port), *shlex.split(args.engine_args)]
    cmd += ["--model", args.model] if args.model else []
    log = open(args.launch_log, "w") if args.launch_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stderr=log)
    address = f"tcp://127.0.0.1:{zmq_port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            EngineClient(address, connect_timeout=2.0).close()
            return proc, address, f"http://127.0.0.1:{http_port}"
        except EngineDead:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise


async def run(args: argparse.Namespace, address: str, base: str) -> dict[str, list[Round]]:
    jobs = prompts(args)
    sides = {
        "sdk": lambda: sdk_round(address, jobs, args),
        "http": lambda: http_round(base, jobs, args),
    }
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 8})
    await sdk_round(address, jobs[: args.concurrency], warm)  # NOTE: first-seen shapes, caches
    await http_round(base, jobs[: args.concurrency], warm)
    results: dict[str, list[Round]] = {"sdk": [], "http": []}
    for i in range(args.rounds):
        order = ["sdk", "http"] if i % 2 == 0 else ["http", "sdk"]
        for side in order:
            r = await sides[side]()
            results[side].append(r)
            print(
                f"round {i} {side:4s}: {r.tok_s:8.1f} tok/s  ttft p50 "
                f"{statistics.median(r.ttfts) * 1e3:7.1f} ms",
                flush=True,
            )
    return results


def report(args: argparse.Namespace, results: dict[str, list[Round]]) -> None:
    best = {side: max(r.tok_s for r in rounds) for side, rounds in results.items()}
    p50 = {
        side: statistics.median([t for r in rounds for t in r.ttfts]) * 1e3
        for side, rounds in results.items()
    }
    print(
        f"\nmodel={args.model or 'default'} requests={args.requests} concurrency="
        f"{args.concurrency} prompt={args.prompt_len} max_tokens={args.max_tokens} "
        f"rounds={args.rounds}"
    )
    print(f"{'':6s}{'tok/s (best)':>14s}{'TTFT p50 ms':>14s}")
    for side in ("sdk", "http"):
        print(f"{side:6s}{best[side]:14.1f}{p50[side]:14.1f}")
    print(
        f"HTTP/SDK throughput {best['http'] / best['sdk']:.3f}x, "
        f"TTFT p50 {p50['http'] - p50['sdk']:+.1f} ms"
    )


def main() -> None:
    args = parse()
    proc, address, base = launch(args)
    try:
        report(args, asyncio.run(run(args, address, base)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
