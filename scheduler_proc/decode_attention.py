"""Decode attention over rows of different lengths, read through a page table, without a mask
(one fused kernel on CUDA).

A decode step's rows have different lengths, so attention needs a per-row mask, and MLX's fused
CUDA decode kernel (`sdpa_vector`) takes no array mask: every masked decode step fell back to the
unfused path (scores, mask, softmax, matmul per layer; H200, B=128: a 15.7 ms forward vs 9.4 ms
unmasked). This kernel reads each row's own length instead: one block per (row, KV head) walks
that row's keys with an online softmax, for all the query heads sharing the KV head, reading the
pool's paged buffers in place (no gather, no copy): key t of row b lives at slot
`table[b, t // P] * P + t % P` of the layer's `(KVH, S, D)` buffers. Two bodies: lanes over keys
(`_LANES_BODY`, the common head shapes: H200, 128 rows x 4,000 keys, ~2.0 TB/s) and tiles of 128
keys a thread each (`_BODY`, the rest: ~1.3 TB/s there).

mlx-lm's models call `scaled_dot_product_attention` from `mlx_lm.models.base` through a name bound
in their own module; `install` rebinds that name to `attention`, which runs the kernel when the
layer's cache says the step is a fused decode (`fused_lengths()` gives `PagedKeys`) and otherwise
calls mlx-lm's function unchanged. The runner checks the kernel against its masked twin at
start-up (`self_check`), then with one fused forward that every full-attention layer went through
it and fitted the kernel (`counts`), and keeps the masked path for a model where one did not.
"""

from __future__ import annotations

import functools
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from scheduler_proc import prefill_attention
from scheduler_proc.kv_quant import KVQuant, dequantize

log = logging.getLogger(__name__)

_TILE = 128  # NOTE: threads per block, and keys per tile: one key per thread in the score phase
_SHARED = 48 * 1024  # NOTE: static shared memory per block without an opt-in

_HEADER = """
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
"""

# NOTE: both kernels' start: the block's (split, KV head, row), its thread, and the span of the
# row's keys its split walks, in whole tiles of NT keys (one split: the whole row).
_SPAN = """
  constexpr int NT = 128;
  constexpr int NW = NT / 32;
  constexpr int VEC = 16 / sizeof(T);
  const float NEG_INF = __int_as_float(0xff800000);
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int t = threadIdx.x;
  const int lane = t % 32;
  const int warp = t / 32;
  const int W = table_shape[1];
  // NOTE: never past the row's table, whatever the length says.
  const int len = min(lengths[b], W * P);
  const int per = (len + gridDim.x * NT - 1) / (gridDim.x * NT) * NT;
  const int k0 = split * per;
  const int k1 = min(len, k0 + per);
"""

# NOTE: q (B, KVH * G, 1, D); k, v (1, KVH, S, D), the pool's slots; table (B, W) pages per row
# (`table_shape[1]`: W at run time, so a new table width compiles nothing); lengths (B,) keys per
# row (0: a pad row, output zeros); scale (1,) float32. Template constants: T, D, G (query heads
# per KV head), KVH, S (slots), P (page size). Blocks: (split, KV head, row); a split walks its
# share of the row's keys, in whole tiles (one split: the whole row, and the final output). Each
# tile's slots are looked up once into shared memory: a thread's own for its key's scores, all
# of them for the V sums.
_BODY = (
    _SPAN
    + """
  constexpr int OUT = (G * D + NT - 1) / NT;

  __shared__ float qs[G][D];
  __shared__ float ps[G][NT];
  __shared__ int slots[NT];
  __shared__ float m_run[G];
  __shared__ float l_run[G];
  __shared__ float corr[G];

  const float sc = scale[0];
  const size_t head0 = (size_t)b * KVH * G + (size_t)kvh * G;
  for (int i = t; i < G * D; i += NT) {
    qs[i / D][i % D] = static_cast<float>(q[head0 * D + i]) * sc;
  }
  if (t < G) {
    m_run[t] = NEG_INF;
    l_run[t] = 0.0f;
  }
  float acc[OUT];
  for (int j = 0; j < OUT; j++) acc[j] = 0.0f;
  __syncthreads();

  const int* pages = table + (size_t)b * W;
  const T* kb = k + (size_t)kvh * S * D;
  const T* vb = v + (size_t)kvh * S * D;
  for (int start = k0; start < k1; start += NT) {
    const int key = start + t;
    float s[G];
    for (int g = 0; g < G; g++) s[g] = 0.0f;
    if (key < k1) {
      const int slot = pages[key / P] * P + key % P;
      slots[t] = slot;
      // NOTE: 16-byte loads: a key row is D * sizeof(T) bytes, a multiple of 16 (`fits`),
      // contiguous within its slot.
      const uint4* kr = reinterpret_cast<const uint4*>(kb + (size_t)slot * D);
#pragma unroll
      for (int c = 0; c < D / VEC; c++) {
        const uint4 chunk = kr[c];
        const T* e = reinterpret_cast<const T*>(&chunk);
#pragma unroll
        for (int x = 0; x < VEC; x++) {
          const float kd = static_cast<float>(e[x]);
#pragma unroll
          for (int g = 0; g < G; g++) s[g] += qs[g][c * VEC + x] * kd;
        }
      }
    } else {
      for (int g = 0; g < G; g++) s[g] = NEG_INF;
    }
    for (int g = 0; g < G; g++) ps[g][t] = s[g];
    __syncthreads();

    for (int g = warp; g < G; g += NW) {
      float m = NEG_INF;
      for (int i = lane; i < NT; i += 32) m = fmaxf(m, ps[g][i]);
      m = warp_max(m);
      const float m_new = fmaxf(m_run[g], m);
      float sum = 0.0f;
      for (int i = lane; i < NT; i += 32) {
        const float p = ps[g][i] == NEG_INF ? 0.0f : __expf(ps[g][i] - m_new);
        ps[g][i] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float c = m_run[g] == NEG_INF ? 0.0f : __expf(m_run[g] - m_new);
        corr[g] = c;
        l_run[g] = l_run[g] * c + sum;
        m_run[g] = m_new;
      }
    }
    __syncthreads();

    // NOTE: only the tile's first n slots were written this tile (keys below k1).
    const int n = min(NT, k1 - start);
    for (int j = 0; j < OUT; j++) {
      const int i = t + j * NT;
      if (i < G * D) {
        const int g = i / D;
        const T* vc = vb + (i % D);
        float a = acc[j] * corr[g];
#pragma unroll 8
        for (int kk = 0; kk < n; kk++) {
          a += ps[g][kk] * static_cast<float>(vc[(size_t)slots[kk] * D]);
        }
        acc[j] = a;
      }
    }
    __syncthreads();
  }

"""
)

