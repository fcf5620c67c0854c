"""How the KV token budget is spent: request rows of how many tokens, and the prefix store."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.memory import KVBudget, kv_budget

# NOTE: rows are preallocated, so an unbounded context would reserve memory nobody uses;
# without --context-length a row holds at most this many tokens (or the model's limit).
DEFAULT_CONTEXT_CAP = 4096

# NOTE: with the prefix cache on, at least this share of the budget holds cached prefixes; the
# rest holds rows of running requests (see docs/prefix_cache.md for why the split is fixed).
STORE_SHARE = 0.25


@dataclass(frozen=True)
class KVPlan:
    rows: int
    row_len: int
    store_tokens: int  # prefix store slots; 0: no prefix cache
    budget: KVBudget

    def describe(self) -> str:
        return (
            f"{self.budget.describe()}; allocated: {self.rows} rows x {self.row_len} tokens "
            f"+ prefix store {self.store_tokens} tokens"
        )


def plan_kv(
    config: EngineConfig, bytes_per_token: int, max_positions: int | None, weights: int = 0
) -> KVPlan:
    """A row fits the longest allowed request; rows x row_len + store stay within the budget."""
    budget = kv_budget(config.max_total_tokens, config.mem_fraction, bytes_per_token, weights)
    total = budget.tokens
    cap = config.context_length or min(max_positions or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    row_len = max(2, min(cap, total))
    for_rows = total if config.disable_radix_cache else total - int(total * STORE_SHARE)
    rows = max(1, min(config.max_running_requests, for_rows // row_len))
    store = 0 if config.disable_radix_cache else _store_tokens(total, rows * row_len)
    return KVPlan(rows, row_len, store, budget)


def _store_tokens(total: int, in_rows: int) -> int:
    """What the rows leave, but no more than the rows themselves hold.

    NOTE: buffers are allocated (and zeroed) at start-up; when --max-running-requests bounds the
    rows, a store as large as the whole remaining budget (gigabytes on a big host) would cost
    start-up time and resident memory for history no running batch could use as fast as it fills.
    """
    return min(max(0, total - in_rows), in_rows)
