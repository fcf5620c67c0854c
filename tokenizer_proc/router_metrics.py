"""The engine's load under the metric names routers read: those of vLLM, which the Gateway API
Inference Extension's endpoint picker (llm-d) scrapes by default and Shepherd Model Gateway (smg)
parses from `/metrics` when an engine serves no `/v1/loads`.

Served beside the engine's own `mlx_engine_*` metrics, from the same stats snapshot: queue depth,
running requests, the KV cache's usage as a fraction, and the LoRA adapter that is loaded
(docs/distributed.md, "Scale out").
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, Metric

# NOTE: the engine applies one adapter at a time, to every request (scheduler_proc/admin.py)
MAX_LORA = 1
# NOTE: vLLM renamed its KV gauge (gpu_cache_usage_perc -> kv_cache_usage_perc); readers of
# either name are still deployed, so both are served, with the same value.
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def kv_usage(stats: Mapping[str, float]) -> float:
    """KV tokens held by running requests over the KV budget, 0..1 (0 before any stats)."""
    used = float(stats.get("kv_tokens_in_use", 0.0))
    total = used + float(stats.get("kv_tokens_free", 0.0))
    return used / total if total > 0 else 0.0


def families(stats: Mapping[str, float], model: str, adapter: str | None) -> Iterator[Metric]:
    """The router-facing gauges of one stats snapshot, each labelled with the served model."""
    yield _gauge(
        "vllm:num_requests_waiting",
        "Requests waiting for a running slot (queue depth)",
        model,
        stats.get("waiting", 0.0),
    )
    yield _gauge(
        "vllm:num_requests_running",
        "Requests in the running batch",
        model,
        stats.get("running", 0.0),
    )
    for name in KV_USAGE_NAMES:
        yield _gauge(name, "KV cache usage: 1 means every KV token is held", model, kv_usage(stats))
    yield lora_info(adapter)


def lora_info(adapter: str | None, now: float | None = None) -> Metric:
    """vLLM's `lora_requests_info`: the adapters in its labels, and as its value the time of the
    reading (a reader keeps the series with the latest)."""
    labels = ["max_lora", "running_lora_adapters", "waiting_lora_adapters"]
    family = GaugeMetricFamily(
        "vllm:lora_requests_info", "LoRA adapters loaded (labels); value: when read", labels=labels
    )
    family.add_metric([str(MAX_LORA), adapter or "", ""], time.time() if now is None else now)
    return family


def _gauge(name: str, doc: str, model: str, value: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], float(value))
    return family