# NOTE: the same attention, lanes over keys (`lanes_fit`): each key's D elements are read by L lanes
# (E each, whole 16-byte loads), so a warp reads 32 / L keys at once, K and V in the same pass.
# Every group of L lanes keeps its own running max, sum and output over the keys it walks (no
# shared memory and no block-wide barrier per tile, where `_BODY` takes three), and the groups
# and warps merge once at the end. Per-thread state is G * E query and output values in
# registers, so only shapes where G * E <= 64 take it. Each group loads U keys before using any.
# H200, 128 rows x 4,000 keys, 32/8 heads of 64: `_BODY` read K and V at ~1.2 TB/s.
_LANES_HEAD = """
  constexpr int L = (D / VEC) < 32 ? (D / VEC) : 32;
  constexpr int E = D / L;
  constexpr int LOADS = E / VEC;
  constexpr int KPW = 32 / L;
  constexpr int U = 4;
  constexpr int STRIDE = NW * KPW;
  const int grp = lane / L;
  const int sub = lane % L;

  const float sc = scale[0];
  const size_t head0 = (size_t)b * KVH * G + (size_t)kvh * G;
  float qr[G][E];
  float acc[G][E];
  float m[G];
  float l[G];
#pragma unroll
  for (int g = 0; g < G; g++) {
    m[g] = NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; e++) {
      qr[g][e] = static_cast<float>(q[(head0 + g) * D + sub * E + e]) * sc;
      acc[g][e] = 0.0f;
    }
  }

"""

_LANES_LOOP = """
  const int* pages = table + (size_t)b * W;
  const T* kb = k + (size_t)kvh * S * D + sub * E;
  const T* vb = v + (size_t)kvh * S * D + sub * E;
  // NOTE: `it` is the same for every lane of a warp, so every lane reaches every shuffle.
  for (int it = k0 + warp * KPW; it < k1; it += STRIDE * U) {
    uint4 kx[U][LOADS];
    uint4 vx[U][LOADS];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int key = it + grp + u * STRIDE;
      if (key < k1) {
        const size_t slot = (size_t)(pages[key / P] * P + key % P);
        const uint4* kr = reinterpret_cast<const uint4*>(kb + slot * D);
        const uint4* vr = reinterpret_cast<const uint4*>(vb + slot * D);
#pragma unroll
        for (int c = 0; c < LOADS; c++) {
          kx[u][c] = kr[c];
          vx[u][c] = vr[c];
        }
      } else {
#pragma unroll
        for (int c = 0; c < LOADS; c++) {
          kx[u][c] = make_uint4(0, 0, 0, 0);
          vx[u][c] = make_uint4(0, 0, 0, 0);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const T* ke = reinterpret_cast<const T*>(kx[u]);
      const T* ve = reinterpret_cast<const T*>(vx[u]);
"""

