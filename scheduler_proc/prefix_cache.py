"""The prefix cache: a radix tree of token prefixes over the KV pages themselves, no copy.

Tree nodes hold token slots of the pool (`page * page_size + offset`) and a reference on each
slot's page, so a cached token's KV stays where its request computed it. The KV manager calls
it while no step is in flight:
- admission: `acquire` finds and locks the longest cached prefix (the last prompt token is always
  computed, for its logits); `layout` says which of its pages the new request shares whole and
  which tokens it copies (the partly filled last page, and a page whose tokens two requests
  wrote, where a hit once ended);
- before admission: `should_wait` holds back a request sharing a long uncached prefix with a
  prompt being prefilled (`SHARED_PREFIX_MIN`), so it hits that prompt instead of recomputing it;
- prompt body done: `publish` caches it at once, so requests arriving while it runs reuse it;
- finish, abort or error: `retire` caches what the request computed (nothing after an error)
  and drops its lock;
- out of pages: `evict` drops least recently used unlocked spans until pages come free.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable

from scheduler_proc.pages import PageAllocator
from scheduler_proc.radix_cache import Hit, RadixCache
from scheduler_proc.request import Req

# NOTE: a waiting request whose prompt shares at least this many uncached tokens (and half of what
# it would compute) with a prompt being prefilled waits for that prompt to be cached first; 16
# takes in a chat template's system prompt (16 users arriving at once on the default model: the
# first prefill step computes 41 tokens instead of 16 x 41).
SHARED_PREFIX_MIN = 16


class PrefixCache:
    def __init__(self, pages: PageAllocator) -> None:
        self.pages = pages
        self.page_size = pages.page_size
        self.tree = RadixCache()
        self.lookups = 0
        self.lookup_tokens = 0
        self.hit_tokens = 0

    # -- a request's life --------------------------------------------------------------------
    def acquire(
        self, tokens: list[int], limit: int, boundary: Callable[[int], int] | None = None
    ) -> Hit:
        """Find and lock the longest cached prefix of at most `limit` tokens, cut back to
        `boundary(length)` when given (where a slot snapshot exists); counts a lookup."""
        m = self.tree.match_prefix(tokens[: max(0, limit)])
        self.tree.lock(m.node)
        n = m.length if boundary is None else boundary(m.length)
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hit_tokens += n
        return Hit(n, m.slots[:n], m.node)

    def layout(self, hit: Hit) -> list[int | list[int]]:
        """Per page of the hit, in order: a page id to share whole, or the token slots to copy
        into a page of the request's own (the hit's last page, when it ends inside one).

        A full page of the hit whose tokens two requests wrote (one's hit ended inside it, the
        other computed the rest) is shared whole too: the page of its last token. A token's slot
        always sits at its position's offset in a page, and a request's page holds every
        position up to its last token: the ones before were computed there, or copied there at
        the same offsets when its own hit ended inside the page. So that page holds all of
        them, for the same tokens (the tree's path to them). Copying such pages instead cost
        every agent's later turn a copy (its system prompt's hit ends inside a page).
        """
        p, slots = self.page_size, hit.slots
        out: list[int | list[int]] = []
        for k in range(-(-hit.length // p)):
            block = slots[k * p : (k + 1) * p]
            if len(block) == p and all(s % p == i for i, s in enumerate(block)):
                out.append(block[-1] // p)
            else:
                out.append(block)
        return out

    def shared_whole(self, hit: Hit, blocks: list[int | list[int]]) -> list[int | list[int]]:
        """`blocks` (`layout(hit)`) up to the first page not shared whole, the hit cut to
        match: nothing to copy (the rest, under a page, is computed again)."""
        whole = 0
        while whole < len(blocks) and isinstance(blocks[whole], int):
            whole += 1
        n = min(hit.length, whole * self.page_size)
        self.hit_tokens -= hit.length - n
        hit.length, hit.slots = n, hit.slots[:n]
        return blocks[:whole]

    def unhit(self, hit: Hit) -> None:
        """An acquired hit the request did not take (it was not admitted)."""
        self.lookups -= 1
        self.hit_tokens -= hit.length
        self.tree.unlock(hit.node)
        hit.released = True

    def should_wait(self, req: Req, pending: PendingPrompts) -> bool:
        """Whether `req` had better wait until a prompt being prefilled (`pending`) is cached."""
        if not pending:
            return False
        cached = self.tree.match_prefix(req.fill_ids).length
        need = max(SHARED_PREFIX_MIN, (req.fill_len - cached) // 2)
        return pending.longest_shared(req.fill_ids) - cached >= need

    def publish(self, req: Req, slots: list[int]) -> None:
        """Prompt body in the KV (`slots`: its tokens' slots): cache it now, move the lock.

        NOTE: the body is every fill token but the last (which runs in a decode step); a hit is
        capped there anyway, so waiting requests sharing the prompt need nothing more.
        """
        hit = req.hit
        if hit is None:
            return
        tokens = req.fill_ids[: req.fill_len - 1]
        self.insert(tokens, slots[: len(tokens)])
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.node)
        self.tree.unlock(hit.node)
        hit.length, hit.slots, hit.node = m.length, m.slots, m.node

    def retire(self, req: Req, slots: list[int] | None) -> None:
        """Before its pages go: cache its tokens (`slots`: where their KV is; None after an
        error, when nothing it computed is trusted) and drop its lock, exactly once."""
        hit, req.hit = req.hit, None
        if hit is None:
            return
        if hit.released:
            raise RuntimeError("prefix cache: request released twice")
        hit.released = True
        if slots is not None:
            tokens = (req.input_ids + req.output_ids)[: req.kv_len]
            self.insert(tokens, slots[: len(tokens)])
        self.tree.unlock(hit.node)

    # -- pages ---------------------------------------------------------------------------------
    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Cache `tokens` at `slots`; the tree takes a reference on the pages of the tokens it
        did not hold yet. Returns how many it holds now that it did not before."""
        present = self.tree.insert(tokens, slots)
        self._ref(slots[present:], +1)
        return len(tokens) - present

    def evict(self, pages_wanted: int) -> None:
        """Drop least recently used unlocked spans until `pages_wanted` pages are free or
        nothing more can go (a span whose pages a running request holds frees no page)."""
        while self.pages.available < pages_wanted:
            short = (pages_wanted - self.pages.available) * self.page_size
            freed = self.tree.evict(short)
            if not freed:
                return
            self._ref(freed, -1)

    def flush(self) -> int:
        """Drop every cached span no running request holds; returns the tokens dropped (a
        running request's own prefix stays until it ends, then is cached as usual)."""
        before = self.tree.total_tokens
        while freed := self.tree.evict(self.tree.total_tokens):
            self._ref(freed, -1)
        if self.tree.observer is not None:
            self.tree.observer.flushed()
        return before - self.tree.total_tokens

    def _ref(self, slots: list[int], sign: int) -> None:
        for page, n in Counter(s // self.page_size for s in slots).items():
            if sign > 0:
                self.pages.incref(page, n, cached=True)
            else:
                self.pages.decref(page, n, cached=True)

    def stats(self) -> dict[str, int | float]:
        rate = self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
        return {
            "prefix_cache_hit_rate": round(rate, 4),
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_tokens": self.tree.total_tokens,
            "prefix_cache_locked_tokens": self.tree.locked_tokens,
            "prefix_cache_evicted_tokens": self.tree.evicted_tokens,
        }


class PendingPrompts:
    """The prompts being prefilled, kept sorted, so the longest prefix a prompt shares with any
    of them is the longer of its two neighbours' (for sorted a <= b <= c, the common prefix of a
    and c is the shorter of a-b's and b-c's): two comparisons, not one per prompt.

    NOTE: a request sharing a long uncached prefix with one of them is better admitted after
    that prefill publishes its prompt: it then computes the shared part zero times instead of
    once more (many users arriving at once with one system prompt). Compared with each, a
    seating pass over W waiting requests and P prefilling ones cost W x P comparisons: 0.2 s a
    pass with 256 arriving at once on this CPU, quadratic in a flood.
    """

    def __init__(self, prompts: Iterable[list[int]] = ()) -> None:
        self._sorted = sorted(prompts)

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, tokens: list[int]) -> None:
        bisect.insort(self._sorted, tokens)

    def longest_shared(self, tokens: list[int]) -> int:
        """The longest common prefix of `tokens` with any pending prompt (0 with none)."""
        i = bisect.bisect_left(self._sorted, tokens)
        near = self._sorted[max(0, i - 1) : i + 1]
        return max((common_prefix(tokens, other) for other in near), default=0)


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
