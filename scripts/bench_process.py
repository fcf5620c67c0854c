"""What the process boundary costs: the SDK to a launched engine vs the scheduler in-process.

Same model, same workload, same run (compare ratios measured together):
  - throughput at concurrency 16 (closed loop: a new request starts when one finishes),
  - time to first token at concurrency 1 (sequential requests).
The two engines are measured alternately, `--rounds` times each; the best round of each counts.
Targets: the SDK keeps >= 95 % of the throughput and adds <= 2 ms to TTFT.

  .venv/bin/python scripts/bench_process.py                        # default model (SmolLM2-135M)
  .venv/bin/python scripts/bench_process.py --model DIR --requests 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from mlx_engine.bench.servers import unwind_on_sigterm  # noqa: E402


@dataclass
class Job:
    ids: list[int]
    max_tokens: int


@dataclass
class Figures:
    tok_s: float
    ttft_ms: float


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model dir or .gguf (default: embedded)")
    p.add_argument("--requests", type=int, default=48, help="requests in the throughput run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (+-50 %%)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-requests", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only",
        choices=["inprocess", "sdk"],
        help="measure one side only (an SDK-only run keeps MLX out of this process)",
    )
    p.add_argument(
        "--launch-log", default=None, help="write the launched engine's log to this file"
    )
    p.add_argument("--inprocess-sdk", action="store_true", help="also the SDK over InProcessEngine")
    return p.parse_args()


def workload(args: argparse.Namespace, vocab: int, n: int, max_tokens: int) -> list[Job]:
    rng = random.Random(args.seed)
    lo, hi = max(1, args.prompt_len // 2), args.prompt_len * 3 // 2
    return [
        Job([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], max_tokens)
        for _ in range(n)
    ]


def greedy(job: Job) -> dict:
    return {"max_tokens": job.max_tokens, "temperature": 0.0, "ignore_eos": True}


# --- the in-process scheduler -------------------------------------------------------------------


class InProcess:
    def __init__(self, model: str | None) -> None:
        from scheduler_proc.model_loader import load_for_scheduler
        from scheduler_proc.scheduler import Scheduler

        net, eos = load_for_scheduler(model)
        self.sched = Scheduler(EngineConfig(model=model), net, eos)
        self.vocab = int(self.sched.vocab)
        self._n = 0

    def _submit(self, job: Job) -> str:
        from engine.sampling_params import SamplingParams

        self._n += 1
        rid = f"b{self._n}"
        self.sched.submit(rid, job.ids, SamplingParams(**greedy(job)))
        return rid

    def throughput(self, jobs: list[Job], concurrency: int) -> float:
        queue, live, tokens = list(jobs), 0, 0
        t0 = time.perf_counter()
        while queue or live:
            while queue and live < concurrency:
                self._submit(queue.pop(0))
                live += 1
            for out in self.sched.step():
                tokens += len(out.token_ids)
                live -= out.finish_reason is not None
        return tokens / (time.perf_counter() - t0)

    def ttft(self, jobs: list[Job]) -> float:
        times = []
        for job in jobs:
            t0 = time.perf_counter()
            self._submit(job)
            first = None
            while self.sched.has_work():
                outs = self.sched.step()
                if first is None and any(o.token_ids for o in outs):
                    first = time.perf_counter() - t0
            times.append(first)
        return statistics.median(times) * 1e3


# --- the SDK to a launched engine ---------------------------------------------------------------


class Sdk:
    """The SDK, to a launched engine (`address`) or to the in-process transport (`model`)."""

    def __init__(self, address: str | None = None, model: str | None = None) -> None:
        from engine.client import EngineClient

        self.address = address
        self._transport = None
        if address is None:
            from mlx_engine.inprocess import InProcessEngine

            self._transport = InProcessEngine(model)
        self.client = EngineClient(address or "", transport=self._shared())

    def _shared(self):  # noqa: ANN202 - a transport that outlives each client
        if self._transport is None:
            return None
        transport = self._transport

        class Shared:
            def __getattr__(self, name: str):  # noqa: ANN204
                return getattr(transport, name)

            def close(self) -> None:
                pass

        return Shared()

    def throughput(self, jobs: list[Job], concurrency: int) -> float:
        return asyncio.run(self._throughput(jobs, concurrency))

    async def _throughput(self, jobs: list[Job], concurrency: int) -> float:
        from engine.client import AsyncEngineClient

        gate = asyncio.Semaphore(concurrency)
        async with AsyncEngineClient(
            self.address or "", timeout=600, transport=self._shared()
        ) as c:

            async def one(job: Job) -> int:
                async with gate:
                    r = await c.generate(input_ids=job.ids, **greedy(job))
                    return r.usage.completion_tokens

            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(j) for j in jobs)))
            return tokens / (time.perf_counter() - t0)

    def ttft(self, jobs: list[Job]) -> float:
        times = []
        for job in jobs:
            t0 = time.perf_counter()
            stream = self.client.stream(input_ids=job.ids, **greedy(job))
            next(stream)
            times.append(time.perf_counter() - t0)
            for _ in stream:
                pass
        return statistics.median(times) * 1e3

    def roundtrip_ms(self, n: int = 50) -> float:
        """A stats() call (launched: SDK -> tokenizer -> scheduler -> detokenizer -> SDK)."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.client.stats()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            self.client.shutdown()
        self.client.close()


