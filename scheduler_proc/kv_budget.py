"""How many KV rows of how many tokens: from the token budget, device memory and the model."""

from __future__ import annotations

import os

import mlx.core as mx

from engine.config import EngineConfig

# NOTE: rows are preallocated, so an unbounded context would reserve memory nobody uses;
# without --context-length a row holds at most this many tokens (or the model's limit).
DEFAULT_CONTEXT_CAP = 4096


def available_memory() -> int:
    info = mx.device_info()
    if "memory_size" in info:
        return int(info["memory_size"]) - mx.get_active_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_rows(
    config: EngineConfig, bytes_per_token: int, max_positions: int | None
) -> tuple[int, int]:
    """(rows, row_len): a row fits the longest allowed request; the budget bounds rows x row_len."""
    budget = config.max_total_tokens
    if budget <= 0:
        budget = int(available_memory() * config.mem_fraction) // bytes_per_token
    cap = config.context_length or min(max_positions or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    row_len = max(2, min(cap, budget))
    rows = max(1, min(config.max_running_requests, budget // row_len))
    return rows, row_len
