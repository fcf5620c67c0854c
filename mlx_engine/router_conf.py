"""The router in front of several engines: Shepherd Model Gateway (smg, `pip install smg`) and the
command line it runs with, as `mlx-engine supervisor-conf --router smg` writes it and
docs/distributed.md ("Scale out") explains it. The smg test (tests/test_smg.py) starts smg with
this same command line."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.models import served_name

# NOTE: the name README's examples send; an engine serves any name, smg only those it was told
DEFAULT_ALIAS = "default"
# NOTE: smg probes each engine's /health this often (its default, 60 s, leaves a dead engine's
# requests to retries and the circuit breaker that long)
HEALTH_INTERVAL_S = 5
METRICS_PORT_OFFSET = 1  # NOTE: smg's own Prometheus metrics: the port above the router's


def worker_url(host: str, port: int) -> str:
    """How a router on this host reaches an engine bound to `host`."""
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "localhost", "") else host
    return f"http://[{reach}]:{port}" if ":" in reach else f"http://{reach}:{port}"


def model_name(config: EngineConfig) -> str:
    """The name the engines list at /v1/models: the name smg routes by."""
    model = config.model
    return served_name(model, Path(model) if model else Path())


def smg_command(
    workers: Sequence[str],
    served_model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    grace_s: float | None = None,
) -> list[str]:
    """`python -m smg launch` routing `workers` (engine URLs) by cache affinity."""
    args = [sys.executable, "-m", "smg", "launch", "--host", host, "--port", str(port)]
    args += ["--worker-urls", *workers]
    # NOTE: cache_aware keeps a conversation on the engine that holds its prefix (an approximate
    # radix tree over the request text), unless that engine is much busier than the rest.
    args += ["--policy", "cache_aware"]
    if served_model != DEFAULT_ALIAS:
        # NOTE: smg routes by the ids in /v1/models and an engine cannot declare an alias of its
        # own: a client that sends "default", as it may to an engine, needs this.
        args += ["--model-alias", f"{DEFAULT_ALIAS}={served_model}"]
    args += ["--health-check-interval-secs", str(HEALTH_INTERVAL_S)]
    # NOTE: smg's metrics listen on every interface unless told; keep them beside the router
    args += ["--prometheus-host", host, "--prometheus-port", str(port + METRICS_PORT_OFFSET)]
    if api_key:
        # NOTE: smg asks its clients for this key and sends it to the engines
        args += ["--api-key", api_key]
    if grace_s is not None:
        args += ["--shutdown-grace-period-secs", str(int(grace_s))]
    return args
