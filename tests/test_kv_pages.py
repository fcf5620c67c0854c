"""Randomised model-based tests of the paged KV cache: KVManager + PrefixCache + PageAllocator.

A fake pool holds plain Python values per token slot instead of MLX arrays: the "KV" of position
p of a sequence is the sequence's first p + 1 tokens (real KV is a function of them), so a wrong
slot, a stale slot, a page shared that should have been copied or a copy at the wrong offset shows
up as a wrong value. A page is poisoned when the allocator hands it out, so a stale value left by
its last user never passes by chance. Invariants are checked after every random step.

NOTE: pure Python, well under a second a test (the suite's per-test deadline, tests/conftest.py,
bounds a planted bug that loops).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from engine.sampling_params import SamplingParams
from scheduler_proc.kv_cache import length_groups, token_slots
from scheduler_proc.kv_manager import KVManager, growth_size
from scheduler_proc.pages import PageAllocator
from scheduler_proc.radix_cache import Hit, Node, RadixCache
from scheduler_proc.request import Req

MAX_RUNNING = 6
MAX_OUT = 8  # generated tokens per request
LONGEST = 20 + 12 + MAX_OUT  # a base, a tail, its output (see `_random_tokens`)


class FakePool:
    """What KVManager uses of KVPool, over a dict: token slot -> value."""

    def __init__(self, pages: int, page_size: int, capacity: int | None = None) -> None:
        self.pages, self.page_size = pages, page_size
        self.capacity = capacity or pages  # NOTE: it grows like the real pool, up to this
        self.initial = pages  # NOTE: and shrinks no lower than this
        self.rings: list[None] = [None]  # one full-attention layer: no slot snapshots
        self.states: list[list[object]] = []
        self.data: dict[int, object] = {}

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grow(self, pages: int) -> int:
        add = max(0, min(pages, self.capacity) - self.pages)
        self.pages += add
        return add

    def shrink(self, pages: int) -> int:
        """As the real pool: what lies above `pages` pages is gone (a page in use there would
        read back nothing)."""
        cut = max(0, self.pages - max(pages, self.initial))
        self.pages -= cut
        end = (self.pages + 1) * self.page_size
        self.data = {s: v for s, v in self.data.items() if s < end}
        return cut

    def copy_tokens(self, src: list[int], dst: list[int]) -> None:
        assert len(src) == len(dst)
        values = [self.data.get(s) for s in src]  # NOTE: a gather, then a scatter, like MLX
        for d, v in zip(dst, values, strict=True):
            self.data[d] = v

    def reset_slot(self, slot: int) -> None:
        pass


def make_manager(
    pages: int, page_size: int, capacity: int | None = None
) -> tuple[KVManager, FakePool]:
    pool = FakePool(pages, page_size, capacity)
    kv = KVManager(pool, prefix=True)  # type: ignore[arg-type]
    assert kv.prefix is not None and kv.snapshots is None
    alloc, stale = kv.pages.alloc, itertools.count()

    def poisoned(n: int) -> list[int]:
        got = alloc(n)
        for page in got:
            for s in range(page * page_size, (page + 1) * page_size):
                pool.data[s] = ("stale", next(stale))
        return got

    kv.pages.alloc = poisoned  # type: ignore[method-assign]
    return kv, pool


_slots = itertools.count()


def make_req(rid: str, tokens: list[int]) -> Req:
    req = Req(rid, list(tokens), SamplingParams(), seed=0, max_new=100, stop_ids=frozenset())
    req.slot = next(_slots)
    return req


def seq(req: Req) -> list[int]:
    return req.input_ids + req.output_ids


def compute(kv: KVManager, pool: FakePool, running: list[Req], req: Req, end: int) -> None:
    """Write positions [kv_len, end) through the request's table, as a forward would."""
    tokens, start = seq(req), req.kv_len
    assert start <= end <= len(tokens)
    tree_slots = set(paths(kv.prefix.tree).values())
    p = pool.page_size
    written = token_slots(req.pages, start, end - start, p).tolist()
    for pos, slot in zip(range(start, end), written, strict=True):
        others = [r.rid for r in running if r is not req and slot // p in r.pages]
        assert not others, f"{req.rid} writes page {slot // p}, which {others} read"
        assert slot not in tree_slots, f"{req.rid} overwrites cached slot {slot}"
        pool.data[slot] = tuple(tokens[: pos + 1])
    req.kv_len = req.prefilled = end


# -- invariants ---------------------------------------------------------------------------------
def paths(tree: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix -> the slot of its last token."""
    out: dict[tuple[int, ...], int] = {}
    stack: list[tuple[Node, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.tokens and child.tokens[0] == first and child.parent is node
            assert len(child.tokens) == len(child.slots), "one slot per token"
            p = prefix
            for tok, slot in zip(child.tokens, child.slots, strict=True):
                p = (*p, tok)
                out[p] = slot
            stack.append((child, p))
    return out


def cached_length(cached: dict[tuple[int, ...], int], tokens: list[int], limit: int) -> int:
    n = 0
    while n < limit and tuple(tokens[: n + 1]) in cached:
        n += 1
    return n


def whole_pages(slots: list[int], p: int) -> list[int | None]:
    """Per page-aligned block of a hit: the page shared whole (a full block: the page of its
    last token, whose writer holds every position before it), or None (to copy). Whether that
    page holds the right KV is `check`'s to see."""
    out: list[int | None] = []
    for k in range(-(-len(slots) // p)):
        block = slots[k * p : (k + 1) * p]
        out.append(block[-1] // p if len(block) == p else None)
    return out


def _on_path(node: Node, leaf: Node, root: Node) -> bool:
    while leaf is not root:
        if leaf is node:
            return True
        leaf = leaf.parent
    return False


def check(kv: KVManager, pool: FakePool, running: list[Req]) -> dict[tuple[int, ...], int]:
    cache, alloc, p = kv.prefix, kv.pages, pool.page_size
    tree = cache.tree
    cached = paths(tree)
    assert len(set(cached.values())) == len(cached) == tree.total_tokens, "a slot cached twice"
    for prefix, slot in cached.items():
        assert pool.data.get(slot) == prefix, f"cached {prefix} reads {pool.data.get(slot)}"
        assert slot % p == (len(prefix) - 1) % p, "a cached token off its page offset"
    for r in running:
        tokens = seq(r)
        assert len(r.pages) == len(set(r.pages)) >= pool.pages_for(r.fill_len)
        assert len(r.pages) >= pool.pages_for(r.kv_len)
        got = [pool.data.get(s) for s in kv.slots(r, r.kv_len)]
        want = [tuple(tokens[: i + 1]) for i in range(r.kv_len)]
        assert got == want, f"{r.rid} reads the wrong KV"
        assert r.hit is not None and not r.hit.released
        prefix = [cached[tuple(r.fill_ids[: i + 1])] for i in range(r.hit.length)]
        assert r.hit.slots == prefix, f"{r.rid}'s hit is not its cached path"
    tables = Counter(page for r in running for page in r.pages)
    in_tree = Counter(s // p for s in cached.values())
    free = set(alloc._free)
    assert len(free) == len(alloc._free), "a page on the free list twice"
    for page in range(1, alloc.size + 1):
        assert alloc.refs(page) == tables[page] + in_tree[page], f"page {page} miscounted"
        assert (page in free) == (alloc.refs(page) == 0), f"page {page} free and referenced"
    assert (
        alloc.available + sum(1 for pg in range(1, alloc.size + 1) if alloc.refs(pg)) == alloc.size
    )
    for node in tree.nodes():
        holders = [r for r in running if _on_path(node, r.hit.node, tree.root)]
        assert node.ref == len(holders), "a lock miscounted"
    assert tree.locked_tokens == sum(len(n) for n in tree.nodes() if n.ref > 0)
    return cached


# -- the random walk ----------------------------------------------------------------------------
def _random_tokens(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """Sequences that share prefixes often: a base, cut somewhere, plus a random tail."""
    base = rng.choice(bases)
    head = base[: rng.randint(0, len(base))]
    return head + [rng.randrange(6) for _ in range(rng.randint(1 if not head else 0, 12))]


class Walk:
    def __init__(self, seed: int, page_size: int) -> None:
        self.rng = rng = random.Random(seed * 1000 + page_size)
        need = -(-LONGEST // page_size)
        size = rng.choice([need + 1, 2 * need, 4 * need, 12 * need])  # tight to roomy
        # NOTE: half the walks start small and grow to their size, as the real pool does.
        start = rng.choice([size, max(1, size // 3)])
        self.kv, self.pool = make_manager(start, page_size, capacity=size)
        self.running: list[Req] = []
        self.waiting: list[Req] = []  # preempted, to be admitted again
        self.bases = [[rng.randrange(6) for _ in range(rng.randint(4, 20))] for _ in range(3)]
        self.ids = itertools.count()
        self.admitted = self.refused = 0

    def admit(self) -> None:
        rng, kv = self.rng, self.kv
        if self.waiting and rng.random() < 0.5:
            req = self.waiting.pop(rng.randrange(len(self.waiting)))
            req.slot = next(_slots)
        else:
            req = make_req(f"r{next(self.ids)}", _random_tokens(rng, self.bases))
        reserve = rng.randint(0, 3)
        before = paths(kv.prefix.tree)
        free, refs = list(kv.pages._free), list(kv.pages._refs)
        locked, evictable = kv.prefix.tree.locked_tokens, kv.prefix.tree.evictable_tokens
        lookups = kv.prefix.lookups
        want = cached_length(before, req.fill_ids, req.fill_len - 1)
        hit_slots = [before[tuple(req.fill_ids[: i + 1])] for i in range(want)]
        blocks = whole_pages(hit_slots, self.pool.page_size)
        need = self.pool.pages_for(req.fill_len) - sum(b is not None for b in blocks) + reserve
        if not kv.seat(req, reserve):
            self.refused += 1
            assert req.pages == [] and req.hit is None and req.kv_len == 0
            assert kv.pages.available < need, "refused though the pages were there"
            assert kv.prefix.tree.locked_tokens == locked, "a refused admission left a lock"
            assert kv.prefix.lookups == lookups
            now = paths(kv.prefix.tree)
            assert all(before.get(k) == s for k, s in now.items()), "refusal cached something"
            assert set(free) <= set(kv.pages._free), "refusal took a page"
            if evictable == 0:
                # NOTE: the pool may have grown first (room() does), new pages all free
                size = len(refs) - 1
                assert sorted(p for p in kv.pages._free if p <= size) == sorted(free)
                assert kv.pages._refs[: size + 1] == refs and not any(kv.pages._refs[size + 1 :])
            self.waiting.append(req)
            return
        self.admitted += 1
        assert req.hit is not None and req.hit.length == want, "not the longest cached prefix"
        assert req.kv_len == req.prefilled == want
        if req.preemptions == 0:
            assert req.cached_tokens == want
        assert len(req.pages) == self.pool.pages_for(req.fill_len)
        assert kv.pages.available >= reserve, "admitted into the decode reserve"
        for k, page in enumerate(req.pages):
            shared = blocks[k] if k < len(blocks) else None
            if shared is not None:
                assert page == shared, "a whole cached page copied, not shared"
            else:
                assert kv.pages.refs(page) == 1, "a page to write is not the request's own"
        self.running.append(req)

    def compute(self) -> None:
        todo = [r for r in self.running if r.kv_len < r.fill_len]
        if todo:
            req = self.rng.choice(todo)
            end = self.rng.randint(req.kv_len + 1, req.fill_len)
            compute(self.kv, self.pool, self.running, req, end)

    def publish(self) -> None:
        todo = [r for r in self.running if r.kv_len >= r.fill_len - 1]
        if not todo:
            return
        req = self.rng.choice(todo)
        self.kv.publish(req)
        body = req.fill_ids[: req.fill_len - 1]
        assert req.hit is not None and req.hit.length == len(body)
        assert cached_length(paths(self.kv.prefix.tree), body, len(body)) == len(body)

    def decode(self) -> None:
        todo = [r for r in self.running if r.kv_len == len(seq(r)) and len(r.output_ids) < MAX_OUT]
        if not todo:
            return
        req, kv = self.rng.choice(todo), self.kv
        evict = self.rng.random() < 0.7
        held = len(req.pages)
        if kv.grow(req, evict=evict):
            assert len(req.pages) == max(held, self.pool.pages_for(req.kv_len + 1))
            req.output_ids.append(self.rng.randrange(6))  # the token sampled at kv_len - 1
            compute(kv, self.pool, self.running, req, req.kv_len + 1)
            return
        assert len(req.pages) == held and kv.pages.available == 0
        if evict:
            assert kv.prefix.tree.evictable_tokens == 0, "out of pages with spans to evict"
        if self.rng.random() < 0.5:
            self.release(req, "preempt")

    def release(self, req: Req | None = None, kind: str | None = None) -> None:
        if req is None:
            if not self.running:
                return
            req = self.rng.choice(self.running)
        kind = kind or self.rng.choice(["stop", "abort", "error", "preempt"])
        kv = self.kv
        before = paths(kv.prefix.tree)
        tokens = seq(req)[: req.kv_len]
        if kind != "preempt":
            req.finish_reason = kind  # type: ignore[assignment]
        kv.release(req)
        self.running.remove(req)
        assert req.pages == [] and req.hit is None
        now = paths(kv.prefix.tree)
        if kind == "error":
            assert now == before, "an errored request's KV was cached"
        else:
            assert cached_length(now, tokens, len(tokens)) == len(tokens), "not cached"
        if kind == "preempt":
            req.preempt()
            self.waiting.append(req)

    def evict(self) -> None:
        kv = self.kv
        n = self.rng.randint(1, kv.pages.size)
        before = paths(kv.prefix.tree)
        kv.prefix.evict(n)
        assert kv.pages.available >= n or kv.prefix.tree.evictable_tokens == 0
        assert all(before.get(k) == s for k, s in paths(kv.prefix.tree).items())

    def shrink(self) -> None:
        """The idle pool shrinks: nothing cached is evicted, nothing in use is lost (`check`)."""
        kv = self.kv
        before = paths(kv.prefix.tree)
        size = kv.pages.size
        released = kv.shrink()
        assert kv.pages.size == self.pool.pages == size - released
        assert paths(kv.prefix.tree) == before, "a shrink evicted or moved cached tokens"
        assert kv.pages.highest_in_use() <= kv.pages.size

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.25 and len(self.running) < MAX_RUNNING:
            self.admit()
        elif op < 0.5:
            self.compute()
        elif op < 0.6:
            self.publish()
        elif op < 0.8:
            self.decode()
        elif op < 0.92:
            self.release()
        elif op < 0.96:
            self.evict()
        else:
            self.shrink()


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_random_interleavings(seed: int, page_size: int) -> None:
    walk = Walk(seed, page_size)
    kv, pool = walk.kv, walk.pool
    prev = check(kv, pool, walk.running)
    for _ in range(350):
        walk.step()
        now = check(kv, pool, walk.running)
        for prefix, slot in prev.items():
            if prefix in now:
                assert now[prefix] == slot, "a cached prefix moved to another slot"
        prev = now
    assert walk.admitted > 5, "the walk admitted almost nothing"
    assert kv.prefix.lookups == walk.admitted, "a refused admission counted as a lookup"
    while walk.running:
        walk.release(walk.running[0], "stop")
        check(kv, pool, walk.running)
    assert kv.prefix.tree.locked_tokens == 0
    kv.prefix.evict(kv.pages.size)
    assert kv.prefix.tree.total_tokens == 0
    assert all(kv.pages.refs(pg) == 0 for pg in range(1, kv.pages.size + 1))
    assert sorted(kv.pages._free) == list(range(1, kv.pages.size + 1))


def test_the_walk_reaches_the_interesting_cases() -> None:
    """The random walk shares pages (straddled ones too: two requests wrote them), copies
    partial ones, refuses and preempts."""
    seen: Counter[str] = Counter()
    for page_size in (2, 4):
        for seed in range(6):
            walk = Walk(seed, page_size)
            admit = walk.admit

            def counted(walk: Walk = walk, admit=admit) -> None:
                n = len(walk.running)
                admit()
                if len(walk.running) > n:
                    req, p = walk.running[-1], walk.pool.page_size
                    blocks = walk.kv.prefix.layout(req.hit)
                    seen["shared"] += sum(isinstance(b, int) for b in blocks)
                    seen["partial"] += sum(isinstance(b, list) and len(b) < p for b in blocks)
                    slots = req.hit.slots
                    pages = [{s // p for s in slots[k : k + p]} for k in range(0, len(slots), p)]
                    seen["straddled"] += sum(
                        isinstance(b, int) and len(pages[k]) > 1 for k, b in enumerate(blocks)
                    )
                else:
                    seen["refused"] += 1

            walk.admit = counted  # type: ignore[method-assign]
            shrink = walk.shrink

            def shrunk(walk: Walk = walk, shrink=shrink) -> None:
                size = walk.kv.pages.size
                shrink()
                seen["shrunk"] += walk.kv.pages.size < size

            walk.shrink = shrunk  # type: ignore[method-assign]
            for _ in range(350):
                walk.step()
            seen["preempted"] += sum(r.preemptions for r in walk.waiting + walk.running)
    wanted = ("shared", "partial", "straddled", "refused", "preempted", "shrunk")
    assert all(seen[k] > 0 for k in wanted), seen


# -- targeted cases -----------------------------------------------------------------------------
A10 = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4]  # ten tokens: two full pages of four and half a third


def _run_and_retire(kv: KVManager, pool: FakePool, tokens: list[int]) -> Req:
    req = make_req("a", tokens)
    assert kv.seat(req, reserve=0)
    compute(kv, pool, [req], req, len(tokens))
    kv.release(req)
    return req


@pytest.mark.parametrize("extra", [[], [3, 5, 9]])
def test_a_partly_filled_page_is_copied_on_write(extra: list[int]) -> None:
    kv, pool = make_manager(8, 4)
    a = make_req("a", A10)
    assert kv.seat(a, reserve=0)
    compute(kv, pool, [a], a, 10)
    a_pages = list(a.pages)
    kv.release(a)
    cached = check(kv, pool, [])
    assert len(cached) == 10 and kv.pages.refs(a_pages[2]) == 2  # positions 8, 9 of its third page

    b = make_req("b", A10 + extra)
    assert kv.seat(b, reserve=0)
    hit = 10 if extra else 9  # NOTE: the last prompt token is always computed
    assert b.hit is not None and b.hit.length == b.kv_len == hit
    assert b.pages[:2] == a_pages[:2], "the two full pages are shared, not copied"
    assert b.pages[2] not in a_pages, "the partly filled page is the request's own"
    assert kv.pages.refs(a_pages[0]) == kv.pages.refs(a_pages[1]) == 4 + 1
    assert kv.pages.refs(a_pages[2]) == 2 and kv.pages.refs(b.pages[2]) == 1
    third = [pool.data[b.pages[2] * 4 + i] for i in range(hit - 8)]
    assert third == [tuple(A10[: 9 + i]) for i in range(hit - 8)], "the partial page not copied"
    check(kv, pool, [b])

    compute(kv, pool, [b], b, b.fill_len)
    assert kv.grow(b)
    b.output_ids.append(6)
    compute(kv, pool, [b], b, b.kv_len + 1)
    now = check(kv, pool, [b])
    assert {k: now[k] for k in cached} == cached, "b moved what the tree holds for a"
    kv.release(b)
    check(kv, pool, [])


def test_a_straddled_page_is_shared_from_its_last_writer() -> None:
    """A full page whose positions two requests wrote (one's hit ended inside it) is shared
    whole: the later writer's page holds every position of it (`PrefixCache.layout`)."""
    kv, pool = make_manager(12, 4)
    x = [5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 0, 2]
    _run_and_retire(kv, pool, x[:6])  # its second page holds positions 4, 5 of `x`
    b = make_req("b", x[:10])
    assert kv.seat(b, reserve=0) and b.kv_len == 6  # copies 4, 5 into its own page, writes 6+
    compute(kv, pool, [b], b, 10)
    kv.release(b)
    cached = check(kv, pool, [])
    block = [cached[tuple(x[: i + 1])] for i in range(4, 8)]
    assert len({s // 4 for s in block}) == 2, "positions 4..7 come from two requests' pages"

    c = make_req("c", x)
    assert kv.seat(c, reserve=0) and c.kv_len == 10
    layout = kv.prefix.layout(c.hit)
    assert isinstance(layout[0], int) and isinstance(layout[1], int) and len(layout[2]) == 2
    assert c.pages[0] == cached[(x[0],)] // 4, "the whole first page is shared"
    assert c.pages[1] == block[-1] // 4, "the straddled page is b's, which wrote it last"
    assert kv.pages.refs(c.pages[1]) >= 2, "shared: the tree and c"
    check(kv, pool, [c])
    compute(kv, pool, [c], c, c.fill_len)
    assert {k: s for k, s in check(kv, pool, [c]).items() if k in cached} == cached
    kv.release(c)


def test_layout_shares_only_whole_aligned_pages() -> None:
    """Through the manager every cached token sits at its position's page offset; a hit handed
    to `layout` directly shows a run off its offsets is copied, not shared, and a full page of
    two writers is the last writer's."""
    kv, _ = make_manager(8, 4)
    root = kv.prefix.tree.root
    aligned = kv.prefix.layout(Hit(6, [8, 9, 10, 11, 12, 13], root))
    assert aligned == [2, [12, 13]]
    assert kv.prefix.layout(Hit(4, [2, 3, 4, 5], root)) == [[2, 3, 4, 5]]
    assert kv.prefix.layout(Hit(4, [8, 9, 14, 15], root)) == [3]
    assert kv.prefix.layout(Hit(4, [8, 9, 15, 14], root)) == [[8, 9, 15, 14]]


@pytest.mark.parametrize("reason", ["stop", "error"])
def test_releasing_a_request_twice_raises(reason: str) -> None:
    kv, pool = make_manager(8, 4)
    req = make_req("a", A10)
    assert kv.seat(req, reserve=0)
    compute(kv, pool, [req], req, 10)
    req.finish_reason = reason  # type: ignore[assignment]
    kv.release(req)
    with pytest.raises(RuntimeError):
        kv.release(req)


def test_a_page_table_or_hit_released_twice_raises() -> None:
    kv, pool = make_manager(8, 4)
    req = make_req("a", A10)
    assert kv.seat(req, reserve=0)
    pages, hit = list(req.pages), req.hit
    compute(kv, pool, [req], req, 10)
    req.finish_reason = "error"  # nothing cached: every page of its table is free again
    kv.release(req)
    assert sorted(kv.pages._free) == list(range(1, 9))
    with pytest.raises(RuntimeError):
        kv.pages.release(pages)
    req.hit = hit
    with pytest.raises(RuntimeError):
        kv.prefix.retire(req, None)
    assert kv.prefix.tree.locked_tokens == 0
    alloc = PageAllocator(2, 4)
    got = alloc.alloc(1)
    alloc.release(got)
    with pytest.raises(RuntimeError):
        alloc.release(got)


def _state(kv: KVManager) -> tuple:
    """Free pages, counts, cached paths and each cached token's lock count (a node split by a
    lookup is the same state)."""
    tree, locks = kv.prefix.tree, {}
    stack: list[tuple[Node, tuple[int, ...]]] = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok in child.tokens:
                p = (*p, tok)
                locks[p] = child.ref
            stack.append((child, p))
    return (sorted(kv.pages._free), list(kv.pages._refs), paths(tree), tree.locked_tokens, locks)


def test_a_refused_admission_changes_nothing_when_nothing_is_evictable() -> None:
    kv, pool = make_manager(4, 4)
    a = make_req("a", A10)  # three pages, running, its prompt published
    assert kv.seat(a, reserve=0)
    compute(kv, pool, [a], a, 10)
    kv.publish(a)
    before, lookups = _state(kv), kv.prefix.lookups
    b = make_req("b", A10[:8] + [0] * 8)  # hits 8 tokens (two shared pages), needs two more
    assert not kv.seat(b, reserve=0)
    assert b.pages == [] and b.hit is None
    assert _state(kv) == before and kv.prefix.lookups == lookups
    check(kv, pool, [a])
    assert kv.seat(make_req("c", A10[:8] + [0]), reserve=0), "one page more fits"


def test_a_refused_admission_keeps_the_cache() -> None:
    """An admission that cannot fit even after evicting everything leaves the cache as it was."""
    kv, pool = make_manager(4, 4)
    a = make_req("a", [1] * 8)  # two pages, running
    assert kv.seat(a, reserve=0)
    compute(kv, pool, [a], a, 8)
    _run_and_retire(kv, pool, [2] * 4)  # one page, cached, nobody runs on it
    before = _state(kv)
    assert kv.pages.available == 1 and kv.prefix.tree.evictable_tokens == 4
    b = make_req("b", [3] * 12)  # three pages: more than free + evictable
    assert not kv.seat(b, reserve=0)
    check(kv, pool, [a])
    assert _state(kv) == before, "a refused admission evicted the cache for nothing"


def test_free_pages_go_out_lowest_first() -> None:
    """Whatever order pages come back in, the lowest free ones go out first: runs stay
    ascending and the pool's tail stays free, so an idle pool can shrink."""
    alloc = PageAllocator(8, 4)
    a, b = alloc.alloc(4), alloc.alloc(4)
    assert a == [1, 2, 3, 4] and b == [5, 6, 7, 8]
    alloc.release(a)
    alloc.release(b)  # NOTE: a stack would hand b's pages out next
    assert alloc.alloc(3) == [1, 2, 3]
    alloc.decref(2)
    alloc.add(4)
    assert alloc.alloc(3) == [2, 4, 5]
    assert alloc.highest_in_use() == 5


def test_a_shrink_keeps_every_page_in_use_and_the_cache() -> None:
    """An idle pool shrinks to the growth step that holds its highest page in use, whether a
    running request or the prefix cache holds it; no cached token is evicted for it."""
    kv, pool = make_manager(2, 4, capacity=32)
    _run_and_retire(kv, pool, A10)  # NOTE: pages 1-3, cached
    burst = [make_req(f"b{i}", [9, i, *A10]) for i in range(4)]
    for req in burst:
        assert kv.seat(req, reserve=0)
    assert pool.pages == 16
    for req in burst[:3]:
        req.finish_reason = "abort"
        kv.release(req)
    kv.flush()  # NOTE: only the cache's own pages go; burst[3] still runs on its pages
    highest = max(burst[3].pages)
    assert kv.shrink() == 0 and highest > 8, "the running request's pages hold the pool"
    kv.release(burst[3])
    kv.prefix.evict(kv.pages.size)
    _run_and_retire(kv, pool, A10)
    cached = check(kv, pool, [])
    assert {s // 4 for s in cached.values()} == {1, 2, 3}, "not the lowest free pages"
    assert kv.shrink() == 16 - 4 and pool.pages == kv.pages.size == 4
    assert check(kv, pool, []) == cached, "the shrink lost a cached token"
    with pytest.raises(RuntimeError, match="in use"):
        kv.pages.shrink(2)


def test_a_shrink_stops_at_a_growth_step() -> None:
    assert [growth_size(n, 4, 50) for n in (0, 4, 5, 9, 16, 17, 33, 60)] == [
        4,
        4,
        8,
        16,
        16,
        32,
        50,
        50,
    ]


def test_decode_rows_are_grouped_by_length_only_where_it_saves_reads():
    """One long row among short ones reads alone; rows of like lengths stay one batch; a split
    saving under a quarter of the keys read is not made (each group costs a gather and a call)."""
    assert length_groups([200] * 15 + [7000]) == [[15], list(range(15))]
    assert length_groups([900, 1000, 1200, 1800]) is None
    assert length_groups([1000, 450, 1000, 1000]) is None  # NOTE: would save 14 % of the reads
    assert length_groups([4000, 1900, 900, 1]) == [[0], [1], [2], [3]]
