"""First token after a restart, with and without the prefix cache's disk tier (`--kv-cache-dir`).

An agent's long system prompt is served once; the whole engine is killed with SIGKILL once its
blocks are on disk (or the process would be restarted by a supervisor after a crash), started
again on the same folder, and asked a new question under the same system prompt. The same
question on a fresh engine with an empty folder is the cold start it is compared with. Each
time is a chat completion of one token (the prompt's prefill and one step: the first token).
`--next-turn`: the question after the restart is the conversation's next turn (the first
question, its 16-token reply, a new question) instead of a new conversation under the same
system prompt; a model with window rings or recurrent state hits only there (at a snapshot of
its slot: docs/prefix_cache.md).

    .venv/bin/python scripts/bench_restart.py [--model DIR] [--system-words 2000] [--repeats 3]
        [--next-turn]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_engine.bench.servers import unwind_on_sigterm  # noqa: E402

WORDS = (
    "agent file test edit read write run command output error line function class module "
    "import return value list dict string path search replace build check commit branch merge "
    "review patch diff status log result tool call argument schema project repository"
).split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    live: list[Engine] = []  # NOTE: started, not yet killed: killed on the way out, whatever ends

    def __init__(self, model: str | None, folder: Path, log: Path, extra: list[str]) -> None:
        self.http = _port()
        cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--port", str(self.http)]
        cmd += ["--zmq-port", str(_port()), "--kv-cache-dir", str(folder), *extra]
        cmd += ["--model", model] if model else []
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        Engine.live.append(self)
        deadline = time.monotonic() + 600
        while "engine ready" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"engine did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def first_token_s(self, messages: list[dict], max_tokens: int = 1) -> tuple[float, int, str]:
        """Seconds for a chat completion of `max_tokens` (1: the first token's time), its cached
        prompt tokens and its text."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "json"})
        reply = json.loads(conn.getresponse().read())
        elapsed = time.perf_counter() - t0
        conn.close()
        text = reply["choices"][0]["message"]["content"] or ""
        return elapsed, reply["usage"]["prompt_tokens_details"]["cached_tokens"], text

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.http}/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def written(self, timeout: float = 120.0) -> None:
        """Wait until the disk tier has written what it queued (the byte count stops moving)."""
        deadline, last = time.monotonic() + timeout, -1.0
        while time.monotonic() < deadline:
            now = self.metric("mlx_engine_kv_disk_written_bytes_total")
            if now > 0 and now == last:
                return
            last = now
            time.sleep(1.0)
        raise RuntimeError("the disk tier kept writing")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        if self in Engine.live:
            Engine.live.remove(self)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the engine's)")
    ap.add_argument("--system-words", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--launch-args", default="", help="more `mlx-engine launch` options")
    ap.add_argument("--next-turn", action="store_true", help="ask the conversation's next turn")
    args = ap.parse_args()
    unwind_on_sigterm()
    extra = args.launch_args.split()
    work = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    rows = []
    try:
        for i in range(args.repeats):
            rng = random.Random(i)
            system = " ".join(rng.choice(WORDS) for _ in range(args.system_words))
            questions = [f"question {i}-{k}: which {rng.choice(WORDS)}?" for k in range(2)]
            warm_dir, cold_dir = work / f"warm{i}", work / f"cold{i}"
            turn = [{"role": "system", "content": system}, _user(questions[0])]
            first = Engine(args.model, warm_dir, work / "first.log", extra)
            seed_s, _, reply = first.first_token_s(turn, 16 if args.next_turn else 1)
            first.written()
            first.kill()
            if args.next_turn:
                ask = [*turn, {"role": "assistant", "content": reply}, _user(questions[1])]
            else:
                ask = [turn[0], _user(questions[1])]
            restarted = Engine(args.model, warm_dir, work / "restart.log", extra)
            restart_s, cached, _ = restarted.first_token_s(ask)
            restarted.kill()
            # NOTE: with `--launch-args "--log-level debug"`: where the load's time went
            for line in (work / "restart.log").read_text().splitlines():
                if "disk load:" in line:
                    print("  restarted engine:", line.split("DEBUG ", 1)[-1], flush=True)
            cold = Engine(args.model, cold_dir, work / "cold.log", extra)
            cold_s, _, _ = cold.first_token_s(ask)
            cold.kill()
            rows.append((cold_s, restart_s, cached, seed_s))
            print(
                f"run {i}: cold start {cold_s:.3f} s, after kill -9 and a restart "
                f"{restart_s:.3f} s ({restart_s / cold_s:.2f}x, {cached} cached tokens); "
                f"the first engine's own first request {seed_s:.3f} s",
                flush=True,
            )
    finally:
        for engine in list(Engine.live):
            engine.kill()
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(r[1] / r[0] for r in rows)
    print(f"median restart / cold first-token time: {ratio:.2f}x over {len(rows)} runs")


if __name__ == "__main__":
    main()
