"""How the KV token budget is spent: request rows of how many tokens, and the prefix store."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.memory import KVBudget, kv_budget
from scheduler_proc.kv_cache import ring_size

# NOTE: rows are preallocated, so an unbounded context would reserve memory nobody uses;
# without --context-length a row holds at most this many tokens (or the model's limit).
DEFAULT_CONTEXT_CAP = 4096

# NOTE: with the prefix cache on, the store holds up to this share of what the rows hold; it is
# sized after the rows and never takes one away (see docs/prefix_cache.md).
STORE_SHARE = 0.25


@dataclass(frozen=True)
class KVPlan:
    rows: int
    row_len: int
    store_tokens: int  # prefix store slots; 0: no prefix cache
    budget: KVBudget
    rows_wanted: int  # --max-running-requests
    # NOTE: a row's recurrent state, less what its window layers' rings save against a full
    # row, in tokens' worth of KV bytes (negative when the rings save more than the state costs).
    row_extra_tokens: int = 0

    @property
    def tokens(self) -> int:
        """Tokens allocated: request rows (state and rings included), the scratch row, the store."""
        return (self.rows + 1) * (self.row_len + self.row_extra_tokens) + self.store_tokens

    def describe(self) -> str:
        gib = self.tokens * self.budget.bytes_per_token / 2**30
        rows = f"{self.rows} rows"
        if self.rows < self.rows_wanted:
            rows += f" (memory allows {self.rows} of the {self.rows_wanted} asked)"
        return (
            f"KV allocated {gib:.2f} GiB: {rows} x {self.row_len} tokens + prefix store "
            f"{self.store_tokens} tokens; cap: {self.budget.describe()}"
        )


def plan_kv(
    config: EngineConfig,
    bytes_per_token: int,
    max_positions: int | None,
    weights: int = 0,
    row_state_bytes: int = 0,
    prefix_cache_ok: bool = True,
    windows: Sequence[tuple[int, int]] = (),
    chunk: int | None = None,
) -> KVPlan:
    """Rows for --max-running-requests first, then the store, all within the memory cap.

    The pool is sized from what the rows need, not from the device: the cap (--mem-fraction or
    --max-total-tokens) only bounds it. One extra row is the scratch row padded forwards write to.
    A row's recurrent state (`row_state_bytes`, hybrid models) counts as that many bytes of KV;
    a window layer (`windows`: its bytes per token and window) as its ring (`ring_size`).
    """
    budget = kv_budget(config.max_total_tokens, config.mem_fraction, bytes_per_token, weights)
    total = budget.tokens
    cap = config.context_length or min(max_positions or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    row_len = max(2, min(cap, total // 2))
    saved = 0
    for layer_bytes, window in windows:
        ring = ring_size(window, chunk, row_len)
        saved += 0 if ring is None else (row_len - ring) * layer_bytes
    extra = -(-(row_state_bytes - saved) // bytes_per_token)
    want = config.max_running_requests
    rows = max(1, min(want, total // (row_len + extra) - 1))
    left = max(0, total - (rows + 1) * (row_len + extra))
    off = config.disable_radix_cache or not prefix_cache_ok
    store = 0 if off else min(left, int(rows * row_len * STORE_SHARE))
    return KVPlan(rows, row_len, store, budget, want, extra)