# NOTE: a key's scores for the G query heads (each lane's E products, summed over its L lanes)
# and the online softmax's update, from `ke` and `ve`: the key's E values of this lane (the plain
# loop's own elements, the quantized loop's values mapped back).
_LANES_ATTEND = """
      float s[G];
#pragma unroll
      for (int g = 0; g < G; g++) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) d += qr[g][e] * static_cast<float>(ke[e]);
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffff, d, o);
        s[g] = d;
      }
      if (it + grp + u * STRIDE < k1) {
#pragma unroll
        for (int g = 0; g < G; g++) {
          const float m_new = fmaxf(m[g], s[g]);
          const float c = __expf(m[g] - m_new);
          const float p = __expf(s[g] - m_new);
          l[g] = l[g] * c + p;
#pragma unroll
          for (int e = 0; e < E; e++) {
            acc[g][e] = acc[g][e] * c + p * static_cast<float>(ve[e]);
          }
          m[g] = m_new;
        }
      }
    }
  }

"""

# NOTE: the groups' and warps' running max, sum and output merged (every lanes body ends so).
_LANES_MERGE = """
  // NOTE: the warp's key groups merge (lanes L apart hold the same dims), then the warps do.
#pragma unroll
  for (int g = 0; g < G; g++) {
    float top = m[g];
#pragma unroll
    for (int o = L; o < 32; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, o));
    const float f = m[g] == NEG_INF ? 0.0f : __expf(m[g] - top);
    float sum = l[g] * f;
#pragma unroll
    for (int o = L; o < 32; o <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
#pragma unroll
    for (int e = 0; e < E; e++) {
      float a = acc[g][e] * f;
#pragma unroll
      for (int o = L; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffff, a, o);
      acc[g][e] = a;
    }
    m[g] = top;
    l[g] = sum;
  }
  __shared__ float w_acc[NW][G][D];
  __shared__ float w_m[NW][G];
  __shared__ float w_l[NW][G];
  if (grp == 0) {
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
      for (int e = 0; e < E; e++) w_acc[warp][g][sub * E + e] = acc[g][e];
      if (sub == 0) {
        w_m[warp][g] = m[g];
        w_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();
  // NOTE: thread i of G * D holds head i / D's dim i % D: its max, sum and output over the block.
  constexpr int OUT = (G * D + NT - 1) / NT;
  float o_num[OUT];
  float o_top[OUT];
  float o_den[OUT];
#pragma unroll
  for (int j = 0; j < OUT; j++) {
    const int i = t + j * NT;
    o_num[j] = 0.0f;
    o_den[j] = 0.0f;
    o_top[j] = NEG_INF;
    if (i < G * D) {
      const int g = i / D;
      float top = NEG_INF;
      for (int w = 0; w < NW; w++) top = fmaxf(top, w_m[w][g]);
      for (int w = 0; w < NW; w++) {
        if (w_m[w][g] != NEG_INF) {
          const float f = __expf(w_m[w][g] - top);
          o_num[j] += f * w_acc[w][g][i % D];
          o_den[j] += f * w_l[w][g];
        }
      }
      o_top[j] = top;
    }
  }
"""

_LANES_BODY = _SPAN + _LANES_HEAD + _LANES_LOOP + _LANES_ATTEND + _LANES_MERGE

# NOTE: the lanes body over quantized pages (`--kv-bits`, `quant_fit`): k and v are the codes,
# `(1, KVH, S, D * BITS / 32)` uint32 (element e of a key at bits (e * BITS) % 32 of word
# e * BITS / 32), each group of GS values mapped back by its scale and bias (`(1, KVH, S, D / GS)`
# of T): x = code * scale + bias, as MLX's `dequantize`. A lane's E values lie in one group, so a
# key costs a lane E * BITS / 8 bytes of codes and one scale and bias, K's and V's each.
_QLANES_LOOP = """
  constexpr int WORDS = E * BITS / 32;
  constexpr int CPK = D * BITS / 32;
  constexpr int GPK = D / GS;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  const int* pages = table + (size_t)b * W;
  const uint32_t* kc = k + (size_t)kvh * S * CPK + sub * WORDS;
  const uint32_t* vc = v + (size_t)kvh * S * CPK + sub * WORDS;
  const size_t gk = (size_t)kvh * S * GPK + (sub * E) / GS;
  // NOTE: `it` is the same for every lane of a warp, so every lane reaches every shuffle.
  for (int it = k0 + warp * KPW; it < k1; it += STRIDE * U) {
    uint32_t kx[U][WORDS];
    uint32_t vx[U][WORDS];
    float kq[U][2];
    float vq[U][2];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int key = it + grp + u * STRIDE;
      if (key < k1) {
        const size_t slot = (size_t)(pages[key / P] * P + key % P);
#pragma unroll
        for (int c = 0; c < WORDS; c++) {
          kx[u][c] = kc[slot * CPK + c];
          vx[u][c] = vc[slot * CPK + c];
        }
        const size_t gi = gk + slot * GPK;
        kq[u][0] = static_cast<float>(k_scales[gi]);
        kq[u][1] = static_cast<float>(k_biases[gi]);
        vq[u][0] = static_cast<float>(v_scales[gi]);
        vq[u][1] = static_cast<float>(v_biases[gi]);
      } else {
#pragma unroll
        for (int c = 0; c < WORDS; c++) {
          kx[u][c] = 0u;
          vx[u][c] = 0u;
        }
        kq[u][0] = kq[u][1] = vq[u][0] = vq[u][1] = 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      float ke[E];
      float ve[E];
#pragma unroll
      for (int e = 0; e < E; e++) {
        const int shift = (e * BITS) % 32;
        ke[e] = static_cast<float>((kx[u][e * BITS / 32] >> shift) & MASK) * kq[u][0] + kq[u][1];
        ve[e] = static_cast<float>((vx[u][e * BITS / 32] >> shift) & MASK) * vq[u][0] + vq[u][1];
      }
"""

