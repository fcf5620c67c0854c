#!/usr/bin/env python3
"""Prefix cache benchmark: multi-turn chat sharing one long system prompt.

Each of `--users` users holds a `--turns`-turn conversation: the shared system prompt, then per turn
a user message and the model's own greedy reply, every turn's prompt extending the previous one.
Users run concurrently; a user's next turn is sent when its previous reply is complete. The same
workload runs, in one invocation, on this engine with the radix cache, without it, and on
`mlx_lm.server` (its LRU prompt cache, in a subprocess, over HTTP streaming). Printed: TTFT mean /
p50 / p90, generated tokens per second, ratios, and whether the outputs agree.

Usage: .venv/bin/python scripts/bench_prefix_cache.py [--small] [--model DIR] [--no-server]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_engine.bench.servers import (  # noqa: E402
    float32_copy,
    free_port,
    unwind_on_sigterm,
    wait_healthy,
)


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    outputs: dict[tuple[int, int], str] = field(default_factory=dict)  # (user, turn) -> text
    generated: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def main() -> None:
    args = _parse()
    unwind_on_sigterm()
    from engine.config import EngineConfig
    from engine.cpu_backend import setup_cpu_backend

    info = setup_cpu_backend(EngineConfig(), log_line=False)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine.models import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    if not args.keep_quantized:
        model_dir = float32_copy(model_dir)
    tok = load_tokenizer(model_dir)
    work = Workload.build(tok, args)
    print(f"# {info.describe()}; model {model_dir}", file=sys.stderr)
    print(f"# workload: {work.describe()}", file=sys.stderr)
    runs = [
        run_engine(model_dir, tok, work, args, cache=True),
        run_engine(model_dir, tok, work, args, cache=False),
    ]
    if not args.no_server:
        runs.append(run_server(model_dir, work, args, info))
    report(runs, work)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded SmolLM2)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=40, help="words per user message")
    p.add_argument("--max-tokens", type=int, default=32, help="reply length cap per turn")
    p.add_argument("--small", action="store_true", help="4 users, 2 turns, 200-token system")
    p.add_argument("--no-server", action="store_true", help="skip mlx_lm.server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-quantized", action="store_true", help="skip the float32 copy (slow on CPU)"
    )
    p.add_argument("--context-length", type=int, default=2048, help="engine KV row length")
    args = p.parse_args()
    if args.small:
        args.users, args.turns, args.system_tokens = 4, 2, 200
    return args


# ---------------------------------------------------------------- the workload


@dataclass
class Workload:
    system: str
    user_msgs: list[list[str]]  # [user][turn]
    max_tokens: int
    system_tokens: int

    @classmethod
    def build(cls, tok: Any, args: argparse.Namespace) -> Workload:
        rng = random.Random(args.seed)
        words = _words(tok)
        system = "System: " + _text(rng, words, tok, args.system_tokens) + "\n"
        msgs = [
            [_text(rng, words, tok, args.user_tokens) for _ in range(args.turns)]
            for _ in range(args.users)
        ]
        return cls(system, msgs, args.max_tokens, len(tok.encode(system)))

    @property
    def users(self) -> int:
        return len(self.user_msgs)

    @property
    def turns(self) -> int:
        return len(self.user_msgs[0])

    def prompt(self, history: str, user: int, turn: int) -> str:
        return f"{history}User: {self.user_msgs[user][turn]}\nAssistant:"

    def history(self, prompt: str, reply: str) -> str:
        """The next turn's context."""
        # NOTE: both engines' replies come normalised (no stop token, stripped), so equal
        # replies give equal next prompts: the two runs stay on one workload.
        return f"{prompt} {reply}\n"

    def describe(self) -> str:
        return (
            f"{self.users} users x {self.turns} turns, system prompt {self.system_tokens} tokens, "
            f"max_tokens {self.max_tokens}, greedy"
        )


def _words(tok: Any) -> list[str]:
    """Plain lower-case words of the vocabulary, so text re-tokenizes to about a token a word."""
    vocab = tok._tokenizer.get_vocab() if hasattr(tok, "_tokenizer") else tok.get_vocab()
    out = [w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isalpha() and w[1:].islower()]
    return sorted(out)[:5000] or ["word"]


