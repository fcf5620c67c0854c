"""Prompt-chunk attention by MLX's ops (`prefill_attention`) against MLX's own attention."""

from __future__ import annotations

import mlx.core as mx
import pytest

from scheduler_proc import prefill_attention
from scheduler_proc.kv_cache import ragged_mask

pytestmark = pytest.mark.timeout(120)


def _case(rows: int, heads: int, kv_heads: int, width: int, keys: int, seed: int = 0):
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((rows, heads, width, 16), key=kq)
    k = mx.random.normal((rows, kv_heads, keys, 16), key=kk)
    v = mx.random.normal((rows, kv_heads, keys, 16), key=kv)
    return q, k, v


def _close(got: mx.array, want: mx.array) -> bool:
    return mx.allclose(got, want, atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("window", [None, 5])
def test_a_ragged_chunk_matches_mlx_attention(heads, kv_heads, window):
    """Rows at different positions (the scheduler's ragged mask, with and without a window)."""
    q, k, v = _case(3, heads, kv_heads, 4, 24)
    mask = ragged_mask(mx.array([0, 7, 20]), 4, 24, window)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert _close(prefill_attention.attention(q, k, v, 0.3, mask), want)


def test_additive_and_per_head_masks_match_mlx_attention():
    q, k, v = _case(2, 4, 2, 3, 10, seed=1)
    keep = ragged_mask(mx.array([2, 7]), 3, 10, None)
    additive = mx.where(keep, 0.0, -1e9)
    per_head = mx.broadcast_to(keep, (2, 4, 3, 10)) & (mx.arange(4)[None, :, None, None] != 1)
    per_head = per_head | (mx.arange(10) == 0)  # NOTE: every query sees a key
    for mask in (additive, per_head, keep[0, 0]):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
        assert _close(prefill_attention.attention(q, k, v, 0.5, mask), want)


def test_auto_is_ops_only_on_cuda():
    cuda = mx.cuda.is_available() and mx.default_device() == mx.gpu
    assert prefill_attention.by_ops("auto") is cuda
    assert prefill_attention.by_ops("ops") and not prefill_attention.by_ops("fast")
