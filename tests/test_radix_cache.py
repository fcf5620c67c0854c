"""Randomised model-based tests of the radix prefix cache, with invariants after every step.

A fake store and fake pool hold plain Python values instead of MLX arrays: the "KV" of position p
of a sequence is a function of the sequence's first p + 1 tokens, as real KV is, so a wrong slot,
a stale slot or a copy at the wrong offset shows up as a wrong value.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from scheduler_proc.prefix_cache import PrefixCache, common_prefix, shares_pending_prefix
from scheduler_proc.prefix_store import SlotAllocator
from scheduler_proc.radix_cache import Hit, Node, RadixCache


def kv(prefix: tuple[int, ...]) -> int:
    return hash(prefix)


class FakePool:
    def __init__(self) -> None:
        self.rows: dict[int, list[int | None]] = {}


class FakeStore:
    """PrefixStore's interface over a dict; `load` / `save` copy values like the real one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots = SlotAllocator(size)
        self.data: dict[int, int] = {}

    def load(self, pool: FakePool, row: int, slots: list[int]) -> None:
        pool.rows[row][: len(slots)] = [self.data[s] for s in slots]

    def save(
        self, pool: FakePool, row: int, start: int, slots: list[int], row_end: int | None = None
    ) -> None:
        for i, s in enumerate(slots):
            value = pool.rows[row][start + i]
            assert value is not None, "saved a position that was never computed"
            self.data[s] = value


@dataclass
class Running:
    tokens: list[int]
    hit: Hit
    row: int


# -- the tree's own invariants ------------------------------------------------------------------
def paths(tree: RadixCache) -> dict[tuple[int, ...], tuple[int, Node]]:
    """Every cached prefix -> (its last token's slot, the node holding it)."""
    out: dict[tuple[int, ...], tuple[int, Node]] = {}
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.tokens and child.tokens[0] == first, "child keyed by its first token"
            assert len(child.tokens) == len(child.slots), "one slot per token"
            assert child.parent is node
            if node is not tree.root:
                assert child.last_used <= node.last_used, "a parent aged before its child"
            p = prefix
            for tok, slot in zip(child.tokens, child.slots, strict=True):
                p = (*p, tok)
                out[p] = (slot, child)
            stack.append((child, p))
    return out


def check(cache: PrefixCache, running: list[Running], store: FakeStore) -> dict:
    tree = cache.tree
    cached = paths(tree)
    slots = [slot for slot, _ in cached.values()]
    assert len(slots) == len(set(slots)), "a slot owned by two nodes"
    assert tree.total_tokens == len(slots) == store.slots.in_use, "KV slot leaked"
    assert store.slots.in_use <= store.size, "budget exceeded"
    assert {s for s in range(store.size) if store.slots._used[s]} == set(slots)
    for prefix, (slot, _) in cached.items():
        assert store.data[slot] == kv(prefix), "cached KV does not belong to its prefix"
    nodes = list(tree.nodes())
    for node in nodes:
        holders = [r for r in running if _on_path(node, r.hit.node, tree.root)]
        assert node.ref == len(holders), "reference count differs from the locks held"
    assert tree.locked_tokens == sum(len(n) for n in nodes if n.ref > 0)
    return {p: s for p, (s, _) in cached.items()}


def _on_path(node: Node, leaf: Node, root: Node) -> bool:
    while leaf is not root:
        if leaf is node:
            return True
        leaf = leaf.parent
    return False


# -- the random walk ----------------------------------------------------------------------------
def _random_tokens(rng: random.Random, bases: list[list[int]]) -> list[int]:
    """Sequences that share prefixes often: a base, cut somewhere, plus a random tail."""
    base = rng.choice(bases)
    head = base[: rng.randint(0, len(base))]
    return head + [rng.randrange(6) for _ in range(rng.randint(1 if not head else 0, 12))]


def _compute(pool: FakePool, row: int, tokens: list[int], start: int, end: int) -> None:
    for p in range(start, end):
        pool.rows[row][p] = kv(tuple(tokens[: p + 1]))


def _admit(cache, store, pool, running, rng, bases, next_row) -> None:
    tokens = _random_tokens(rng, bases)
    before = paths(cache.tree)
    want = max((len(p) for p in before if list(p) == tokens[: len(p)]), default=0)
    want = min(want, len(tokens) - 1)
    hit = cache.acquire(tokens, len(tokens) - 1)
    assert hit.length == want, "not the longest cached prefix"
    pool.rows[next_row] = [None] * 64
    cache.load(hit, next_row)
    for p in range(hit.length):
        assert pool.rows[next_row][p] == kv(tuple(tokens[: p + 1])), "loaded the wrong KV"
    running.append(Running(tokens, hit, next_row))