_QLANES_BODY = _SPAN + _LANES_HEAD + _QLANES_LOOP + _LANES_ATTEND + _LANES_MERGE

# NOTE: `_LANES_BODY`, one split: normalise and write the output.
_LANES_FINAL = """
  for (int j = 0; j < OUT; j++) {
    const int i = t + j * NT;
    if (i < G * D) {
      out[head0 * D + i] = static_cast<T>(o_den[j] > 0.0f ? o_num[j] / o_den[j] : 0.0f);
    }
  }
"""

# NOTE: `_LANES_BODY`, several splits: the parts `_COMBINE` merges, as `_PARTIAL` writes them.
_LANES_PARTIAL = """
  const size_t part = ((size_t)b * KVH + kvh) * gridDim.x + split;
  for (int j = 0; j < OUT; j++) {
    const int i = t + j * NT;
    if (i < G * D) {
      o_part[part * G * D + i] = o_num[j];
      if (i % D == 0) {
        m_part[part * G + i / D] = o_top[j];
        l_part[part * G + i / D] = o_den[j];
      }
    }
  }
"""

# NOTE: one split: normalise and write the output.
_FINAL = """
  for (int j = 0; j < OUT; j++) {
    const int i = t + j * NT;
    if (i < G * D) {
      const float l = l_run[i / D];
      out[head0 * D + i] = static_cast<T>(len > 0 ? acc[j] / l : 0.0f);
    }
  }
"""

# NOTE: several splits: each writes its unnormalised sums, running max and sum (float32);
# `_COMBINE` merges them. A split without keys writes max -inf and sums 0.
_PARTIAL = """
  const size_t part = ((size_t)b * KVH + kvh) * gridDim.x + split;
  for (int j = 0; j < OUT; j++) {
    const int i = t + j * NT;
    if (i < G * D) o_part[part * G * D + i] = acc[j];
  }
  if (t < G) {
    m_part[part * G + t] = m_run[t];
    l_part[part * G + t] = l_run[t];
  }
"""

# NOTE: threads (G * D, KVH, B); S splits per (row, KV head), read from the parts' shape at run
# time: as a template constant, each split count compiled its own kernel on first use after READY
# (H200: 1.5-3.9 s steps in a multi-turn run, every request waiting).
_COMBINE = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= G * D) return;
  const int S = m_part_shape[2];
  const float NEG_INF = __int_as_float(0xff800000);
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int g = i / D;
  const size_t base = ((size_t)b * KVH + kvh) * S;
  float top = NEG_INF;
  for (int s = 0; s < S; s++) top = fmaxf(top, m_part[(base + s) * G + g]);
  float num = 0.0f;
  float den = 0.0f;
  for (int s = 0; s < S; s++) {
    const float m = m_part[(base + s) * G + g];
    if (m != NEG_INF) {
      const float w = __expf(m - top);
      num += w * o_part[(base + s) * G * D + i];
      den += w * l_part[(base + s) * G + g];
    }
  }
  out[(((size_t)b * KVH + kvh) * G) * D + i] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
