"""A benchmark's results: the terminal table, the JSON file and the PNG plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_engine.bench.client import Load
from mlx_engine.bench.metrics import Summary


@dataclass
class Level:
    load: Load
    warm: Summary


@dataclass
class EngineResult:
    name: str
    cold: Summary | None = None  # the first wave after the server started
    levels: list[Level] = field(default_factory=list)
    log: str | None = None  # NOTE: where the server's output went (a server the bench started)
    exit_code: int | None = None  # NOTE: set when the server exited during the run

    def error_lines(self) -> list[str]:
        """Why its requests failed: the first error of each run that had any, whether the
        server died, and where its output is."""
        runs = [("cold wave", self.cold)] if self.cold else []
        runs += [(lv.load.label(), lv.warm) for lv in self.levels]
        lines = [
            f"{self.name}, {label}: {s.errors} of {s.requests} requests failed; the first: "
            f"{s.first_error}"
            for label, s in runs
            if s.errors
        ]
        if self.exit_code is not None:
            lines.append(
                f"{self.name}: the server exited with code {self.exit_code} during the run"
            )
        if lines and self.log:
            lines.append(f"{self.name}: its output is in {self.log}")
        return lines


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _row(name: str, label: str, s: Summary) -> str:
    return (
        f"{name:<34}{label:>16}{s.request_throughput:>8.2f}{s.output_throughput:>9.1f}"
        f"{s.total_throughput:>9.1f}{_ms(s.ttft['p50']):>8}{_ms(s.ttft['p90']):>8}"
        f"{_ms(s.ttft['p99']):>8}{_ms(s.itl['p50']):>7}{_ms(s.itl['p99']):>7}"
        f"{_ms(s.e2e['p50']):>8}{_ms(s.e2e['p99']):>8}{_n(s.prefill_tokens_per_step):>8}"
        f"{_pct(s.chained_share):>7}{s.errors:>5}/{s.requests}"
    )


def _n(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.0f}%"


HEADER = (
    f"{'engine':<34}{'load':>16}{'req/s':>8}{'out t/s':>9}{'tot t/s':>9}{'TTFT50':>8}"
    f"{'TTFT90':>8}{'TTFT99':>8}{'ITL50':>7}{'ITL99':>7}{'e2e50':>8}{'e2e99':>8}{'pf/step':>8}"
    f"{'chain':>7}{'err':>5}"
)


def table(engines: list[EngineResult]) -> str:
    """Warm rows per engine and load, then the cold first waves, then ratios to the first engine.
    Times in milliseconds; `pf/step`: prompt tokens per prefill step, `chain`: the share of
    steps chained in the overlap loop (the engine's own counters; `-` for a peer)."""
    lines = [HEADER]
    for e in engines:
        lines += [_row(e.name, lv.load.label(), lv.warm) for lv in e.levels]
    cold = [(e.name, e.cold) for e in engines if e.cold]
    if cold:
        lines += ["cold (first wave after start):"]
        lines += [_row(name, f"wave of {c.requests}", c) for name, c in cold]
    lines += ratio_lines(engines)
    lines += [line for e in engines for line in e.error_lines()]
    return "\n".join(lines)


def ratios(base: EngineResult, peer: EngineResult) -> list[dict[str, Any]]:
    """Per load: base / peer output throughput, and base / peer TTFT p50 and p99 (< 1: faster)."""
    out = []
    for a, b in zip(base.levels, peer.levels, strict=True):
        div = lambda x, y: x / y if y and not math.isnan(y) else math.nan  # noqa: E731
        out.append(
            {
                "load": a.load.label(),
                "output_throughput": div(a.warm.output_throughput, b.warm.output_throughput),
                "ttft_p50": div(a.warm.ttft["p50"], b.warm.ttft["p50"]),
                "ttft_p99": div(a.warm.ttft["p99"], b.warm.ttft["p99"]),
            }
        )
    return out


def ratio_lines(engines: list[EngineResult]) -> list[str]:
    lines = []
    for peer in engines[1:]:
        lines.append(f"{engines[0].name} vs {peer.name}:")
        for r in ratios(engines[0], peer):
            lines.append(
                f"  {r['load']:>16}: output throughput {r['output_throughput']:.2f}x, "
                f"TTFT p50 {r['ttft_p50']:.2f}x, p99 {r['ttft_p99']:.2f}x"
            )
    return lines


def to_json(engines: list[EngineResult], meta: dict[str, Any]) -> dict[str, Any]:
    def level(lv: Level) -> dict[str, Any]:
        load = {"concurrency": lv.load.concurrency, "rate": lv.load.rate}
        return {"load": load, "warm": lv.warm.as_dict()}

    def engine(e: EngineResult) -> dict[str, Any]:
        cold = e.cold.as_dict() if e.cold else None
        return {"name": e.name, "cold": cold, "levels": [level(lv) for lv in e.levels]}

    return {
        "meta": meta,
        "engines": [engine(e) for e in engines],
        "ratios": {p.name: ratios(engines[0], p) for p in engines[1:]},
    }


def write_json(path: Path, engines: list[EngineResult], meta: dict[str, Any]) -> None:
    # NOTE: nan (a figure with no samples) is written as null, so the file is strict JSON.
    text = json.dumps(to_json(engines, meta), indent=2, allow_nan=True)
    path.write_text(text.replace("NaN", "null"))


def plot(path: Path, engines: list[EngineResult], title: str) -> None:
    """Output throughput and p99 TTFT against the load, one line per engine."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rate = bool(engines and engines[0].levels and engines[0].levels[0].load.rate)
    xs: list[float | None] = []
    for e in engines:
        xs = [lv.load.rate if rate else lv.load.concurrency for lv in e.levels]
        left.plot(xs, [lv.warm.output_throughput for lv in e.levels], marker="o", label=e.name)
        right.plot(xs, [lv.warm.ttft["p99"] * 1000 for lv in e.levels], marker="o", label=e.name)
    for ax, ylabel in ((left, "output tokens / s"), (right, "TTFT p99 (ms)")):
        ax.set_xlabel("request rate (/s)" if rate else "concurrency")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    # NOTE: a log axis needs a positive value to show (a level with no answered request has none).
    if any(y > 0 for line in right.get_lines() for y in line.get_ydata()):
        right.set_yscale("log")
        right.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        right.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
