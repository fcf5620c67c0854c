"""The prefix cache the scheduler talks to: a radix tree of token prefixes over a KV prefix store.

A request's life with the cache:
- admission: `acquire(tokens, limit)` finds and locks the longest cached prefix (at most `limit`
  tokens: the last prompt token is always computed, for its logits); `load` copies it into the
  request's row, so only the rest is prefilled;
- prompt body done: `publish` caches it at once, so requests arriving while it runs (or
  waiting for it, see `shares_pending_prefix`) reuse it; the request's lock moves to its end;
- finish, abort or retraction: `release` copies the part of the row not cached yet into the store
  (evicting least recently used unlocked spans to make room, caching less when it cannot), inserts
  it and drops the request's lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_proc.kv_cache import KVPool
from scheduler_proc.prefix_store import PrefixStore
from scheduler_proc.radix_cache import Node, RadixCache


@dataclass(eq=False)
class Hit:
    """A request's locked cached prefix."""

    length: int
    slots: list[int]
    node: Node
    released: bool = False


class PrefixCache:
    def __init__(self, store: PrefixStore, window: int | None = None) -> None:
        self.store = store
        # NOTE: with ring (sliding-window) layers a hit must end where the store holds its last
        # `window` tokens for those layers too (`_whole_window`).
        self.window = window
        self.tree = RadixCache()
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0

    def acquire(self, tokens: list[int], limit: int) -> Hit:
        m = self.tree.match_prefix(tokens[: max(0, limit)])
        self.tree.lock(m.node)
        n = self._whole_window(m.slots)
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hit_tokens += n
        return Hit(n, m.slots[:n], m.node)

    def _whole_window(self, slots: list[int]) -> int:
        """The longest hit `n <= len(slots)` whose last `window` tokens are all stored for the
        ring layers (every token, when the hit is shorter than the window)."""
        n = len(slots)
        if self.window is None:
            return n
        ok = self.store.window_ok
        while n > 0:
            bad = [i for i in range(max(0, n - self.window), n) if not ok[slots[i]]]
            if not bad:
                break
            n = bad[-1]
        return n

    def load(self, hit: Hit, pool: KVPool, row: int) -> None:
        self.store.load(pool, row, hit.slots)

    def cached_length(self, tokens: list[int]) -> int:
        """Longest cached prefix, without locking or counting a lookup."""
        return self.tree.match_prefix(tokens).length

    def publish(self, hit: Hit, tokens: list[int], pool: KVPool, row: int) -> int:
        """Cache `tokens` (computed in the row) while the request keeps running; moves its lock."""
        saved = self._save(tokens, pool, row)
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)
        self.tree.unlock(hit.node)
        hit.length, hit.slots, hit.node = m.length, m.slots, m.node
        return saved

    def release(self, hit: Hit, tokens: list[int], pool: KVPool | None, row: int | None) -> int:
        """Cache `tokens` (whose KV fills the row's first positions), then unlock; exactly once.

        Returns how many new tokens were stored. Without a row (nothing computed), only unlocks.
        """
        if hit.released:
            raise RuntimeError("prefix cache: request released twice")
        hit.released = True
        saved = 0 if pool is None or row is None else self._save(tokens, pool, row)
        self.tree.unlock(hit.node)
        return saved

    def _save(self, tokens: list[int], pool: KVPool, row: int) -> int:
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)  # NOTE: making room must not evict the prefix we extend
        n = self._make_room(len(tokens) - m.length)
        self.tree.unlock(m.node)
        if n <= 0:
            return 0
        slots = self.store.slots.alloc(n)
        self.store.save(pool, row, m.length, slots, len(tokens))
        self.tree.insert(tokens[: m.length + n], m.slots + slots)
        return n

    def _make_room(self, n: int) -> int:
        """Evict until `n` slots are free or nothing more can go; returns what can be stored."""
        short = n - self.store.slots.available
        if short > 0:
            self.store.slots.free(self.tree.evict(short))
        return min(n, self.store.slots.available)

    def stats(self) -> dict[str, int | float]:
        rate = self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
        return {
            "prefix_cache_hit_rate": round(rate, 4),
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_tokens": self.tree.total_tokens,
            "prefix_cache_locked_tokens": self.tree.locked_tokens,
            "prefix_cache_evicted_tokens": self.tree.evicted_tokens,
            "prefix_cache_capacity": self.store.size,
        }


def shares_pending_prefix(
    tokens: list[int], cached: int, pending: list[list[int]], min_tokens: int
) -> bool:
    """Whether `tokens` shares at least `min_tokens` beyond `cached` with a prompt being prefilled.

    NOTE: such a request is better admitted after that prefill publishes its prompt: it then
    computes the shared part zero times instead of once more (many users arriving at once with
    one system prompt).
    """
    return any(common_prefix(tokens, other) - cached >= min_tokens for other in pending)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix, by bisection over slice comparisons (C speed, not per token)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
