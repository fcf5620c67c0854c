"""A benchmark run: build the workload once, then for each server start it (or use its URL),
sweep the loads through the one HTTP client, stop it; results, then table / JSON / PNG."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlx_engine.bench import servers
from mlx_engine.bench.client import Load, Target, read_counters, run_load, served_model
from mlx_engine.bench.metrics import STEP_COUNTERS, Summary, step_figures, summarize
from mlx_engine.bench.report import EngineResult, Level, plot, table, write_json
from mlx_engine.bench.workload import (
    Workload,
    jsonl_workload,
    multiturn_workload,
    parse_range,
    random_workload,
)

# NOTE: mlx-lm: mlx_lm.server as a user starts it, and (Linux CPU) in the engine's BLAS + float32
# environment; mlx-lm-env: only the latter (the shipped one runs at ~2 tok/s on a small CPU).
PEERS = ("mlx-lm", "mlx-lm-env")


@dataclass(frozen=True)
class BenchConfig:
    url: str | None = None  # a running server; None: start this engine (launch)
    model: str | None = None  # for launched servers: a model dir or .gguf (None: default model)
    launch_args: tuple[str, ...] = ()
    compare: tuple[str, ...] = ()
    workload: str = "random"  # random | jsonl | multiturn
    dataset: Path | None = None
    num_requests: int = 64
    input_len: str = "64:256"
    output_len: str = "64"
    turns: int = 3
    system_len: int = 512
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    request_rate: tuple[float, ...] = ()
    seed: int = 0
    ignore_eos: bool = True
    out_dir: Path = Path("bench-results")
    progress: bool = True
    launch_log: Path | None = None

    def validate(self) -> BenchConfig:
        if unknown := set(self.compare) - set(PEERS):
            raise ValueError(f"--compare: unknown peer {sorted(unknown)}; known: {PEERS}")
        if self.workload not in ("random", "jsonl", "multiturn"):
            raise ValueError(f"--workload: {self.workload!r} (random, jsonl or multiturn)")
        if self.workload == "jsonl" and self.dataset is None:
            raise ValueError("--workload jsonl needs --dataset FILE")
        if self.num_requests < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("--num-requests and every --concurrency must be >= 1")
        if any(r <= 0 for r in self.request_rate):
            raise ValueError("--request-rate values must be > 0")
        parse_range(self.input_len), parse_range(self.output_len)
        return self

    def loads(self) -> list[Load]:
        if self.request_rate:
            return [Load(max(self.concurrency), r) for r in self.request_rate]
        return [Load(c) for c in self.concurrency]


def build_workload(cfg: BenchConfig) -> Workload:
    out = parse_range(cfg.output_len)
    if cfg.workload == "jsonl":
        return jsonl_workload(cfg.dataset, cfg.num_requests, out, cfg.seed)  # type: ignore[arg-type]
    if cfg.workload == "multiturn":
        users = max(1, cfg.num_requests // cfg.turns)
        user_len = parse_range(cfg.input_len)
        return multiturn_workload(users, cfg.turns, cfg.system_len, user_len, out[1], cfg.seed)
    return random_workload(cfg.num_requests, parse_range(cfg.input_len), out, cfg.seed)


def run_bench(cfg: BenchConfig) -> list[EngineResult]:
    """Measure every server of `cfg` on one workload; write the JSON and PNG; print the table."""
    from engine.cpu_backend import setup_cpu_backend

    info = setup_cpu_backend(None, log_line=False)  # NOTE: before anything imports mlx.core
    servers.unwind_on_sigterm()
    work = build_workload(cfg)
    _say(f"# workload: {work.name}, {work.num_requests} requests; {info.describe()}")
    results = []
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    for started in _servers(cfg, info):
        with started as (target, server):
            results.append(measure(target, work, cfg))
            if server is not None:
                results[-1].log = str(server.log)
                # NOTE: a server that just died may not be gone yet: with errors seen, it has
                # a moment to finish exiting (read at once, a crash was reported as none)
                failed = bool(results[-1].error_lines())
                results[-1].exit_code = server.exit_code(wait=2.0 if failed else 0.0)
        # NOTE: each server's figures as soon as it is measured: a slow peer cut short (a
        # timeout, Ctrl-C) must not take the engine's with it.
        _say(table(results[-1:]))
        write_json(cfg.out_dir / "bench.json", results, _meta(cfg, work, info))
    meta = _meta(cfg, work, info)
    # NOTE: table and JSON first: a failing plot must not lose the figures.
    print(table(results), flush=True)
    write_json(cfg.out_dir / "bench.json", results, meta)
    plot(cfg.out_dir / "bench.png", results, f"{work.name} | {meta['date']} | {meta['host']}")
    _say(f"# wrote {cfg.out_dir / 'bench.json'} and {cfg.out_dir / 'bench.png'}")
    return results


def measure(target: Target, work: Workload, cfg: BenchConfig) -> EngineResult:
    """The cold wave (the workload's first `concurrency[0]` sessions, right after the server
    started), then the whole workload at every load."""
    from tqdm import tqdm

    def run(w: Workload, load: Load, cold: bool) -> Summary:
        desc = f"{target.name[:28]} {'cold wave' if cold else load.label()}"
        before = read_counters(target, STEP_COUNTERS)
        with tqdm(total=w.num_requests, desc=desc, disable=not cfg.progress, leave=False) as bar:
            results = asyncio.run(run_load(target, w, load, seed=cfg.seed, bar=bar))
        steps = step_figures(before, read_counters(target, STEP_COUNTERS))
        return replace(
            summarize(results),
            prefill_tokens_per_step=steps["prefill_tokens_per_step"],
            chained_share=steps["chained_share"],
        )

    first = cfg.concurrency[0]
    cold = Workload(work.name, work.sessions[:first])
    result = EngineResult(target.name, cold=run(cold, Load(first), cold=True))
    for load in cfg.loads():
        result.levels.append(Level(load, run(work, load, cold=False)))
    return result


def _servers(cfg: BenchConfig, info: Any) -> Iterator[Any]:
    """A context manager yielding a Target for each server, each started only when entered."""
    eos = {"ignore_eos": True} if cfg.ignore_eos else {}
    if cfg.url:
        url = cfg.url.rstrip("/")
        yield contextlib.nullcontext((Target(cfg.url, url, eos | served_model(url)), None))
    else:
        port = servers.free_port()
        cmd = servers.engine_command(cfg.model, cfg.launch_args, port)
        log = cfg.launch_log or cfg.out_dir / "mlx-engine.log"
        yield _started("mlx-engine", cmd, port, eos, None, log)
    if not set(cfg.compare) & set(PEERS):
        return
    from engine.models import resolve_model_dir

    model_dir = resolve_model_dir(cfg.model)
    # NOTE: mlx_lm.server has no ignore_eos; a large negative bias on the end tokens gives the
    # same fixed lengths.
    bias = {"logit_bias": {str(t): -1e9 for t in servers.eos_token_ids(model_dir)}}
    extra = bias if cfg.ignore_eos else {}
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if "mlx-lm" in cfg.compare:
        port = servers.free_port()
        name = "mlx_lm.server (as shipped)"
        log = cfg.out_dir / "mlx_lm.log"
        yield _started(name, servers.mlx_lm_command(model_dir, port), port, extra, plain, log)
    if sys.platform == "linux" and info.optimized and _mlx_on_cpu():
        from engine.cpu_backend import child_env

        port, f32 = servers.free_port(), servers.float32_copy(model_dir)
        name = "mlx_lm.server (engine BLAS+f32)"
        env = child_env(info, plain)
        log = cfg.out_dir / "mlx_lm-f32.log"
        yield _started(name, servers.mlx_lm_command(f32, port), port, extra, env, log)


def _mlx_on_cpu() -> bool:
    """Whether MLX runs on the CPU here: the BLAS + float32 peer means nothing on a GPU."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


@contextlib.contextmanager
def _started(name: str, cmd: list[str], port: int, extra: dict, env: Any, log: Path):
    """A server started for the run, its output in `log` (read it when its requests fail)."""
    _say(f"# starting {name}: {' '.join(cmd)} (output: {log})")
    with servers.running(cmd, port, env=env, log=log) as server:
        yield Target(name, server.url, extra), server


def _meta(cfg: BenchConfig, work: Workload, info: Any) -> dict[str, Any]:
    from importlib.metadata import version

    versions = {p: _version(version, p) for p in ("mlx-engine", "mlx", "mlx-lm")}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        "blas": info.describe(),
        "versions": versions,
        "workload": work.name,
        "config": config,
        "argv": sys.argv,
    }


def _version(version: Any, package: str) -> str:
    try:
        return version(package)
    except Exception:  # noqa: BLE001
        return "?"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
