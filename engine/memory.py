"""How much KV memory this process may use: device capacity minus the weights, times a fraction.

Per backend (code paths stay backend-neutral):
- Metal: the recommended working set (beyond it macOS pages GPU memory, and an out-of-memory is not
  catchable);
- CUDA: the device's free memory plus what this process already holds (total memory without NVML);
- CPU: available RAM (`MemAvailable` on Linux, physical memory elsewhere) plus what MLX already holds.
Everything here is computed once at start-up, so KV buffers are allocated once and never grow.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


@dataclass(frozen=True)
class DeviceMemory:
    backend: str  # metal, cuda or cpu
    capacity: int  # bytes this process may use on the device, weights included
    source: str  # where the figure came from, for the start-up log


@dataclass(frozen=True)
class KVBudget:
    tokens: int
    bytes_per_token: int
    source: str  # "--max-total-tokens" or how it was derived

    def describe(self) -> str:
        gib = self.tokens * self.bytes_per_token / 2**30
        return f"KV budget {self.tokens} tokens ({gib:.2f} GiB, {self.source})"


def device_memory() -> DeviceMemory:
    if mx.metal.is_available():
        info = mx.device_info()
        size = info.get("max_recommended_working_set_size") or info["memory_size"]
        return DeviceMemory("metal", int(size), "Metal recommended working set")
    if mx.cuda.is_available():
        info = mx.device_info()
        if "free_memory" in info:
            free = int(info["free_memory"]) + mx.get_active_memory()
            return DeviceMemory("cuda", free, "CUDA free memory")
        return DeviceMemory("cuda", int(info["total_memory"]), "CUDA total memory")
    return DeviceMemory("cpu", _available_ram() + mx.get_active_memory(), "available RAM")


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # NOTE: macOS has no /proc and no SC_AVPHYS_PAGES; physical memory is the portable bound.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weights_bytes(model: nn.Module) -> int:
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    return sum(p.nbytes for _, p in params)


def kv_budget(
    max_total_tokens: int,
    mem_fraction: float,
    bytes_per_token: int,
    weights: int,
    device: DeviceMemory | None = None,
) -> KVBudget:
    """Tokens of KV this process may hold: `--max-total-tokens`, or derived from the device."""
    if max_total_tokens > 0:
        return KVBudget(max_total_tokens, bytes_per_token, "--max-total-tokens")
    dev = device or device_memory()
    # NOTE: on CPU and CUDA the loaded weights are already part of what the device reports as
    # used, and were added back above; subtracting them once here counts them exactly once.
    free = max(0, dev.capacity - weights)
    tokens = int(free * mem_fraction) // bytes_per_token
    source = f"{mem_fraction} x ({dev.source} {_gib(dev.capacity)} - weights {_gib(weights)})"
    return KVBudget(tokens, bytes_per_token, source)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
