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

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(results: Sequence[RequestResult]) -> Summary:
    """Throughput counts successful requests over the span from the first start to the last end."""
    ok = [r for r in results if r.error is None]
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
    )


def time_per_token(r: RequestResult) -> float | None:
    """A request's mean inter-token latency: first to last text over the tokens between.

    NOTE: per request, not per chunk gap: servers stream a token per chunk or several, and a
    client reading a burst of chunks stamps them alike; this figure is the same either way.
    """
    if r.first is None or r.completion_tokens < 2:
        return None
    return (r.chunk_times[-1] - r.first) / (r.completion_tokens - 1)
