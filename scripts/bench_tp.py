"""Tensor parallel: the engine at TP=1 and TP=N, and mlx-lm's own sharded generation, one run.

For each concurrency (closed loop: a new request starts when one ends), output tokens/s and TTFT
p50 through the SDK to a launched engine (`mlx-engine launch --tp K`), after one warm-up wave;
then mlx-lm on the same weights: `model.shard()` over the same group (ring or NCCL, formed by
engine/distributed.py as the engine forms it), `batch_generate` (or `stream_generate` at 1) with
the same prompt and output lengths. Same model, same workload, same run (DESIGN.md §7).

CPU (two ring ranks, one core each; tiny model, ~3 minutes; both frame carriers):
  .venv/bin/python scripts/bench_tp.py --random tiny --tp 2 --concurrency 1,4,16 \\
      --max-tokens 32 --frames tcp,collective \\
      --launch-args "--max-total-tokens 16384 --context-length 1024"
Two GPUs (on a host without network access, install from a wheelhouse first: docs/distributed.md,
"Installing on a GPU host without network access"; --only runs the engine's side and mlx-lm's in
two shorter calls):
  NCCL_NVLS_ENABLE=0 python3 scripts/bench_tp.py --random llama-8b --random-dir /tmp/llama-8b \\
      --tp 2 --launch-args "--max-running-requests 64" --only engine \\
      --frames tcp,collective --out results/engine.json --log-dir results/logs
  (then the same with --only mlx-lm: the model in /tmp/llama-8b is reused)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START_S = 900.0  # an 8B model written, loaded and warmed on two GPUs


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="an MLX model directory with its tokenizer")
    src.add_argument("--random", choices=["tiny", "llama-1b", "llama-8b"], help="random weights")
    p.add_argument("--random-dir", help="write the random model here (kept; reused if present)")
    p.add_argument(
        "--tokenizer", help="tokenizer files for a random model (default: the default model's)"
    )
    p.add_argument("--only", choices=["engine", "mlx-lm"], help="measure one side only")
    p.add_argument("--tp", type=int, default=2, help="ranks of the sharded runs")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests", type=int, default=0, help="per level; 0: max(8, 2 x concurrency)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--launch-args", default="", help="extra `mlx-engine launch` options")
    p.add_argument(
        "--frames",
        default="tcp",
        help="--tp-frames of the engine's sharded runs, comma-separated (tcp,collective: both "
        "in one run, the first in the main table)",
    )
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--log-dir", default=None, help="keep the engines' logs here")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mlx-lm-rank", default=None, help=argparse.SUPPRESS)  # internal: a rank
    return p.parse_args()


# --- the model ------------------------------------------------------------------------------------


def make_model(args: argparse.Namespace) -> Path:
    """A random model with a tokenizer's files (`--tokenizer`, else the default model's), written
    by a child process so this one never holds device memory; reused when `--random-dir` already
    holds one."""
    out = Path(args.random_dir or tempfile.mkdtemp(prefix="bench-tp-model-"))
    if (out / "config.json").is_file():
        return out
    code = (
        "import sys; from pathlib import Path\n"
        "from engine import random_model as rm\n"
        "name, out, tok = sys.argv[1], Path(sys.argv[2]), sys.argv[3]\n"
        "if not tok:\n"
        "    from engine.models import resolve_model_dir\n"
        "    tok = resolve_model_dir(None)\n"
        "shape, dtype = (rm.TINY_LLAMA, rm.mx.float32) if name == 'tiny' else rm.RANDOM_SHAPES[name]\n"
        "rm.make_random_model(out, shape, tokenizer_from=Path(tok), dtype=dtype)\n"
    )
    cmd = [sys.executable, "-c", code, args.random, str(out), args.tokenizer or ""]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def prompts(args: argparse.Namespace, n: int, vocab: int, salt: int) -> list[list[int]]:
    rng = random.Random(args.seed * 1000 + salt)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]


def vocab_of(model_dir: Path) -> int:
    # NOTE: prompts stay within the tokenizer's ids (the random models borrow SmolLM2's, 49152).
    return min(json.loads((model_dir / "config.json").read_text())["vocab_size"], 49152)


# --- the engine -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    def __init__(self, model: Path, tp: int, extra: list[str], log: Path) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--model", str(model)]
        cmd += ["--zmq-port", str(self.port), "--port", str(free_port()), "--tp", str(tp), *extra]
        self.log = log
        self._log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + START_S
        while "engine ready" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine --tp {tp} did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        self.address = f"tcp://127.0.0.1:{self.port}"

    def run(self, jobs: list[list[int]], conc: int, max_tokens: int) -> dict[str, float]:
        return asyncio.run(self._run(jobs, conc, max_tokens))

    async def _run(self, jobs: list[list[int]], conc: int, max_tokens: int) -> dict[str, float]:
        from engine.client import AsyncEngineClient

        gate = asyncio.Semaphore(conc)
        ttfts: list[float] = []
        params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        async with AsyncEngineClient(self.address, timeout=600) as c:

            async def one(ids: list[int]) -> int:
                async with gate:
                    t0, n = time.perf_counter(), 0
                    async for chunk in c.stream(input_ids=ids, **params):
                        if n == 0 and chunk.token_ids:
                            ttfts.append(time.perf_counter() - t0)
                        n += len(chunk.token_ids)
                    return n

            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(j) for j in jobs)))
            took = time.perf_counter() - t0
            stats = await c.stats()
        return {
            "tok_s": tokens / took,
            "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "broadcast_wait_s": stats.get("tp_broadcast_wait_s", 0.0),
            "iterations": stats.get("tp_iterations", 0.0),
        }

    def stats(self) -> dict[str, float]:
        from engine.client import EngineClient

        with EngineClient(self.address) as c:
            return c.stats()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # NOTE: SIGTERM: the graceful path, every rank exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def bench_engine(
    args: argparse.Namespace, model: Path, tp: int, logs: Path, frames: str = ""
) -> dict[str, Any]:
    extra = shlex.split(args.launch_args) + (["--tp-frames", frames] if frames else [])
    name = f"tp{tp}" + (f"-{frames}" if frames else "")
    engine = Engine(model, tp, extra, logs / f"engine-{name}.log")
    vocab = vocab_of(model)
    out: dict[str, Any] = {}
    try:
        for conc in levels(args):
            engine.run(prompts(args, min(conc, 8), vocab, -conc), conc, min(args.max_tokens, 16))
            before = engine.stats()
            fig = engine.run(
                prompts(args, n_requests(args, conc), vocab, conc), conc, args.max_tokens
            )
            fig["broadcast_wait_s"] -= before.get("tp_broadcast_wait_s", 0.0)
            fig["iterations"] -= before.get("tp_iterations", 0.0)
            out[str(conc)] = fig
            print(f"engine {name} c={conc}: {fmt(fig)}", flush=True)
    finally:
        engine.stop()
    return out


# --- mlx-lm's own sharded generation --------------------------------------------------------------


def bench_mlx_lm(args: argparse.Namespace, model: Path, tp: int, logs: Path) -> dict[str, Any]:
    """Run `tp` rank processes of this script (rank 0 prints the figures as JSON)."""
    from engine.config import EngineConfig
    from engine.distributed import topology

    run_dir = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    topo = topology(EngineConfig(tp=tp), run_dir) if tp > 1 else None
    procs = []
    for rank in range(tp):
        plan = json.dumps(topo.plan(rank).__dict__ if topo else None)
        cmd = [sys.executable, __file__, "--model", str(model), "--mlx-lm-rank", plan]
        cmd += ["--concurrency", args.concurrency, "--prompt-len", str(args.prompt_len)]
        cmd += ["--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
        log = open(logs / f"mlx-lm-tp{tp}-rank{rank}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    try:
        for p in procs:
            p.wait(START_S + 600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
    text = (logs / f"mlx-lm-tp{tp}-rank0.log").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("FIGURES ")]
    if not lines:
        raise RuntimeError(f"mlx-lm --tp {tp} failed:\n{text[-4000:]}")
    out = json.loads(lines[-1][len("FIGURES ") :])
    for conc, fig in out.items():
        print(f"mlx-lm tp={tp} c={conc}: {fmt(fig)}", flush=True)
    return out


def mlx_lm_rank(args: argparse.Namespace) -> None:
    from engine.distributed import RankPlan

    raw = json.loads(args.mlx_lm_rank)
    plan = RankPlan(**{**raw, "hosts": tuple(tuple(h) for h in raw["hosts"])}) if raw else None
    if plan is not None:
        from engine.distributed import pin_share

        plan.enter()
        pin_share(plan)  # NOTE: as the engine's ranks do
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None, log_line=False)
    import mlx.core as mx
    from mlx_lm import batch_generate, load, stream_generate

    from engine.distributed import join_group

    group = join_group(plan) if plan is not None else None
    model, tokenizer = load(args.model, lazy=True)
    if group is not None:
        model.shard(group)
    mx.eval(model.parameters())
    tokenizer._eos_token_ids = set()  # NOTE: fixed output lengths, as the engine's ignore_eos
    vocab = vocab_of(Path(args.model))

    def once(batch: list[list[int]], max_tokens: int) -> float:
        t0 = time.perf_counter()
        if len(batch) == 1:
            for _ in stream_generate(model, tokenizer, batch[0], max_tokens=max_tokens):
                pass
        else:
            batch_generate(model, tokenizer, batch, max_tokens=max_tokens)
        return len(batch) * max_tokens / (time.perf_counter() - t0)

    out = {}
    for conc in levels(args):
        once(prompts(args, conc, vocab, -conc), min(args.max_tokens, 16))  # NOTE: warm-up
        out[str(conc)] = {"tok_s": once(prompts(args, conc, vocab, conc), args.max_tokens)}
    if plan is None or plan.rank == 0:
        print("FIGURES " + json.dumps(out), flush=True)


# --- the run --------------------------------------------------------------------------------------


def levels(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",") if c.strip()]


def n_requests(args: argparse.Namespace, conc: int) -> int:
    return args.requests or max(8, 2 * conc)


def frame_kinds(args: argparse.Namespace) -> list[str]:
    return [f.strip() for f in args.frames.split(",") if f.strip()]


def fmt(fig: dict[str, float]) -> str:
    parts = [f"{fig['tok_s']:.1f} tok/s"]
    if "ttft_p50_ms" in fig:
        parts.append(f"TTFT p50 {fig['ttft_p50_ms']:.1f} ms")
    if fig.get("iterations"):
        us = fig["broadcast_wait_s"] / fig["iterations"] * 1e6
        parts.append(f"broadcast wait {us:.0f} us/iteration")
    return ", ".join(parts)


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    tp = args.tp
    keys = ("engine_tp1", f"engine_tp{tp}", "mlx_lm_tp1", f"mlx_lm_tp{tp}")
    print(
        f"\n| concurrency | engine TP=1 | engine TP={tp} | ratio | mlx-lm TP=1 | mlx-lm TP={tp} |"
    )
    print("|---|---|---|---|---|---|")
    for conc in next(v for k, v in results.items() if k in keys):
        tok = [results.get(k, {}).get(conc, {}).get("tok_s") for k in keys]
        cells = ["-" if t is None else f"{t:.1f}" for t in tok]
        ratio = f"{tok[1] / tok[0]:.2f}x" if tok[0] and tok[1] else "-"
        print(f"| {conc} | {cells[0]} | {cells[1]} | {ratio} | {cells[2]} | {cells[3]} |")
    kinds = frame_kinds(args)
    runs = [(k, f"engine_tp{tp}" + (f"_{k}" if i else "")) for i, k in enumerate(kinds)]
    runs = [(k, key) for k, key in runs if key in results]
    if not runs:
        return
    print(
        f"\n| concurrency | --tp-frames | engine TP={tp} tok/s | TTFT p50 ms | frame wait us/iteration |"
    )
    print("|---|---|---|---|---|")
    for conc in results[runs[0][1]]:
        for kind, key in runs:
            fig = results[key][conc]
            wait = fig["broadcast_wait_s"] / fig["iterations"] * 1e6 if fig["iterations"] else 0
            print(
                f"| {conc} | {kind} | {fig['tok_s']:.1f} | {fig['ttft_p50_ms']:.1f} | {wait:.0f} |"
            )


def main() -> None:
    args = parse()
    if args.mlx_lm_rank is not None:
        mlx_lm_rank(args)
        return
    made = make_model(args) if args.random else None
    model = made or Path(args.model)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="bench-tp-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model {model} ({args.random or 'given'}), logs in {logs}", flush=True)
    results: dict[str, Any] = {
        "config": vars(args),
        "nccl_nvls": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    try:
        if args.only != "mlx-lm":
            results["engine_tp1"] = bench_engine(args, model, 1, logs)
            for i, frames in enumerate(frame_kinds(args)):
                key = f"engine_tp{args.tp}" + (f"_{frames}" if i else "")
                results[key] = bench_engine(args, model, args.tp, logs, frames)
        if args.only != "engine" and not args.skip_mlx_lm:
            for tp in (1, args.tp):
                results[f"mlx_lm_tp{tp}"] = bench_mlx_lm(args, model, tp, logs)
    finally:
        if made is not None and not args.random_dir:
            shutil.rmtree(made, ignore_errors=True)
    report(results, args)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
