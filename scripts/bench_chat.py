"""Concurrent chat users against a launched engine and against `mlx_lm.server`, in one run.

Each side is started fresh as a user starts it, then `--users` threads each send chat requests
back to back (greedy, `--max-tokens`) until `--requests` are done. Printed per side: output tok/s,
TTFT p50/p99 over all requests, and the first wave (the first `--users` requests after start,
what the first users after READY see) apart. TTFT is the time to the first streamed text on both
sides. The engine is driven through its SDK and `mlx_lm.server` over HTTP (its only interface).

Sides: the engine with launch defaults; `mlx_lm.server` as a user starts it (the mlx-cpu wheel's
reference BLAS, the model as shipped); and on Linux CPU `mlx_lm.server` in the engine's CPU
environment (the same OpenBLAS preloaded, the same float32 weights), so the share of the gain
that comes from scheduling alone shows.

  .venv/bin/python scripts/bench_chat.py                      # default model, 16 users, 48 requests
  .venv/bin/python scripts/bench_chat.py --users 4 --requests 8 --max-tokens 16   # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prefix_cache import _float32_copy, _free_port, _wait_ready  # noqa: E402

TOPICS = ["the sea", "a robot", "autumn", "a city at night", "bread", "a lost key", "rain", "chess"]


@dataclass
class Side:
    name: str
    ttft: list[float] = field(default_factory=list)  # in request order of completion
    first_wave: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        p = statistics.quantiles(self.ttft, n=100) if len(self.ttft) > 1 else self.ttft * 99
        wave = statistics.median(self.first_wave)
        return (
            f"{self.name:<34} {self.tokens / self.seconds:8.1f} tok/s | TTFT p50 "
            f"{statistics.median(self.ttft):6.2f} s  p99 {p[98]:6.2f} s | first wave p50 "
            f"{wave:6.2f} s"
        )


def messages(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Write a short poem about {topic} (number {i})."}]


def drive(name: str, users: int, requests: int, one: Any) -> Side:
    """`users` threads send requests back to back; `one(i)` -> (ttft_s, tokens)."""
    side, lock, counter = Side(name), threading.Lock(), iter(range(requests))

    def user() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            ttft, n = one(i)
            with lock:
                side.ttft.append(ttft)
                side.tokens += n
                if i < users:
                    side.first_wave.append(ttft)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user) for _ in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    side.seconds = time.perf_counter() - t0
    return side


# ---------------------------------------------------------------- the engine, through the SDK
def run_engine(args: argparse.Namespace) -> Side:
    from engine.client import EngineClient
    from engine.errors import EngineDead

    port = _free_port()
    cmd = [sys.executable, "-m", "engine.cli", "launch", "--zmq-port", str(port)]
    cmd += ["--port", str(_free_port())] + (["--model", args.model] if args.model else [])
    cmd += args.engine_args.split()
    log = open(args.launch_log, "w") if args.launch_log else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                client = EngineClient(f"tcp://127.0.0.1:{port}")
                break
            except EngineDead:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
        with client:

            def one(i: int) -> tuple[float, int]:
                t0, first, n = time.perf_counter(), 0.0, 0
                kw = dict(max_tokens=args.max_tokens, temperature=0.0)
                for chunk in client.stream(messages=messages(i), **kw):
                    if chunk.text and not first:
                        first = time.perf_counter()
                    n += len(chunk.token_ids)
                return (first or time.perf_counter()) - t0, n

            return drive("engine (SDK, launch defaults)", args.users, args.requests, one)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# ---------------------------------------------------------------- mlx_lm.server, over HTTP
def run_server(name: str, model_dir: Path, env: dict[str, str], args: argparse.Namespace) -> Side:
    port = _free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(port, proc)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return drive(name, args.users, args.requests, lambda i: _chat(url, i, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _chat(url: str, i: int, max_tokens: int) -> tuple[float, int]:
    body = dict(messages=messages(i), max_tokens=max_tokens, temperature=0.0, stream=True)
    body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0, first, pieces, usage = time.perf_counter(), 0.0, 0, {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            if delta.get("content"):
                first = first or time.perf_counter()
                pieces += 1
    return (first or time.perf_counter()) - t0, usage.get("completion_tokens", pieces)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2-135M)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--engine-args", default="", help="extra `mlx-engine launch` options")
    p.add_argument("--launch-log", default=None, help="write the engine's log to this file")
    p.add_argument(
        "--peers", default="shipped,same-env", help="comma list of: shipped, same-env (or none)"
    )
    args = p.parse_args()
    from engine.config import EngineConfig
    from engine.cpu_backend import child_env, setup_cpu_backend

    info = setup_cpu_backend(EngineConfig(), log_line=False)
    from engine.models import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    print(f"# {info.describe()}; model {model_dir}; {args.users} users, {args.requests} "
          f"requests, max_tokens {args.max_tokens}", flush=True)  # fmt: skip
    sides = [run_engine(args)]
    print(sides[0].line(), flush=True)
    peers = set(args.peers.split(","))
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if "same-env" in peers and info.optimized and sys.platform == "linux":
        f32, env = _float32_copy(model_dir), child_env(info, dict(plain))
        sides.append(run_server("mlx_lm.server, engine's BLAS+f32", f32, env, args))
        print(sides[-1].line(), flush=True)
    if "shipped" in peers:
        sides.append(run_server("mlx_lm.server as shipped", model_dir, plain, args))
        print(sides[-1].line(), flush=True)
    eng = sides[0]
    for peer in sides[1:]:
        tput = (eng.tokens / eng.seconds) / (peer.tokens / peer.seconds)
        p99 = lambda s: statistics.quantiles(s.ttft, n=100)[98]  # noqa: E731
        print(f"engine vs {peer.name}: throughput {tput:.2f}x, TTFT p50 "
              f"{statistics.median(eng.ttft) / statistics.median(peer.ttft):.2f}x, p99 "
              f"{p99(eng) / p99(peer):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
