"""Prometheus metrics of the front door: latency histograms it observes itself, and the engine's
counters and gauges (scheduler stats plus the front door's own) rendered from one snapshot, with
the same load under the names routers read (tokenizer_proc/router_metrics.py).

In-memory only (no I/O): `render()` returns the text format that `GET /metrics` serves.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, get_args

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.messages.to_client import FinishReason
from tokenizer_proc import router_metrics

PREFIX = "mlx_engine_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Stat(NamedTuple):
    """A metric read from the stats snapshot: its name after the prefix, its help, and the stats
    key it reads (the name itself when not given)."""

    name: str
    help: str
    key: str = ""
    counter: bool = False  # NOTE: a counter's `_total` suffix is added by the text format


def _counter(name: str, help: str, key: str = "") -> Stat:
    return Stat(name, help, key, counter=True)


STATS = (
    Stat("requests_running", "Requests in the running batch", "running"),
    Stat("requests_waiting", "Requests admitted by the scheduler, waiting for a KV row", "waiting"),
    Stat("requests_in_flight", "Requests between admission and their end"),
    Stat("kv_tokens_used", "KV cache tokens held by running requests", "kv_tokens_in_use"),
    Stat("kv_tokens_total", "KV cache capacity in tokens"),
    Stat("prefix_cache_hit_rate", "Prompt tokens served by the prefix cache"),
    Stat("prefix_cache_tokens", "Tokens held by the prefix cache"),
    Stat("generation_paused", "1 while the operator paused generation", "paused"),
    Stat("weights_version", "Weight swaps since launch"),
    _counter("prompt_tokens", "Prompt tokens of finished requests"),
    _counter("generation_tokens", "Tokens generated", "generated_tokens"),
    _counter("prefill_tokens", "Prompt tokens computed (prefix cache hits excluded)"),
    _counter("prefix_cache_hit_tokens", "Prompt tokens reused from the cache"),
    Stat("kv_disk_bytes", "Bytes of KV blocks in --kv-cache-dir"),
    Stat("kv_disk_files", "KV block files in --kv-cache-dir"),
    _counter(
        "kv_disk_hit_tokens", "Prompt tokens loaded from --kv-cache-dir (also counted as hits)"
    ),
    _counter("kv_disk_read_bytes", "Bytes of KV read from --kv-cache-dir"),
    _counter("kv_disk_written_bytes", "Bytes of KV written to --kv-cache-dir"),
    _counter("kv_disk_evicted_files", "Block files removed to keep --kv-cache-disk-gb"),
    _counter(
        "kv_disk_skipped_files", "Block files skipped: truncated, corrupt or not the block asked"
    ),
    _counter("kv_disk_flush_s", "Seconds between steps spent gathering KV to write to disk"),
    _counter("kv_disk_load_s", "Seconds between steps spent putting KV read from disk in pages"),
    _counter("kv_disk_copy_s", "Seconds the disk writer spent copying KV to the host"),
    _counter("steps_launched", "Model steps launched on the device"),
    _counter("steps_prefill", "Steps whose forward ran prompt chunks"),
    _counter("steps_chained", "Steps launched on the step before's lazy tokens (overlap loop)"),
    _counter("requests_received", "Generation requests received"),
    _counter("requests_rejected", "Requests refused with an error"),
)
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
# NOTE: the scheduler's `BREAKS` (not imported: the front door does not load MLX)
CHAIN_BREAKS = ("seat", "finish", "forced", "spec", "prefill", "pages")
# NOTE: speculative decoding's proposers (`--spec`): counted apart, so acceptance is per proposer
PROPOSERS = ("ngram", "draft")
SPEC = (
    ("spec_proposed_tokens", "Tokens proposed by speculative decoding (--spec), by proposer"),
    ("spec_accepted_tokens", "Proposed tokens the model's own step accepted, by proposer"),
)


class Metrics:
    def __init__(self, model: str = "", adapter: str | None = None) -> None:
        """`model`: the served name; `adapter`: the LoRA adapter loaded (the front door keeps it
        current), both for the router-facing gauges."""
        self.model, self.adapter = model, adapter
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = _histogram("time_to_first_token_seconds", "Time to first token", self)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two generated tokens of one request",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = _histogram("e2e_request_latency_seconds", "Admission to last chunk", self)
        self._snapshot: dict[str, float] = {}
        self.registry.register(_Snapshot(self))

    def observe_tokens(self, n: int, gap: float | None, first: float | None) -> None:
        """`n` tokens arrived `gap` seconds after the previous ones (None: the first ones,
        `first` seconds after admission)."""
        if gap is None:
            if first is not None:
                self.ttft.observe(first)
            return
        for _ in range(n):
            self.itl.observe(gap / n)

    def render(self, stats: dict[str, float]) -> bytes:
        self._snapshot = stats
        return generate_latest(self.registry)


def _histogram(name: str, doc: str, metrics: Metrics) -> Histogram:
    return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=metrics.registry)


class _Snapshot:
    """A custom collector: every counter and gauge is read from the latest stats snapshot."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # NOTE: values come at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        stats: dict[str, Any] = self.metrics._snapshot
        for stat in STATS:
            family = CounterMetricFamily if stat.counter else GaugeMetricFamily
            value = float(stats.get(stat.key or stat.name, 0.0))
            yield family(PREFIX + stat.name, stat.help, value=value)
        finished = CounterMetricFamily(
            PREFIX + "requests_finished", "Requests ended, by finish reason", labels=["reason"]
        )
        for reason in FINISH_REASONS:
            finished.add_metric([reason], float(stats.get(f"finish_{reason}", 0.0)))
        yield finished
        breaks = CounterMetricFamily(
            PREFIX + "chain_breaks",
            "Decode steps that did not chain in the overlap loop, by reason",
            labels=["reason"],
        )
        for reason in CHAIN_BREAKS:
            breaks.add_metric([reason], float(stats.get(f"chain_breaks_{reason}", 0.0)))
        yield breaks
        for name, doc in SPEC:
            spec = CounterMetricFamily(PREFIX + name, doc, labels=["proposer"])
            for proposer in PROPOSERS:
                spec.add_metric([proposer], float(stats.get(f"{name}_{proposer}", 0.0)))
            yield spec
        yield from router_metrics.families(stats, self.metrics.model, self.metrics.adapter)