def _retire(cache, store, pool, running, rng) -> None:
    """Finish (prompt + some output computed), abort mid-prefill, or abort before any compute."""
    r = running.pop(rng.randrange(len(running)))
    kind = rng.choice(["finish", "abort", "abort_early"])
    if kind == "abort_early":
        cache.release(r.hit, r.tokens, None)
        return
    seq = r.tokens + [rng.randrange(6) for _ in range(rng.randint(0, 6))]
    end = len(seq) if kind == "finish" else rng.randint(r.hit.length, len(r.tokens))
    _compute(pool, r.row, seq, r.hit.length, end)
    room = store.slots.available + cache.tree.evictable_tokens
    cache.release(r.hit, seq[:end], r.row)
    cached = paths(cache.tree)
    stored = max((len(p) for p in cached if list(p) == seq[: len(p)]), default=0)
    if room >= end:
        assert stored >= end, "had room but did not cache the whole sequence"


def _publish(cache, pool, running, rng) -> None:
    """Prefill done: the prompt is cached while the request keeps running, its lock moves."""
    r = rng.choice(running)
    _compute(pool, r.row, r.tokens, r.hit.length, len(r.tokens))
    before = r.hit.length
    cache.extend(r.hit, r.tokens, r.row)
    assert r.hit.length >= before
    assert r.hit.length == max(
        len(p) for p in [()] + list(paths(cache.tree)) if list(p) == r.tokens[: len(p)]
    )


def _evict(cache, store, rng) -> None:
    """Explicit eviction: only unlocked leaves go, least recently used first."""
    ages = {id(n): n.last_used for n in cache.tree.nodes()}
    evictable = cache.tree.evictable_tokens
    want = rng.randint(1, 20)
    freed = cache.tree.evict(want)
    assert len(freed) >= min(want, evictable), "evicted less than asked though it could"
    store.slots.free(freed)
    left = {id(n) for n in cache.tree.nodes()}
    gone = [age for nid, age in ages.items() if nid not in left]
    kept = [n.last_used for n in cache.tree.nodes() if not n.children and n.ref == 0]
    if gone and kept:
        assert max(gone) <= min(kept), "evicted a more recently used leaf first"


@pytest.mark.parametrize("seed", range(12))
def test_random_interleavings(seed: int) -> None:
    rng = random.Random(seed)
    store = FakeStore(size=rng.choice([8, 24, 64, 256]))
    pool, running = FakePool(), []
    cache = PrefixCache(store, pool)
    bases = [[rng.randrange(6) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    prev = check(cache, running, store)
    for step in range(400):
        op = rng.random()
        if op < 0.4 and len(running) < 6:
            _admit(cache, store, pool, running, rng, bases, step)
        elif op < 0.5 and running:
            _publish(cache, pool, running, rng)
        elif op < 0.9 and running:
            _retire(cache, store, pool, running, rng)
        else:
            _evict(cache, store, rng)
        now = check(cache, running, store)
        for prefix, slot in prev.items():
            if prefix in now:
                assert now[prefix] == slot, "a cached prefix moved to another slot"
        prev = now
    while running:
        _retire(cache, store, pool, running, rng)
    check(cache, running, store)
    assert cache.tree.locked_tokens == 0
    store.slots.free(cache.tree.evict(store.size))
    assert cache.tree.total_tokens == 0 and store.slots.in_use == 0


# -- targeted cases -----------------------------------------------------------------------------
def test_split_keeps_references_and_locked_nodes_survive_eviction() -> None:
    tree = RadixCache()
    assert tree.insert([1, 2, 3, 4], [10, 11, 12, 13]) == 0
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m.node)
    assert tree.insert([1, 2, 9], [20, 21, 22]) == 2  # splits the locked node after two tokens
    assert tree.locked_tokens == 4
    assert sorted(tree.evict(100)) == [22]  # only the unlocked branch can go
    tree.unlock(m.node)
    assert sorted(tree.evict(100)) == [10, 11, 12, 13]
    with pytest.raises(RuntimeError):
        tree.unlock(m.node)


def test_least_recently_used_goes_first() -> None:
    tree = RadixCache()
    tree.insert([1, 1], [0, 1])
    tree.insert([2, 2], [2, 3])
    tree.insert([3, 3], [4, 5])
    tree.match_prefix([1, 1])  # now [2, 2] is the oldest
    assert tree.evict(1) == [2, 3]
    assert tree.evict(1) == [4, 5]


def test_hit_equal_to_whole_prompt_leaves_the_last_token() -> None:
    store = FakeStore(16)
    pool = FakePool()
    cache = PrefixCache(store, pool)
    pool.rows[0] = [None] * 16
    _compute(pool, 0, [5, 6, 7], 0, 3)
    cache.release(cache.acquire([5, 6, 7], 2), [5, 6, 7], 0)
    hit = cache.acquire([5, 6, 7], 2)
    assert hit.length == 2
    cache.release(hit, [5, 6, 7], None)
    with pytest.raises(RuntimeError):
        cache.release(hit, [5, 6, 7], None)


def test_double_free_is_caught() -> None:
    slots = SlotAllocator(4)
    got = slots.alloc(2)
    slots.free(got)
    with pytest.raises(RuntimeError):
        slots.free(got[:1])


def test_common_prefix_and_pending_share() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        naive = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix(a, b) == naive
    assert shares_pending_prefix([1] * 100, 10, [[2], [1] * 80], min_tokens=70)
    assert not shares_pending_prefix([1] * 100, 11, [[2], [1] * 80], min_tokens=70)
