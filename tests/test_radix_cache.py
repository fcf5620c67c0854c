"""The radix tree alone: splits keep references, locked nodes survive eviction, LRU order.

The paged prefix cache over it (pages, references, copy-on-write) has its randomised model-based
test in tests/test_kv_pages.py.
"""

from __future__ import annotations

import random

import pytest

from scheduler_proc.prefix_cache import PendingPrompts, common_prefix
from scheduler_proc.radix_cache import RadixCache


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


def test_common_prefix_and_pending_share() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        naive = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert common_prefix(a, b) == naive
    assert PendingPrompts([[2], [1] * 80]).longest_shared([1] * 100) == 80
    assert PendingPrompts().longest_shared([1] * 100) == 0


def test_pending_prompts_find_the_longest_shared_prefix_of_any() -> None:
    """The two sorted neighbours' answer is the longest over all pending prompts, as they are
    added one by one (a seating pass adds each prompt it seats)."""
    rng = random.Random(1)
    for _ in range(100):
        base = [rng.randrange(3) for _ in range(8)]
        prompts = [
            base[: rng.randint(0, 8)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
            for _ in range(rng.randint(0, 12))
        ]
        pending = PendingPrompts(prompts[: len(prompts) // 2])
        for p in prompts[len(prompts) // 2 :]:
            pending.add(p)
        for _ in range(10):
            q = base[: rng.randint(0, 8)] + [rng.randrange(3) for _ in range(rng.randint(0, 6))]
            want = max((common_prefix(q, p) for p in prompts), default=0)
            assert pending.longest_shared(q) == want