def _text(rng: random.Random, words: list[str], tok: Any, n_tokens: int) -> str:
    words_out: list[str] = []
    while len(tok.encode(" ".join(words_out))) < n_tokens:
        words_out += [rng.choice(words) for _ in range(max(1, n_tokens // 8))]
    return " ".join(words_out)


# ---------------------------------------------------------------- this engine


def run_engine(model_dir: Path, tok: Any, work: Workload, args: Any, cache: bool) -> Run:
    from engine.sampling_params import SamplingParams
    from mlx_engine.offline import OfflineEngine

    name = "engine+cache" if cache else "engine"
    print(f"# running {name} ...", file=sys.stderr, flush=True)
    eng = OfflineEngine(
        model=str(model_dir),
        disable_radix_cache=not cache,
        max_running_requests=work.users,
        context_length=args.context_length,
    )
    eng.generate([tok.encode("warm up")], dict(max_tokens=2))  # NOTE: first-call allocations
    sched, run = eng.scheduler, Run(name)
    params = SamplingParams(max_tokens=work.max_tokens, temperature=0.0)
    history = [work.system] * work.users
    sent: dict[str, tuple[int, int, float, str]] = {}
    got: dict[str, list[int]] = {}

    def send(user: int, turn: int) -> None:
        text = work.prompt(history[user], user, turn)
        rid = f"u{user}t{turn}"
        sent[rid] = (user, turn, time.perf_counter(), text)
        sched.submit(rid, tok.encode(text), params)

    t0 = time.perf_counter()
    for u in range(work.users):
        send(u, 0)
    while sched.has_work():
        for out in sched.step():
            user, turn, ts, text = sent[out.rid]
            if out.token_ids and out.rid not in got:
                run.ttft_s.append(time.perf_counter() - ts)
            got.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason is None:
                continue
            run.extra["cached_tokens"] = run.extra.get("cached_tokens", 0) + out.cached_tokens
            ids = got[out.rid][:-1] if out.finish_reason == "stop" else got[out.rid]
            reply = tok.decode(ids).strip()
            run.outputs[(user, turn)] = reply
            run.generated += len(got[out.rid])
            history[user] = work.history(text, reply)
            if turn + 1 < work.turns:
                send(user, turn + 1)
    run.wall_s = time.perf_counter() - t0
    stats = eng.stats()
    run.extra |= {k: v for k, v in stats.items() if "prefix" in k or k == "prefill_tokens"}
    eng.close()
    return run


# ---------------------------------------------------------------- mlx_lm.server


def run_server(model_dir: Path, work: Workload, args: Any, info: Any) -> Run:
    from engine.cpu_backend import child_env

    print("# running mlx_lm.server ...", file=sys.stderr, flush=True)
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--prompt-cache-size", str(4 * work.users), "--decode-concurrency", str(work.users)]
    cmd += ["--prompt-concurrency", str(work.users), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, env=child_env(info, dict(os.environ)), stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        url = f"http://127.0.0.1:{port}/v1/completions"
        _complete(url, "warm up", 2)
        return _drive_server(url, work)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _drive_server(url: str, work: Workload) -> Run:
    run, lock = Run("mlx_lm.server"), threading.Lock()

    def user(u: int) -> None:
        history = work.system
        for turn in range(work.turns):
            text = work.prompt(history, u, turn)
            ts = time.perf_counter()
            ttft, reply, n, cached = _complete(url, text, work.max_tokens)
            with lock:
                run.ttft_s.append(ttft - ts)
                run.outputs[(u, turn)] = reply.strip()
                run.generated += n
                run.extra["cached_tokens"] = run.extra.get("cached_tokens", 0) + cached
            history = work.history(text, reply.strip())

    t0 = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(work.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall_s = time.perf_counter() - t0
    return run


def _complete(url: str, prompt: str, max_tokens: int) -> tuple[float, str, int, int]:
    """One streamed completion: (time of the first text, text, completion tokens, cached tokens)."""
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True)
    body["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    first, parts, usage = 0.0, [], {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            piece = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
            if piece and not first:
                first = time.perf_counter()
            parts.append(piece)
    n = usage.get("completion_tokens", sum(1 for p in parts if p))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first or time.perf_counter(), "".join(parts), n, cached


# ---------------------------------------------------------------- report


def report(runs: list[Run], work: Workload) -> None:
    base = {r.name: r for r in runs}
    print(f"\nworkload: {work.describe()}")
    print(f"{'run':<15}{'wall s':>9}{'gen tok/s':>11}{'TTFT mean':>11}{'p50':>8}{'p90':>8}")
    for r in runs:
        t = sorted(r.ttft_s)
        print(
            f"{r.name:<15}{r.wall_s:>9.2f}{r.generated / r.wall_s:>11.1f}"
            f"{statistics.mean(t):>11.3f}{t[len(t) // 2]:>8.3f}{t[int(len(t) * 0.9)]:>8.3f}"
        )
    cached, plain = base["engine+cache"], base["engine"]
    same = sum(cached.outputs[k] == plain.outputs[k] for k in plain.outputs)
    print(f"\ncache on vs off: identical replies {same}/{len(plain.outputs)}")
    print(f"  TTFT ratio (mean) {_ratio(cached, plain, 'ttft'):.3f}  (target <= 0.3)")
    print(f"  throughput ratio  {_ratio(cached, plain, 'tput'):.2f}  (target >= 1.5)")
    print(f"  engine stats with cache: {cached.extra}")
    print(f"  engine stats without:    {plain.extra}")
    if "mlx_lm.server" in base:
        srv = base["mlx_lm.server"]
        agree = sum(srv.outputs.get(k) == v for k, v in cached.outputs.items())
        print(f"\nengine+cache vs mlx_lm.server: replies agreeing {agree}/{len(cached.outputs)}")
        print(f"  TTFT ratio (mean) {_ratio(cached, srv, 'ttft'):.3f}")
        print(f"  throughput ratio  {_ratio(cached, srv, 'tput'):.2f}")
        print(f"  mlx_lm.server cached tokens: {srv.extra.get('cached_tokens', 0)}")
        for k, v in cached.outputs.items():
            if srv.outputs.get(k) != v:
                print(f"  first difference, user {k[0]} turn {k[1]}:")
                print(f"    engine: {v[:120]!r}\n    server: {srv.outputs.get(k, '')[:120]!r}")
                break


def _ratio(a: Run, b: Run, what: str) -> float:
    if what == "ttft":
        return statistics.mean(a.ttft_s) / statistics.mean(b.ttft_s)
    return (a.generated / a.wall_s) / (b.generated / b.wall_s)


if __name__ == "__main__":
    main()
