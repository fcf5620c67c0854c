"""Prompt-chunk attention from MLX's ops: no per-shape build on CUDA, bf16 scores.

A prefill forward pads rows of different lengths to one width, so its attention takes a mask.
On MLX's CUDA backend, `mx.fast.scaled_dot_product_attention` with an array mask builds for each
new (rows, width, keys) shape (H200, 32/8 heads, dim 64: 51-88 ms the first time each shape is
seen, `scripts/bench_prefill_attention.py`) and holds float32 scores (1 row x 2048 queries x 32k
keys: 8.2 GiB at its peak). Prompt lengths keep making new key lengths, so after READY every
wave paid 4-9 such builds, 90-270 ms steps while every decoding row waited. The same attention
from MLX's ops (grouped query heads by broadcasting, bf16 scores, a precise softmax, as MLX's own
fallback computes it) costs 4-15 ms the first time, steady time within 5-15% (the same at 32k
keys) and half the memory. The steps' score bound (`prefill_plan.PREFILL_SCORES_MAX`) keeps what
it holds in hand.

Off CUDA the fast op stays: Metal's masked attention is a fused kernel, and on the CPU the fast op
is these same ops.

A long prompt's later chunks take another path (`long_chunk`): one row whose queries are the last
keys it reads needs no mask, and the fast op's causal kernel (cuDNN's flash attention on CUDA)
holds no scores: H200, 32/8 heads, 32k keys, 0.46-0.50 ms for 64-512 queries against 0.86-2.88 ms
by ops, 2048 queries over 16k keys 0.84 against 5.57 ms. cuDNN builds a graph per shape (~62 ms
the first time), so such a chunk's keys end on a multiple of its width: one shape per multiple,
each run by the warm-up.
"""

from __future__ import annotations

import mlx.core as mx

from scheduler_proc.kv_layout import Layout

# NOTE: cuDNN's attention takes head dims that are multiples of 8, at most 128, in half types.
_CUDNN_DTYPES = (mx.bfloat16, mx.float16)
LONG_CHUNK_GPU = 512  # NOTE: the fast kernel costs the same for 64-512 queries at 32k keys


def by_ops(choice: str) -> bool:
    """Whether prompt chunks take `attention` (`--prefill-attention` auto, ops or fast; auto:
    on CUDA)."""
    if choice == "auto":
        return mx.cuda.is_available() and mx.default_device() == mx.gpu
    return choice == "ops"


def long_chunk(choice: int, layout: Layout, by_ops: bool) -> int | None:
    """Tokens per lone causal chunk (`--long-prefill-chunk`; None: off).

    Only for models whose every layer attends fully (a window or a recurrent state needs the
    step's own mask and lengths); 0 (auto): on CUDA (`by_ops`) where cuDNN takes the layers."""
    if choice < 0 or layout.states or any(s.window is not None for s in layout.kv):
        return None
    if choice:
        return choice
    if not by_ops:
        return None
    for s in layout.kv:
        if s.dtype not in _CUDNN_DTYPES or max(s.k_dim, s.v_dim) > 128 or (s.k_dim | s.v_dim) % 8:
            return None
    return LONG_CHUNK_GPU


def aligned(start: int, n: int, width: int | None) -> bool:
    """Whether a chunk of `n` tokens from `start` runs as a lone causal chunk of `width`: a later
    chunk (start > 0) whose keys, padded to the width, end on a multiple of it."""
    return width is not None and start > 0 and start % width == 0 and n <= width


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """softmax(q k^T * scale, masked) v for q (R, H, T, D), k and v (R, KVH, L, D) with H a
    multiple of KVH, and a boolean (keep) or additive mask: (T, L), or (R, 1 or H, T, L)."""
    r, heads, t, d = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    # NOTE: (R, KVH, G, T, D) against (R, KVH, 1, L, D): the G query heads sharing a KV head
    # read it by broadcasting, no copy of K or V per query head.
    qg = (q * mx.array(scale, q.dtype)).reshape(r, kv_heads, g, t, d)
    scores = qg @ k[:, :, None].swapaxes(-1, -2)
    m = mask
    if m.ndim == 4:  # NOTE: (R, 1 or H, T, L) -> (R, 1 or KVH, 1 or G, T, L)
        m = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], kv_heads, g, *m.shape[2:])
    if m.dtype == mx.bool_:
        scores = mx.where(m, scores, mx.array(-mx.inf, scores.dtype))
    else:
        scores = scores + m.astype(scores.dtype)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ v[:, :, None]).reshape(r, heads, t, v.shape[-1])
