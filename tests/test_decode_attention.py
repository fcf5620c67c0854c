"""The fused decode attention: rows of different lengths over whole pool buffers, no mask.

The kernel runs on CUDA only (checked there against MLX's attention over each row's own keys);
its masked twin and the plumbing (whole buffers, row lengths, the model's attention rebound, the
start-up check) run everywhere. Greedy parity through it: tests/test_scheduler_parity.py.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm.models.llama as llama_module
import pytest
from scheduler_util import make_scheduler, tiny_model

from scheduler_proc import decode_attention

CUDA = decode_attention.available()


def _rows(heads: int, kv_heads: int, dim: int, lengths: list[int], dtype, l_max: int = 1100):
    mx.random.seed(0)
    b = len(lengths)
    q = mx.random.normal((b, heads, 1, dim)).astype(dtype)
    # NOTE: one more pool row than the step reads, as the pool's scratch row
    k = mx.random.normal((b + 1, kv_heads, l_max, dim)).astype(dtype)
    v = mx.random.normal((b + 1, kv_heads, l_max, dim)).astype(dtype)
    return q, k, v, mx.array(lengths, dtype=mx.int32)


def _each_row(q, k, v, lengths: list[int], scale: float) -> list[mx.array | None]:
    """MLX's own attention over exactly row b's first lengths[b] keys (None: a pad row)."""
    return [
        None
        if n == 0
        else mx.fast.scaled_dot_product_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], scale=scale
        )
        for b, n in enumerate(lengths)
    ]


def _assert_rows_match(out, want, tol: float) -> None:
    assert not mx.any(mx.isnan(out)).item()
    for b, w in enumerate(want):
        if w is not None:
            got = out[b : b + 1].astype(mx.float32)
            assert mx.allclose(got, w.astype(mx.float32), atol=tol, rtol=tol).item(), b


LENGTHS = [1, 0, 127, 128, 129, 600, 1000, 2, 1100]


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 32), (6, 2, 128)])
def test_the_masked_twin_attends_to_each_rows_own_keys(heads, kv_heads, dim):
    q, k, v, lengths = _rows(heads, kv_heads, dim, LENGTHS, mx.float32)
    out = decode_attention._masked(q, k, v, lengths, 0.125)
    _assert_rows_match(out, _each_row(q, k, v, LENGTHS, 0.125), 1e-5)


@pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend")
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(32, 8, 64), (16, 16, 128), (8, 1, 256), (9, 3, 64)]
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_attends_to_each_rows_own_keys(heads, kv_heads, dim, dtype):
    """Few rows: each row's keys split across blocks and merged (rows of 0 to 1100 keys, so
    some splits get no key)."""
    _check_kernel(heads, kv_heads, dim, dtype, splits=None)


@pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend")
@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "three"])
def test_the_kernel_in_one_pass_or_an_odd_split(splits):
    _check_kernel(32, 8, 64, mx.bfloat16, splits)


def _check_kernel(heads: int, kv_heads: int, dim: int, dtype, splits: int | None) -> None:
    q, k, v, lengths = _rows(heads, kv_heads, dim, LENGTHS, dtype)
    if splits is None:
        assert decode_attention.split_count(len(LENGTHS) * kv_heads, max(LENGTHS)) > 1
    out = decode_attention.decode_attention(q, k, v, lengths, dim**-0.5, splits=splits)
    # NOTE: MLX's float32 attention on CUDA multiplies in TF32: the reference is the coarse one.
    tol = 2e-3 if dtype == mx.float32 else 2e-2
    _assert_rows_match(out, _each_row(q, k, v, LENGTHS, dim**-0.5), tol)
    assert not mx.any(out[1] != 0).item()  # NOTE: a pad row gives zeros


def test_few_rows_split_their_keys_across_blocks():
    """Enough blocks to fill a large GPU, never a split without a whole tile of keys."""
    assert decode_attention.split_count(blocks=512, max_len=4096) == 1
    assert decode_attention.split_count(blocks=16, max_len=4096) == 16
    assert decode_attention.split_count(blocks=8, max_len=4096) == 32
    assert decode_attention.split_count(blocks=16, max_len=1100) == 8
    # NOTE: short rows run in one pass whatever the row count: the merge would cost more
    assert decode_attention.split_count(blocks=8, max_len=600) == 1


def test_a_model_whose_attention_is_not_mlx_lms_keeps_the_mask(tiny_weights_dir, monkeypatch):
    """The start-up check: a layer that bypasses the rebound name would read whole buffers
    unmasked, so the runner keeps the masked path for such a model."""
    model = tiny_model(tiny_weights_dir)

    def own_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    monkeypatch.setattr(llama_module, "scaled_dot_product_attention", own_attention)
    assert make_scheduler(model, fused_decode="on").runner.fused_decode is False
    monkeypatch.undo()
    assert make_scheduler(model, fused_decode="on").runner.fused_decode is True
    assert make_scheduler(model, fused_decode="off").runner.fused_decode is False
