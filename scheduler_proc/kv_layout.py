"""The model's KV layout: which cache entries are attention K/V (full or sliding-window) and which are
recurrent state, with their shapes, found by one probing forward (`probe_model`).

Per-layer kinds, from the model's own `make_cache()` (docs/models.md): full attention (`KVCache`),
sliding-window attention (`RotatingKVCache`: the layer attends to its last `window` tokens) and
recurrent state (`ArraysCache`: linear attention, Mamba, short convolutions: a fixed-size state per
request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from engine.errors import ModelError
from scheduler_proc.kv_quant import KVQuant


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype
    window: int | None = None  # a sliding-window layer attends to its last `window` tokens


@dataclass(frozen=True)
class StateShape:
    """A recurrent layer's state per row: one array per entry, shapes without the batch axis."""

    arrays: tuple[tuple[tuple[int, ...], mx.Dtype], ...]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.size for shape, dtype in self.arrays)


@dataclass(frozen=True)
class Layout:
    """The model's cache list, in its order: `("kv", i)` or `("state", j)` for each entry."""

    entries: tuple[tuple[str, int], ...]
    kv: tuple[LayerShape, ...]
    states: tuple[StateShape, ...] = ()

    @classmethod
    def attention_only(cls, shapes: list[LayerShape]) -> Layout:
        return cls(tuple(("kv", i) for i in range(len(shapes))), tuple(shapes))

    @property
    def state_bytes_per_row(self) -> int:
        return sum(s.nbytes for s in self.states)


def bytes_per_token(
    shapes: list[LayerShape] | tuple[LayerShape, ...], quant: KVQuant | None = None
) -> int:
    """K and V of one token over `shapes`, as stored (`quant`: `--kv-bits` pages)."""
    if quant is not None:
        return sum(
            quant.token_bytes(s.kv_heads, s.k_dim, s.dtype)
            + quant.token_bytes(s.kv_heads, s.v_dim, s.dtype)
            for s in shapes
        )
    return sum(s.kv_heads * (s.k_dim + s.v_dim) * s.dtype.size for s in shapes)


def ring_size(window: int, chunk: int, context: int) -> int:
    """Entries of a window layer's ring: a step's widest chunk (`chunk` tokens) never overwrites a
    key one of its own queries still needs; never more than the context."""
    return min(window + chunk - 1, context)


class _ShapeProbe:
    """A one-token forward through this records an attention layer's K/V shape and dtype."""

    offset = 0

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.shape: LayerShape | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = keys.shape, values.shape
        self.shape = LayerShape(k[1], k[3], v[3], keys.dtype, self.window)
        return keys, values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None


class _StateProbe:
    """A one-token forward through this records a recurrent layer's state shapes (batch 1)."""

    lengths = None

    def __init__(self, size: int) -> None:
        self.arrays: list[tuple[tuple[int, ...], mx.Dtype] | None] = [None] * size

    def __getitem__(self, i: int) -> None:
        return None  # NOTE: an empty cache: the model starts from a zero state

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.arrays[i] = (tuple(value.shape[1:]), value.dtype)

    def __bool__(self) -> bool:
        return True

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, N: int) -> None:
        return None


def _probe_for(cache):
    """The probe for one entry of the model's cache list; None for a kind the pool cannot hold."""
    kind = type(cache)
    if kind is mlx_cache.KVCache:
        return _ShapeProbe()
    if kind is mlx_cache.RotatingKVCache and cache.keep == 0:
        return _ShapeProbe(cache.max_size)
    if kind is mlx_cache.ArraysCache:
        return _StateProbe(len(cache.cache))
    return None


def probe_model(model) -> tuple[Layout, int]:
    """The model's cache layout (K/V shapes, windows, state shapes) and its vocabulary size.

    Refuses, with `ModelError`, a model whose cache holds a kind the pool has no rows for.
    """
    caches = mlx_cache.make_prompt_cache(model)
    probes = [_probe_for(c) for c in caches]
    if any(p is None for p in probes):
        names = sorted({_kind_name(c) for c, p in zip(caches, probes, strict=True) if p is None})
        raise ModelError(f"unsupported cache types for the KV pool: {', '.join(names)}")
    logits = model(mx.array([[0]]), cache=probes)
    mx.eval(logits)
    entries: list[tuple[str, int]] = []
    kv: list[LayerShape] = []
    states: list[StateShape] = []
    for p in probes:
        if isinstance(p, _ShapeProbe):
            if p.shape is None:
                raise ModelError("a layer did not call cache.update_and_fetch")
            entries.append(("kv", len(kv)))
            kv.append(p.shape)
        else:
            if any(a is None for a in p.arrays):
                raise ModelError("a recurrent layer did not set its whole state")
            entries.append(("state", len(states)))
            states.append(StateShape(tuple(p.arrays)))
    if not kv:
        raise ModelError("no attention layer: state-space-only models are not supported")
    return Layout(tuple(entries), tuple(kv), tuple(states)), logits.shape[-1]


def _kind_name(cache) -> str:
    if isinstance(cache, mlx_cache.RotatingKVCache) and cache.keep:
        return f"RotatingKVCache(keep={cache.keep})"
    return type(cache).__name__