"""

_scales: dict[float, mx.array] = {}

# NOTE: rows of fewer keys run in one pass (`split_count`).
SPLIT_MIN_KEYS = 1024
# NOTE: most keys one split walks when the GPU is already full of blocks: the split count is the
# batch's, so one long row (a 30k-token prompt's last token, its decode) among 64 short ones
# walked all its keys in one block per KV head (H200: 40-70 ms steps beside 8 ms ones).
SPLIT_KEYS = 2048


@dataclass(frozen=True)
class PagedKeys:
    """Where a fused decode step's keys are: row b's key t at slot
    `table[b, t // page_size] * page_size + t % page_size` of the layer's buffers, for
    t < `lengths[b]` (0: a pad row).

    `table` (B, W) int32 is padded with any valid page id; `lengths` (B,) int32; `max_len` a host
    bound on `lengths`, at most W * page_size.
    """

    lengths: mx.array
    max_len: int
    table: mx.array
    page_size: int
    quant: QuantPages | None = None  # NOTE: `--kv-bits`: k and v are codes, these map them back


@dataclass(frozen=True)
class QuantPages:
    """A quantized layer's scales and biases, K's and V's, `(1, KVH, S, D / group)` each, beside
    its codes (`(1, KVH, S, D * bits / 32)` uint32, what the layer hands attention as k and v)."""

    k_scales: mx.array
    k_biases: mx.array
    v_scales: mx.array
    v_biases: mx.array
    bits: int
    group: int


@dataclass(frozen=True)
class RowGroup:
    """Rows of one forward that attend together (`Groups`, `kv_cache._RaggedView.groups`): which rows (into the forward's),
    their keys and values, and their mask ("causal": each row's queries are its last keys)."""

    rows: slice | mx.array
    keys: mx.array
    values: mx.array
    mask: mx.array | str | None


@dataclass(frozen=True)
class Groups:
    """A layer's attention in parts: each part's rows attend over their own keys only; the
    parts' outputs, concatenated, go back to row order by `order` (None: they are in it)."""

    parts: list[RowGroup]
    order: mx.array | None = None


@dataclass
class Counts:
    """Fused calls since start, and those that had to take the masked path (`fits` false)."""

    calls: int = 0
    masked: int = 0
    prefill_ops: int = 0  # prompt-chunk attention calls run by `prefill_attention`
    prefill_causal: int = 0  # prompt-chunk calls by the fast op's causal kernel (first, lone long)
    split: int = 0  # fused calls whose rows' keys take the split path (its own kernels)
    grouped: int = 0  # decode attention calls of one group of rows (`by_groups`)


counts = Counts()


def available() -> bool:
    """Whether the kernel runs here (and `--fused-decode auto` takes the fused path): on MLX's
    CUDA backend, whose own fused decode kernel takes no mask (Metal's takes it; the CPU has no
    fused kernel to lose)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def fits(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Shapes the kernel takes: one query per row, K and V alike as one (1, KVH, S, D) buffer
    each in q's dtype, D up to 256 in whole 16-byte loads, whole query heads per KV head, and
    the block's shared memory within the static limit."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    g = heads // kv_heads
    return (
        q.shape[2] == 1
        and k.ndim == 4
        and k.shape[0] == 1
        and k.shape == v.shape
        and q.dtype == k.dtype == v.dtype
        and k.shape[-1] == dim <= 256
        and dim * k.dtype.size % 16 == 0
        and heads % kv_heads == 0
        and g <= 32
        and 4 * (g * (dim + _TILE + 3) + _TILE) <= _SHARED
    )


def decode_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    keys: PagedKeys,
    scale: float,
    splits: int | None = None,
    lanes: bool | None = None,
) -> mx.array:
    """softmax(q k^T * scale) v for q (B, H, 1, D) over row b's first `keys.lengths[b]` keys,
    read through `keys.table` from k, v (1, KVH, S, D); a row of length 0 (padding) gives zeros.
    With `keys.quant`, k and v are codes (`QuantPages`), mapped back in the kernel (`quant_fit`).
    `splits` per row (default: `split_count`); `lanes`: the lanes-over-keys kernel (default:
    wherever the shape fits it, `lanes_fit`)."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    n = splits or split_count(b * kv_heads, keys.max_len)
    counts.split += n > 1
    if not available():
        return _masked(q, k, v, keys, scale)
    qp = keys.quant
    if lanes is None or qp is not None:
        lanes = qp is not None or lanes_fit(g, dim, q.dtype)
    prefix = "qlanes_" if qp is not None else "lanes_" if lanes else ""
    template = [
        ("T", q.dtype),
        ("D", dim),
        ("G", g),
        ("KVH", kv_heads),
        ("S", k.shape[2]),
        ("P", keys.page_size),
    ]
    inputs = [q, k, v, keys.table, keys.lengths, _scale(scale)]
    if qp is not None:
        template += [("BITS", qp.bits), ("GS", qp.group)]
        inputs[3:3] = [qp.k_scales, qp.k_biases, qp.v_scales, qp.v_biases]
    shape = dict(grid=(_TILE * n, kv_heads, b), threadgroup=(_TILE, 1, 1), template=template)
    if n == 1:
        return _kernel(prefix + "final")(
            inputs=inputs, output_shapes=[q.shape], output_dtypes=[q.dtype], **shape
        )[0]
    parts = _kernel(prefix + "partial")(
        inputs=inputs,
        output_shapes=[(b, kv_heads, n, g, dim), (b, kv_heads, n, g), (b, kv_heads, n, g)],
        output_dtypes=[mx.float32] * 3,
        **shape,
    )
    width = min(g * dim, 256)
    return _kernel("combine")(
        inputs=parts,
        template=[("T", q.dtype), ("D", dim), ("G", g), ("KVH", kv_heads)],
        grid=(g * dim, kv_heads, b),
        threadgroup=(width, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]


def quant_fit(q: mx.array, k: mx.array, v: mx.array, quant: QuantPages) -> bool:
    """Shapes the quantized kernel takes: those of the lanes body (`lanes_fit`) whose lanes
    each read whole words of codes within one group, scales in q's dtype."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[-1]
    if q.shape[2] != 1 or k.ndim != 4 or k.shape[0] != 1 or k.shape != v.shape:
        return False
    if k.dtype != mx.uint32 or k.shape[-1] * 32 != dim * quant.bits or dim > 256:
        return False
    if heads % kv_heads or quant.k_scales.dtype != q.dtype or dim * q.dtype.size % 16:
        return False
    g = heads // kv_heads
    lanes = min(dim * q.dtype.size // 16, 32)
    per_lane = dim // lanes
    return (
        g <= 32
        and lanes_fit(g, dim, q.dtype)
        and per_lane * quant.bits % 32 == 0
        and quant.group % per_lane == 0
    )


def lanes_fit(g: int, dim: int, dtype: mx.Dtype) -> bool:
    """Whether `_LANES_BODY` takes this shape: a key's 16-byte loads spread over lanes that
    divide a warp, and each thread's G * E query and output values few enough for registers."""
    loads = dim * dtype.size // 16  # NOTE: `fits` holds it whole
    lanes = min(loads, 32)
    return 32 % lanes == 0 and loads % lanes == 0 and g * (dim // lanes) <= 64


def split_count(blocks: int, max_len: int, target: int = 256, min_len: int | None = None) -> int:
    """Splits per (row, KV head): enough blocks to fill a large GPU (`target`), and enough that
    the longest row's splits walk at most `SPLIT_KEYS` keys each; each split at least one tile of
    keys, a power of two up to 32; none for rows under `min_len` keys.

    NOTE: H200, 32/8 heads, dim 64: rows of up to 600 keys ran slower split (B=2: 72 us in 4
    splits vs 65 us in one pass; the merge costs more than it saves), rows of up to 4000 keys
    much faster (B=2: 85 us in 16 splits vs 237 us; B=16: 247 vs 382 us).
    """
    if max_len < (SPLIT_MIN_KEYS if min_len is None else min_len):
        return 1
    n = 1
    while (
        n < 32 and (2 * n) * _TILE <= max_len and (blocks * n < target or max_len > n * SPLIT_KEYS)
    ):
        n *= 2
    return n


def _scale(scale: float) -> mx.array:
    """The scale as a (1,) array, made once per value: a template constant would compile a
    variant per value."""
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    return _scales[scale]


@functools.cache
def _kernel(kind: str) -> Any:
    """Built once each; NVRTC compiles one variant per template (dtype, head shape, pool size,
    page size)."""
    body = ["q", "k", "v", "table", "lengths", "scale"]
    quant = ["q", "k", "v", "k_scales", "k_biases", "v_scales", "v_biases", *body[3:]]
    io = {
        "final": (body, ["out"], _BODY + _FINAL),
        "partial": (body, ["o_part", "m_part", "l_part"], _BODY + _PARTIAL),
        "lanes_final": (body, ["out"], _LANES_BODY + _LANES_FINAL),
        "lanes_partial": (body, ["o_part", "m_part", "l_part"], _LANES_BODY + _LANES_PARTIAL),
        "qlanes_final": (quant, ["out"], _QLANES_BODY + _LANES_FINAL),
        "qlanes_partial": (quant, ["o_part", "m_part", "l_part"], _QLANES_BODY + _LANES_PARTIAL),
        "combine": (["o_part", "m_part", "l_part"], ["out"], _COMBINE),
    }
    inputs, outputs, source = io[kind]
    return mx.fast.cuda_kernel(
        name=f"paged_decode_attention_{kind}",
        input_names=inputs,
        output_names=outputs,
        source=source,
        header=_HEADER,
    )


def _masked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    keys: PagedKeys,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """The same attention through MLX's own op and a mask (other backends, other shapes): each
    row's pages gathered, the first `max_len` keys (the host bound on the lengths) kept."""
    p, width = keys.page_size, keys.table.shape[1]
    # NOTE: at least key 0: a pad row (length 0) sees it, so no row of the softmax is empty.
    n = min(max(keys.max_len, 1), width * p)
    table = keys.table[:, : -(-n // p)]  # NOTE: only the pages the bound reaches
    lengths = keys.lengths
    mask = (mx.arange(n)[None] < mx.maximum(lengths, 1)[:, None])[:, None, None]
    kk, vv = _gather(k, table, p, n), _gather(v, table, p, n)
    qp = keys.quant
    if qp is not None:
        how = KVQuant(qp.bits, qp.group)
        ks, kb = _gather(qp.k_scales, table, p, n), _gather(qp.k_biases, table, p, n)
        vs, vb = _gather(qp.v_scales, table, p, n), _gather(qp.v_biases, table, p, n)
        kk, vv = dequantize(kk, ks, kb, how, q.dtype), dequantize(vv, vs, vb, how, q.dtype)
    return mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask=mask, sinks=sinks)


def _gather(buf: mx.array, table: mx.array, page_size: int, n: int) -> mx.array:
    """Rows' first n keys (B, KVH, n, D) from the pool buffer (1, KVH, S, D) through the table."""
    _, kv_heads, slots, dim = buf.shape
    b, width = table.shape
    # NOTE: a reshape, not `buf[0]`: on the CPU an indexed slice copies the whole buffer
    pages = buf.reshape(kv_heads, slots // page_size, page_size, dim)[:, table]
    rows = pages.reshape(kv_heads, b, width * page_size, dim).transpose(1, 0, 2, 3)
    return rows[:, :, :n]


def attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with the fused decode where the cache asks, and
    prompt chunks by MLX's ops where it asks for that (`prefill_attention`)."""
    fused = getattr(cache, "fused_lengths", None)
    paged: PagedKeys | None = fused() if fused is not None else None
    if paged is None:
        grouped = getattr(cache, "groups", None)
        groups: Groups | None = grouped() if grouped is not None else None
        if groups is not None:
            return by_groups(queries, groups, scale, sinks)
        ops = getattr(cache, "prefill_by_ops", None)
        if ops is not None and ops() and isinstance(mask, mx.array) and sinks is None:
            counts.prefill_ops += 1
            return prefill_attention.attention(queries, keys, values, scale, mask)
        counts.prefill_causal += isinstance(mask, str) and queries.shape[2] > 1
        if _folds(queries, keys, mask, sinks):
            return folded(queries, keys, values, scale, mask)
        return base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    counts.calls += 1
    if paged.quant is not None:
        ok = sinks is None and quant_fit(queries, keys, values, paged.quant)
    else:
        ok = sinks is None and fits(queries, keys, values)
    if not ok:
        counts.masked += 1
        return _masked(queries, keys, values, paged, scale, sinks)
    return decode_attention(queries, keys, values, paged, scale)


def by_groups(q: mx.array, groups: Groups, scale: float, sinks: mx.array | None) -> mx.array:
    """Attention in parts (`kv_cache.Groups`): each part's rows over their own keys, the
    outputs back in row order.

    NOTE: lone chunks, one part a row: each a lone chunk's shape (one cuDNN graph per multiple
    of the width, each warmed), where one padded batch would read every row's keys up to the
    longest with a mask (a graph per new (rows, keys)). Decode rows of very different lengths,
    one part a group: each reads only up to its own longest row."""
    outs = []
    for part in groups.parts:
        causal = isinstance(part.mask, str)
        counts.prefill_causal += causal
        counts.grouped += not causal
        rows = q[part.rows]
        if _folds(rows, part.keys, part.mask, sinks):
            outs.append(folded(rows, part.keys, part.values, scale, part.mask))
            continue
        outs.append(
            mx.fast.scaled_dot_product_attention(
                rows, part.keys, part.values, scale=scale, mask=part.mask, sinks=sinks
            )
        )
    out = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return out if groups.order is None else out[groups.order]


@functools.cache
def _fold_heads() -> bool:
    """Whether one-token rows' query heads are folded into query rows (`folded`): on the CPU.

    NOTE: MLX's CPU attention is matmul, softmax, matmul; with grouped query heads and one
    query a row, each query head is a one-row product over its KV head's keys, so every KV head
    is read once per query head. Folded, the heads sharing a KV head are the rows of one
    product: one 8,000-token row of the default model (9 heads over 3) attended in 2.1 ms a
    layer against 2.7 (OpenBLAS, this 2-core CPU). Metal's fused decode kernel (`sdpa_vector`)
    already reads a KV head once for its query heads, and CUDA's decode is the kernel above."""
    return mx.default_device() == mx.cpu


def _folds(q: mx.array, k: Any, mask: mx.array | str | None, sinks: mx.array | None) -> bool:
    """Whether this attention call takes `folded`: on the CPU, without sinks (one per query
    head), over plain keys (mlx-lm's own quantized cache hands (codes, scales, biases))."""
    return sinks is None and isinstance(k, mx.array) and _fold_heads() and foldable(q, k, mask)


def foldable(q: mx.array, k: mx.array, mask: mx.array | str | None) -> bool:
    """One query a row, whole query heads per KV head (more than one), and a mask that is the
    same for every head of a row (None, "causal" at one query, `(B, 1, 1, N)`, or mlx-lm's
    `(1, N)`): its query axis and its head axis, where it has them, of size 1."""
    heads, kv_heads = q.shape[1], k.shape[1]
    same = not isinstance(mask, mx.array) or all(d == 1 for d in mask.shape[-3:-1])
    return q.shape[2] == 1 and heads > kv_heads and heads % kv_heads == 0 and same


def folded(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | str | None
) -> mx.array:
    """Attention for `foldable` rows with the query heads sharing a KV head as one product's
    rows: q (B, H, 1, D) as (B, KVH, H / KVH, D), every row seeing the same keys (a one-token
    row's causal mask hides nothing: its query is its last key)."""
    b, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    rows = q.reshape(b, kv_heads, heads // kv_heads, dim)
    keep = mask if isinstance(mask, mx.array) else None
    out = mx.fast.scaled_dot_product_attention(rows, k, v, scale=scale, mask=keep)
    return out.reshape(b, heads, 1, dim)


def install(model: nn.Module) -> int:
    """Route the model's attention calls through `attention`; returns the modules rebound."""
    rebound = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        fn: Callable | None = getattr(module, "scaled_dot_product_attention", None)
        if module is not None and fn is base.scaled_dot_product_attention:
            setattr(module, "scaled_dot_product_attention", attention)  # noqa: B010 (typed)
            rebound += 1
        elif fn is attention:
            rebound += 1
    return rebound


def self_check(
    dtype: mx.Dtype = mx.bfloat16,
    *,
    heads: int = 12,
    kv_heads: int = 3,
    dim: int = 128,
    page_size: int = 32,
    quant: tuple[int, int] | None = None,
) -> bool:
    """Whether the kernel agrees with its masked twin on a small paged case (shuffled pages,
    GQA, a pad row; in one pass and in several splits); True off CUDA, where nothing runs it.
    `quant` (bits, group): the quantized kernel, on the case's pages quantized. The runner
    keeps the masked path when this is False, so a wrong kernel never serves."""
    if not available():
        return True
    lengths = [300, 0, 1, 129, 64, 1100]
    tol = 2e-3 if dtype == mx.float32 else 3e-2
    try:
        q, k, v, keys = _random_case(heads, kv_heads, dim, lengths, page_size, dtype)
        # NOTE: the reference in float32: only the kernel's own rounding is left to tolerate
        f32 = mx.float32
        if quant is not None:
            k, v, keys = _quantized(k, v, keys, *quant)
            k32, v32 = _plain_values(k, v, keys.quant, f32)
            want = _masked(q.astype(f32), k32, v32, _plain_keys(keys), dim**-0.5)
        else:
            want = _masked(q.astype(f32), k.astype(f32), v.astype(f32), keys, dim**-0.5)
        real = (keys.lengths > 0)[:, None, None, None]
        for splits in (1, 4):
            got = decode_attention(q, k, v, keys, dim**-0.5, splits).astype(mx.float32)
            # NOTE: NaN is never close, and a pad row must come out exactly zero
            close = mx.allclose(mx.where(real, got, want), want, atol=tol, rtol=tol).item()
            if not close or mx.any(mx.where(real, 0, got) != 0).item():
                log.warning("decode attention: the kernel disagrees (%s, %d splits)", dtype, splits)
                return False
    except Exception as e:  # NOTE: a kernel that fails to build or run must not serve either
        log.warning("decode attention: the kernel failed its check: %s", e)
        return False
    return True


def _quantized(
    k: mx.array, v: mx.array, keys: PagedKeys, bits: int, group: int
) -> tuple[mx.array, mx.array, PagedKeys]:
    """The case's K and V as quantized pages: codes, and `keys` with their scales and biases."""
    kc, ks, kb = mx.quantize(k, group_size=group, bits=bits)
    vc, vs, vb = mx.quantize(v, group_size=group, bits=bits)
    pages = QuantPages(ks, kb, vs, vb, bits, group)
    return kc, vc, PagedKeys(keys.lengths, keys.max_len, keys.table, keys.page_size, pages)


def _plain_values(
    k: mx.array, v: mx.array, quant: QuantPages | None, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """Quantized pages' values (MLX's own `dequantize`), in `dtype`."""
    assert quant is not None
    g, bits = quant.group, quant.bits
    kd = mx.dequantize(k, quant.k_scales, quant.k_biases, group_size=g, bits=bits)
    vd = mx.dequantize(v, quant.v_scales, quant.v_biases, group_size=g, bits=bits)
    return kd.astype(dtype), vd.astype(dtype)


def _plain_keys(keys: PagedKeys) -> PagedKeys:
    return PagedKeys(keys.lengths, keys.max_len, keys.table, keys.page_size)


def _random_case(
    heads: int,
    kv_heads: int,
    dim: int,
    lengths: list[int],
    page_size: int,
    dtype: mx.Dtype,
    seed: int = 0,
) -> tuple[mx.array, mx.array, mx.array, PagedKeys]:
    """q, pool buffers and `PagedKeys` for rows of these lengths, their pages shuffled across the
    pool (page 0 the scratch page that pads the table): `self_check`'s case."""
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)  # NOTE: the global seeds untouched
    p = page_size
    need = [-(-n // p) for n in lengths]
    width = max(max(need), 1)
    pages = 1 + sum(need) + 3  # NOTE: the scratch page, the rows' pages, a few free ones
    order = list(range(1, pages))
    random.Random(seed).shuffle(order)
    table, used = [], 0
    for m in need:
        table.append(order[used : used + m] + [0] * (width - m))
        used += m
    b, shape = len(lengths), (1, kv_heads, pages * p, dim)
    q = mx.random.normal((b, heads, 1, dim), key=kq).astype(dtype)
    k = mx.random.normal(shape, key=kk).astype(dtype)
    v = mx.random.normal(shape, key=kv).astype(dtype)
    keys = PagedKeys(
        lengths=mx.array(lengths, dtype=mx.int32),
        max_len=max(lengths),
        table=mx.array(table, dtype=mx.int32),
        page_size=p,
    )
    return q, k, v, keys
