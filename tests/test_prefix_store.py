"""The prefix store's two copies, row -> store and store -> row, on real MLX buffers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.memory import DeviceMemory, kv_budget
from scheduler_proc.kv_cache import KVPool, LayerShape
from scheduler_proc.prefix_store import PrefixStore

SHAPES = [LayerShape(2, 4, 3, mx.float32), LayerShape(1, 4, 4, mx.float32)]


def _fill(pool: KVPool, row: int, n: int, seed: int) -> list[tuple[mx.array, mx.array]]:
    mx.random.seed(seed)
    kv = [
        (
            mx.random.normal((1, s.kv_heads, n, s.k_dim)),
            mx.random.normal((1, s.kv_heads, n, s.v_dim)),
        )
        for s in SHAPES
    ]
    pool.write_row(row, kv)
    return kv


@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_save_then_load_round_trips(scattered: bool) -> None:
    pool, store = KVPool(SHAPES, rows=3, row_len=16), PrefixStore(SHAPES, size=32)
    if scattered:
        store.slots.alloc(5)  # NOTE: later frees leave holes, so slots are not one run
        store.slots.free([1, 3])
    kv = _fill(pool, 1, 12, seed=0)
    first = store.slots.alloc(5)
    store.save(pool, 1, 0, first)
    rest = store.slots.alloc(7)
    store.save(pool, 1, 5, rest)
    assert (first + rest != list(range(first[0], first[0] + 12))) == scattered
    store.load(pool, 2, first + rest)
    for (k, v), got in zip(kv, pool.read_row(2, 12), strict=True):
        assert mx.array_equal(got[0], k) and mx.array_equal(got[1], v)


def test_load_leaves_other_rows_alone() -> None:
    pool, store = KVPool(SHAPES, rows=2, row_len=8), PrefixStore(SHAPES, size=8)
    _fill(pool, 0, 8, seed=1)
    before = pool.read_row(0, 8)
    slots = store.slots.alloc(4)
    store.save(pool, 0, 2, slots)
    store.load(pool, 1, slots)
    for (k, v), (k1, v1) in zip(before, pool.read_row(0, 8), strict=True):
        assert mx.array_equal(k, k1) and mx.array_equal(v, v1)
    for (k, v), got in zip(before, pool.read_row(1, 4), strict=True):
        assert mx.array_equal(got[0], k[:, :, 2:6]) and mx.array_equal(got[1], v[:, :, 2:6])


def test_budget_from_device_memory() -> None:
    gib = 2**30
    dev = DeviceMemory("metal", 16 * gib, "test")
    budget = kv_budget(0, 0.5, bytes_per_token=1024, weights=4 * gib, device=dev)
    assert budget.tokens == 6 * gib // 1024
    assert kv_budget(1000, 0.5, 1024, 4 * gib, dev).tokens == 1000
    assert kv_budget(0, 0.5, 1024, 32 * gib, dev).tokens == 0  # weights beyond the device
    assert "tokens" in budget.describe()
