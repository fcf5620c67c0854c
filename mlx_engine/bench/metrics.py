"""Figures from request timelines: throughput, TTFT / inter-token / end-to-end percentiles."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from mlx_engine.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _pcts(values: Sequence[float]) -> dict[str, float]:
    return {f"p{p}": percentile(values, p) for p in PERCENTILES}


@dataclass
class Summary:
    """What one set of requests achieved; times in seconds, rates per second."""

    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    request_throughput: float
    output_throughput: float  # completion tokens per second
    total_throughput: float  # prompt + completion tokens per second
    ttft: dict[str, float]
    itl: dict[str, float]
    e2e: dict[str, float]
    # NOTE: from the server's own counters over the run (this engine's /metrics; nan elsewhere)
    prefill_tokens_per_step: float = math.nan
    chained_share: float = math.nan
    first_error: str | None = None  # NOTE: the first failed request's error, as the client saw it

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(results: Sequence[RequestResult]) -> Summary:
    """Throughput counts successful requests over the span from the first start to the last end."""
    ok = [r for r in results if r.error is None]
    failed = sorted((r for r in results if r.error is not None), key=lambda r: r.start)
    span = max((r.end for r in results), default=0.0) - min((r.start for r in results), default=0.0)
    rate = (lambda n: n / span) if span > 0 else (lambda n: 0.0)
    out = sum(r.completion_tokens for r in ok)
    return Summary(
        requests=len(results),
        errors=len(results) - len(ok),
        duration_s=span,
        output_tokens=out,
        request_throughput=rate(len(ok)),
        output_throughput=rate(out),
        total_throughput=rate(out + sum(r.prompt_tokens for r in ok)),
        ttft=_pcts([r.first - r.start for r in ok if r.first is not None]),
        itl=_pcts([x for r in ok if (x := time_per_token(r)) is not None]),
        e2e=_pcts([r.end - r.start for r in ok]),
        first_error=failed[0].error if failed else None,
    )


def time_per_token(r: RequestResult) -> float | None:
    """A request's mean inter-token latency: first to last text over the tokens between.

    NOTE: per request, not per chunk gap: servers stream a token per chunk or several, and a
    client reading a burst of chunks stamps them alike; this figure is the same either way.
    """
    if r.first is None or r.completion_tokens < 2:
        return None
    return (r.chunk_times[-1] - r.first) / (r.completion_tokens - 1)


# NOTE: the engine's counters (tokenizer_proc/metrics.py) the step figures are made of
STEP_COUNTERS = ("prefill_tokens", "steps_prefill", "steps_chained", "steps_launched")


def step_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens per prefill step and the share of steps chained in the overlap loop, over
    the run between two reads of the counters (nan where the server has none)."""
    d = {k: after.get(k, math.nan) - before.get(k, math.nan) for k in STEP_COUNTERS}
    ratio = lambda a, b: a / b if b and not math.isnan(b) else math.nan  # noqa: E731
    return {
        "prefill_tokens_per_step": ratio(d["prefill_tokens"], d["steps_prefill"]),
        "chained_share": ratio(d["steps_chained"], d["steps_launched"]),
    }
