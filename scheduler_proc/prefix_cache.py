"""The prefix cache: a radix tree of token prefixes over a KV prefix store, and when to use it.

The scheduler holds one `PrefixCache` while the cache is on (None when it is off:
`--disable-radix-cache`, a model with recurrent state layers, or no store in the budget) and calls
it at four points of a request's life, all while no step is in flight:
- admission: `admit` finds and locks the longest cached prefix (the last prompt token is always
  computed, for its logits) and copies it into the request's row, so only the rest is prefilled;
- before admission: `should_wait` holds back a request sharing a long uncached prefix with a
  prompt being prefilled (`SHARED_PREFIX_MIN`), so it hits that prompt instead of recomputing it;
- prompt body done: `publish` caches it at once, so requests arriving while it runs (or waiting
  for it) reuse it; the request's lock moves to its end;
- finish, abort or error: `retire` copies the part of the row not cached yet into the store
  (evicting least recently used unlocked spans to make room, caching less when it cannot; nothing
  after an error), inserts it and drops the request's lock.
Under them are the token-level steps (`acquire`, `load`, `extend`, `release`) that
tests/test_radix_cache.py drives directly.
"""

from __future__ import annotations

from scheduler_proc.kv_cache import KVPool
from scheduler_proc.prefix_store import PrefixStore
from scheduler_proc.radix_cache import Hit, RadixCache
from scheduler_proc.request import Req

# NOTE: a waiting request whose prompt shares at least this many uncached tokens (and half of what
# it would compute) with a prompt being prefilled waits for that prompt to be cached first; 16
# takes in a chat template's system prompt (16 users arriving at once on the default model: the
# first prefill step computes 41 tokens instead of 16 x 41).
SHARED_PREFIX_MIN = 16


class PrefixCache:
    def __init__(self, store: PrefixStore, pool: KVPool, window: int | None = None) -> None:
        self.store, self.pool = store, pool
        # NOTE: with ring (sliding-window) layers a hit must end where the store holds its last
        # `window` tokens for those layers too (`_whole_window`).
        self.window = window
        self.tree = RadixCache()
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0

    # -- a request's life --------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Start the row with the longest cached prefix; the last prompt token is always computed."""
        assert req.row is not None, f"{req.rid}: admitted without a row"
        req.hit = self.acquire(req.input_ids, req.prompt_len - 1)
        self.load(req.hit, req.row)
        req.prefilled = req.kv_len = req.cached_tokens = req.hit.length

    def should_wait(self, req: Req, prefilling: list[Req]) -> bool:
        """Whether `req` had better wait until a prompt being prefilled is cached."""
        if not prefilling:
            return False
        cached = self.cached_length(req.input_ids)
        need = max(SHARED_PREFIX_MIN, (req.prompt_len - cached) // 2)
        pending = [r.input_ids for r in prefilling]
        return shares_pending_prefix(req.input_ids, cached, pending, need)

    def publish(self, req: Req) -> None:
        """Prompt body in the KV: cache it now, so others reuse it while this one runs.

        NOTE: the body is every prompt token but the last (which runs in a decode step); a hit is
        capped there anyway, so waiting requests sharing the prompt need nothing more.
        """
        if req.hit is not None and req.row is not None:
            assert req.kv_len >= req.prompt_len - 1, f"{req.rid}: prompt body not in the KV yet"
            self.extend(req.hit, req.input_ids[: req.prompt_len - 1], req.row)

    def retire(self, req: Req) -> None:
        """Before the row goes: cache what it computed (not after an error), drop the lock."""
        hit, req.hit = req.hit, None
        if hit is None:
            return
        tokens = (req.input_ids + req.output_ids)[: req.kv_len]
        self.release(hit, tokens, None if req.finish_reason == "error" else req.row)

    # -- token-level steps -------------------------------------------------------------------
    def acquire(self, tokens: list[int], limit: int) -> Hit:
        """Find and lock the longest cached prefix of at most `limit` tokens; counts a lookup."""
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

    def load(self, hit: Hit, row: int) -> None:
        self.store.load(self.pool, row, hit.slots)

    def cached_length(self, tokens: list[int]) -> int:
        """Longest cached prefix, without locking or counting a lookup."""
        return self.tree.match_prefix(tokens).length

    def extend(self, hit: Hit, tokens: list[int], row: int) -> int:
        """Cache `tokens` (computed in the row) while the request keeps running; moves its lock."""
        saved = self._save(tokens, row)
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)
        self.tree.unlock(hit.node)
        hit.length, hit.slots, hit.node = m.length, m.slots, m.node
        return saved

    def release(self, hit: Hit, tokens: list[int], row: int | None) -> int:
        """Cache `tokens` (whose KV fills the row's first positions), then unlock; exactly once.

        Returns how many new tokens were stored. Without a row (nothing computed, or nothing to
        trust), only unlocks.
        """
        if hit.released:
            raise RuntimeError("prefix cache: request released twice")
        hit.released = True
        saved = 0 if row is None else self._save(tokens, row)
        self.tree.unlock(hit.node)
        return saved

    def _save(self, tokens: list[int], row: int) -> int:
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)  # NOTE: making room must not evict the prefix we extend
        n = self._make_room(len(tokens) - m.length)
        self.tree.unlock(m.node)
        if n <= 0:
            return 0
        slots = self.store.slots.alloc(n)
        self.store.save(self.pool, row, m.length, slots, len(tokens))
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
