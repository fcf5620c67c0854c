"""How much KV memory this process may use: device capacity minus the weights, times a fraction.

Per backend (code paths stay backend-neutral):
- Metal: the smaller of the recommended working set (beyond it macOS pages GPU memory, and an
  out-of-memory is not catchable) and the memory macOS reports available plus what MLX already
  holds (the working set is a static figure, blind to what other apps use);
- CUDA: the device's free memory plus what this process already holds (total memory without NVML);
- CPU: available RAM (`MemAvailable` on Linux, physical memory elsewhere) plus what MLX already holds.
Everything here is computed once at start-up: the KV pool grows up to the budget and shrinks back
when idle (scheduler_proc/kv_cache.py), never beyond it.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

# NOTE: what macOS hands out without swapping: free pages, speculative ones (read ahead, dropped
# first) and inactive ones (reclaimed before anything is paged out), as psutil's `available`.
VM_STAT_AVAILABLE = ("Pages free", "Pages speculative", "Pages inactive")


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
        return _metal_memory()
    if mx.cuda.is_available():
        info = mx.device_info()
        if "free_memory" in info:
            free = int(info["free_memory"]) + mx.get_active_memory()
            return DeviceMemory("cuda", free, "CUDA free memory")
        return DeviceMemory("cuda", int(info["total_memory"]), "CUDA total memory")
    return DeviceMemory("cpu", _available_ram() + mx.get_active_memory(), "available RAM")


def _metal_memory() -> DeviceMemory:
    """The recommended working set, or less when less is available now; logs which bound it."""
    info = mx.device_info()
    working_set = int(info.get("max_recommended_working_set_size") or info["memory_size"])
    free = darwin_available()
    held = mx.get_active_memory() + mx.get_cache_memory()
    if free is not None and free + held < working_set:
        log.info(
            "device memory: macOS available memory %s + MLX's %s, below the Metal recommended "
            "working set %s",
            *map(gib, (free, held, working_set)),
        )
        return DeviceMemory("metal", free + held, "macOS available memory + MLX's")
    seen = "unknown" if free is None else gib(free + held)
    log.info(
        "device memory: the Metal recommended working set %s (available memory + MLX's: %s)",
        gib(working_set),
        seen,
    )
    return DeviceMemory("metal", working_set, "Metal recommended working set")


def darwin_available() -> int | None:
    """Bytes macOS could hand out now without swapping (`vm_stat`); None when unknown.

    NOTE: macOS has no /proc/meminfo and no SC_AVPHYS_PAGES; `vm_stat` reads the same counters
    as host_statistics64, once at start-up."""
    try:
        run = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_vm_stat(run.stdout)


def parse_vm_stat(text: str) -> int | None:
    """Free + speculative + inactive bytes from `vm_stat`'s output; None when it has none."""
    size = re.search(r"page size of (\d+) bytes", text)
    counts = dict(re.findall(r"^(Pages [\w ]+):\s+(\d+)\.?\s*$", text, re.MULTILINE))
    if size is None or "Pages free" not in counts:
        return None
    return int(size.group(1)) * sum(int(counts.get(k, 0)) for k in VM_STAT_AVAILABLE)


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
    source = f"{mem_fraction} x ({dev.source} {gib(dev.capacity)} - weights {gib(weights)})"
    return KVBudget(tokens, bytes_per_token, source)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
