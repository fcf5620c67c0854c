"""MLX's allocator limits for a scheduler: the cache of freed buffers, and wired memory on Metal.

Metal's allocator keeps the buffers a step frees for reuse, up to its cache limit, by default
its memory limit (1.5x the recommended working set, at most 95 % of RAM): under steady load the
process drifted towards most of a Mac's memory whatever `--mem-fraction` said. On Metal the
engine sets the cache limit to what one step allocates and frees again, the warm-up's peak, and
at least a floor tied to the planned KV (`cache_limit`); and it wires the weights and the KV, as
mlx-lm does while it generates, so macOS does not page them out, at most weights + planned KV
and at most the recommended working set (`wired_limit`). Both are set at start-up and set back
at shutdown (`AllocatorLimits.restore`).

The other backends keep MLX's own limits:
- CPU: MLX's cache limit there is 32 MiB, below any limit here, so there is nothing to bound (a
  larger cache would keep a step's buffers between steps: fewer page faults for more memory, a
  speed question, not a bound);
- CUDA: the device is the engine's and the KV pool is allocated whole at start-up; MLX's CUDA
  cache (up to its memory limit, released under pressure) saves cudaMallocManaged calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from engine.memory import gib
from scheduler_proc.kv_budget import KVPlan

log = logging.getLogger("scheduler")

# NOTE: the cache keeps at least this much of a step's freed buffers (less when the planned KV
# is small: at most a CACHE_KV_SHARE-th of it); the warm-up's peak is usually larger on a GPU.
CACHE_FLOOR_BYTES = 256 << 20
CACHE_KV_SHARE = 16
# NOTE: mlx-lm warns when the model alone is this close to the working set (generation slows).
WIRED_WARN_SHARE = 0.9


@dataclass
class AllocatorLimits:
    cache: int  # the cache limit of the engine's policy, in bytes (set on Metal only)
    wired: int = 0  # the wired limit set, in bytes (0: none)
    previous: dict[str, int] = field(default_factory=dict)  # setter -> the limit it replaced

    def restore(self) -> None:
        """Set back what `apply` changed (once; the process may go on without the engine)."""
        for name, value in self.previous.items():
            _SETTERS[name](value)
        self.previous.clear()


def cache_limit(step_peak: int, kv_bytes: int) -> int:
    """Bytes of freed buffers MLX may keep: a step's peak, at least the floor."""
    return max(step_peak, min(CACHE_FLOOR_BYTES, kv_bytes // CACHE_KV_SHARE))


def wired_limit(weights: int, kv_bytes: int, working_set: int) -> int:
    """Bytes to keep resident: the weights and the planned KV, at most the working set."""
    return min(weights + kv_bytes, working_set)


def planned_kv_bytes(plan: KVPlan) -> int:
    """The KV pool at its capacity: pages, slots, scratch."""
    return plan.allocated_tokens * plan.budget.bytes_per_token


def apply(plan: KVPlan, weights: int, step_peak: int) -> AllocatorLimits:
    """The engine's limits for this plan; set on Metal (the module's docstring says why only
    there). `step_peak`: the most a step allocated beyond what was held (the warm-up's)."""
    kv = planned_kv_bytes(plan)
    limits = AllocatorLimits(cache_limit(step_peak, kv))
    if not mx.metal.is_available():
        return limits
    mx.synchronize()  # NOTE: MLX: no limit changes while an evaluation is in flight
    limits.previous["cache"] = mx.set_cache_limit(limits.cache)
    log.info("MLX cache limit %s (a step's peak %s)", gib(limits.cache), gib(step_peak))
    _wire(limits, weights, kv, int(mx.device_info()["max_recommended_working_set_size"]))
    return limits


def _wire(limits: AllocatorLimits, weights: int, kv: int, working_set: int) -> None:
    """Wire weights + KV (at most the working set); warn, as mlx-lm does, when the weights
    alone are close to it."""
    wired = wired_limit(weights, kv, working_set)
    if weights > WIRED_WARN_SHARE * working_set:
        log.warning(
            "the model's weights (%s) are close to the Metal recommended working set (%s): "
            "generation may be slow",
            gib(weights),
            gib(working_set),
        )
    try:
        limits.previous["wired"] = mx.set_wired_limit(wired)
    except (ValueError, RuntimeError) as e:  # NOTE: above the system's wired limit (sysctl)
        log.warning("wired limit %s not set: %s", gib(wired), e)
        return
    limits.wired = wired
    log.info(
        "wired limit %s (weights %s + KV up to %s, at most the working set %s)",
        *map(gib, (wired, weights, kv, working_set)),
    )


_SETTERS: dict[str, Callable[[int], int]] = {
    "cache": lambda n: mx.set_cache_limit(n),
    "wired": lambda n: mx.set_wired_limit(n),
}
