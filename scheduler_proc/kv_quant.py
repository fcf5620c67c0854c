"""Quantized KV pages (`--kv-bits 8|4`): a full-attention layer's K or V in MLX's quantized form.

MLX quantizes along the last axis in groups (`mx.quantize`): per group of `group` values, an
affine map (scale, bias) and `bits`-bit codes packed into uint32. A `QuantBuffer` holds a
layer's K (or V) as those three arrays, each with the pool's token-slot axis second, so every
paging operation (a scatter of a step's tokens, a gather of rows' pages, a copy between slots,
growing and shrinking the pool) applies to each part as it does to a plain buffer. A step's new
tokens are quantized on their way in; attention reads dequantized gathers of the rows' pages
(the chunk being prefilled attends to its own keys unquantized, as they were computed).

Per token and head, K (or V) of dimension d costs d * bits / 8 bytes of codes plus two values
of the model's dtype per group: at 8 bits, group 64, bf16: 68 bytes for 128 (1.88x the tokens),
at 4 bits 36 (3.56x).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engine.errors import ModelError

GROUP_SIZES = (32, 64, 128)  # NOTE: what mx.quantize takes
BITS = (4, 8)


@dataclass(frozen=True)
class KVQuant:
    bits: int
    group: int

    def token_bytes(self, kv_heads: int, dim: int, dtype: mx.Dtype) -> int:
        """Bytes one token's K (or V) of one layer holds: codes, then a scale and bias a group."""
        return kv_heads * (dim * self.bits // 8 + 2 * (dim // self.group) * dtype.size)

    def check(self, dim: int) -> None:
        if dim % self.group:
            raise ModelError(
                f"--kv-group-size {self.group} does not divide the model's head dim {dim}: "
                f"use one of {[g for g in GROUP_SIZES if dim % g == 0] or 'none (no --kv-bits)'}"
            )

    def describe(self) -> str:
        return f"{self.bits} bits, groups of {self.group}"


class QuantBuffer:
    """One layer's K or V over the pool's token slots: codes `(h, S, d * bits / 32)` uint32,
    scales and biases `(h, S, d / group)` of the model's dtype."""

    __slots__ = ("parts", "quant", "dtype", "dim")

    def __init__(self, parts: list[mx.array], quant: KVQuant, dtype: mx.Dtype, dim: int) -> None:
        self.parts, self.quant, self.dtype, self.dim = parts, quant, dtype, dim

    @classmethod
    def zeros(cls, h: int, tokens: int, dim: int, dtype: mx.Dtype, quant: KVQuant) -> QuantBuffer:
        codes = mx.zeros((h, tokens, dim * quant.bits // 32), mx.uint32)
        groups = dim // quant.group
        return cls(
            [codes, mx.zeros((h, tokens, groups), dtype), mx.zeros((h, tokens, groups), dtype)],
            quant,
            dtype,
            dim,
        )

    def like(self, parts: list[mx.array]) -> QuantBuffer:
        return QuantBuffer(parts, self.quant, self.dtype, self.dim)

    @property
    def shape(self) -> tuple[int, int, int]:
        h, s, _ = self.parts[0].shape
        return h, s, self.dim

    def quantize(self, x: mx.array) -> list[mx.array]:
        """`x` (`(..., dim)`) as the three parts' values."""
        q = self.quant
        return list(mx.quantize(x.astype(self.dtype), group_size=q.group, bits=q.bits))

    def dequantize(self, parts: list[mx.array]) -> mx.array:
        """Gathered parts back to values of the model's dtype."""
        codes, scales, biases = parts
        return dequantize(codes, scales, biases, self.quant, self.dtype)


def dequantize(
    codes: mx.array, scales: mx.array, biases: mx.array, q: KVQuant, dtype: mx.Dtype
) -> mx.array:
    """Codes back to values of `dtype` (by elementwise ops on the CPU: `_by_ops`)."""
    if _by_ops():
        return _dequantize_by_ops(codes, scales, biases, q, dtype)
    out = mx.dequantize(codes, scales, biases, group_size=q.group, bits=q.bits)
    return out.astype(dtype)


Buffer = mx.array | QuantBuffer


def _by_ops() -> bool:
    """On the CPU MLX's `dequantize` runs 2-3x slower than the same map by elementwise ops (16
    rows x 1,024 keys x 3 heads x 64: 4.0 -> 1.3 ms at 8 bits, 5.2 -> 2.6 ms at 4); a GPU
    has a kernel for it."""
    return mx.default_device() == mx.cpu


def _dequantize_by_ops(
    codes: mx.array, scales: mx.array, biases: mx.array, q: KVQuant, dtype: mx.Dtype
) -> mx.array:
    """`mx.dequantize` for 8 or 4 bits: codes are little-endian in their uint32 words, so as
    bytes they are in order (4 bits: the low nibble first)."""
    u = codes.view(mx.uint8)
    if q.bits == 4:
        u = mx.stack([u & 15, u >> 4], axis=-1).reshape(*u.shape[:-1], -1)
    g = u.reshape(*u.shape[:-1], -1, q.group).astype(dtype)
    out = g * scales[..., None].astype(dtype) + biases[..., None].astype(dtype)
    return out.reshape(*out.shape[:-2], -1)


def parts(buf: Buffer) -> list[mx.array]:
    """The arrays a buffer is made of (a plain buffer: itself)."""
    return buf.parts if isinstance(buf, QuantBuffer) else [buf]


def rebuilt(buf: Buffer, new: list[mx.array]) -> Buffer:
    """`buf` made of `new` parts (a plain buffer: the one array)."""
    return buf.like(new) if isinstance(buf, QuantBuffer) else new[0]