def launch(model: str | None, log_path: str | None) -> tuple[subprocess.Popen, int]:
    """The engine started (not yet ready) and its ZMQ port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--zmq-port", str(port)]
    cmd += ["--port", str(http_port)]  # NOTE: not the default 30000, which may be taken
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(cmd + (["--model", model] if model else []), stderr=log), port


def connect(proc: subprocess.Popen, port: int) -> Sdk:
    """The SDK on the launched engine, once it is ready."""
    from engine.errors import EngineDead

    deadline = time.monotonic() + 300
    while True:
        try:
            return Sdk(address=f"tcp://127.0.0.1:{port}")
        except EngineDead:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise


# --- the run ------------------------------------------------------------------------------------


def measure(engine: object, tput_jobs: list[Job], ttft_jobs: list[Job], conc: int) -> Figures:
    return Figures(engine.throughput(tput_jobs, conc), engine.ttft(ttft_jobs))  # type: ignore[attr-defined]


def _vocab(model: str | None) -> int:
    """The vocabulary size from config.json, so an SDK-only run never imports MLX here."""
    import json

    if model is None:
        from engine.models import resolve_model_dir

        model = str(resolve_model_dir(None))
    return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])


def main() -> None:
    args = parse()
    unwind_on_sigterm()
    from engine.cpu_backend import setup_cpu_backend

    # NOTE: the launched scheduler sets up the same BLAS itself, so both sides match.
    info = setup_cpu_backend(EngineConfig(), log_line=False)
    engines: dict[str, Any] = {}
    if args.only != "sdk":
        engines["in-process scheduler"] = InProcess(args.model)
    if args.inprocess_sdk and args.only is None:
        engines["SDK -> in-process"] = Sdk(model=args.model)
    proc = None
    if args.only != "inprocess":
        proc, port = launch(args.model, args.launch_log)
    try:  # NOTE: from the launch on: a SIGTERM while it starts leaves no engine either
        if proc is not None:
            engines["SDK -> 3 processes"] = connect(proc, port)
        run(args, info.describe(), engines, proc)
    finally:
        if proc is not None and proc.poll() is None:  # NOTE: an error or SIGTERM mid-run
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args: argparse.Namespace, blas: str, engines: dict[str, Any], proc: Any) -> None:
    vocab = _vocab(args.model)
    tput_jobs = workload(args, vocab, args.requests, args.max_tokens)
    ttft_jobs = workload(args, vocab, args.ttft_requests, 4)
    warm = workload(args, vocab, 4, 4)
    for engine in engines.values():
        measure(engine, warm, warm[:2], 4)
    results: dict[str, list[Figures]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            results[name].append(measure(engine, tput_jobs, ttft_jobs, args.concurrency))
    if proc is None:
        report(args, blas, results)
        return
    roundtrip = engines["SDK -> 3 processes"].roundtrip_ms()
    for engine in engines.values():
        if isinstance(engine, Sdk):
            engine.close()
    proc.wait(60)
    report(args, blas, results)
    print(f"message round trip through all three processes (stats()): {roundtrip:.3f} ms")
    if args.launch_log:
        inside = engine_ttft(args.launch_log)
        print(f"TTFT inside the tokenizer process, median over all rounds: {inside:.2f} ms")


def engine_ttft(log_path: str) -> float:
    """The tokenizer's own TTFT (admission to first chunk) of the 4-token TTFT requests."""
    import re

    text = Path(log_path).read_text()
    # NOTE: the first 6 are the warm-up requests (4 throughput + 2 TTFT).
    found = re.findall(r"completion=4 ttft=([0-9.]+)ms", text)[6:]
    return statistics.median(float(x) for x in found) if found else float("nan")


def report(args: argparse.Namespace, blas: str, results: dict[str, list[Figures]]) -> None:
    best = {
        k: Figures(max(f.tok_s for f in v), min(f.ttft_ms for f in v)) for k, v in results.items()
    }
    print(
        f"model={args.model or 'default (SmolLM2-135M)'} blas={blas} requests={args.requests} "
        f"prompt~{args.prompt_len} max_tokens={args.max_tokens} rounds={args.rounds}"
    )
    print(f"{'engine':24} {'tok/s @' + str(args.concurrency):>12} {'TTFT ms @1':>12}   rounds")
    for name, fig in best.items():
        rounds = ", ".join(f"{f.tok_s:.0f}/{f.ttft_ms:.2f}" for f in results[name])
        print(f"{name:24} {fig.tok_s:12.1f} {fig.ttft_ms:12.2f}   {rounds}")
    base = best.get("in-process scheduler")
    for name, fig in best.items():
        if base is not None and name != "in-process scheduler":
            print(
                f"{name}: throughput ratio {fig.tok_s / base.tok_s:.3f} (target >= 0.95), "
                f"TTFT {fig.ttft_ms - base.ttft_ms:+.2f} ms (target <= +2 ms)"
            )


if __name__ == "__main__":
    main()
