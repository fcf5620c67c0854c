"""What a step's shapes and sizes default to on each MLX backend: CUDA, Metal or the CPU.

The options left at 0 (`--chunked-prefill-size`, `--max-prefill-tokens`, `--long-prefill-scores`)
and the padding of shapes are resolved here, once, from what each backend compiles per shape and
whether its prefill attention holds its scores (docs/platforms.md):

- CUDA builds a cuDNN attention graph and CUDA graphs per shape (~50-100 ms each, measured), so
  shapes are padded to a few buckets and warmed before READY; an H200 wants thousands of tokens a
  forward before its matmuls stop being memory-bound.
- Metal specialises its kernels by dtype, head dim and alignment flags (function constants), not
  by sizes: a new shape reuses a built pipeline, so shapes are exact (padding is only extra work)
  and the warm-up is one small forward of each kind. Its fused attention (`sdpa_full`, query
  width > 8) takes any array mask for head dims 64, 80 and 128 and never materialises the scores:
  then only the step's boolean mask (rows x width x keys bytes) is held, and the score bound is on
  that. A Mac's GPU is compute-bound at a few hundred tokens a forward, so steps are smaller than
  CUDA's: a long prefill step would only hold the decode rows back.
- The CPU compiles nothing per shape either; a step's cost grows with its tokens (no idle compute
  to fill), so steps are small.

NOTE, the sizes measured: on an H200 (Llama-3.2-1B shape, 128 requests of 32-1024 prompt tokens)
prefill steps took 2.2 s at 512/2048 and 0.8 s at 2048/8192. On the CPU (default model, 2 cores)
16 completions at once got their first token at p50 1.61-1.64 s with 512-token steps vs 1.93 s
with 2048 (one step for all), throughput unchanged (128.7 / 119.6 vs 118.3 tok/s). Metal's sizes
are not measured yet: between the two, by the reasoning above.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import mlx.core as mx

from engine.config import EngineConfig

# NOTE: MLX's Metal `sdpa_full` head dims (scaled_dot_product_attention.cpp, `use_fallback`);
# any other head dim falls back to matmul, softmax, matmul: scores held, as on the CPU.
METAL_FUSED_HEAD_DIMS = frozenset({64, 80, 128})
# NOTE: on the GPUs the cap keeps a long prompt's chunk beside decoding rows to a few ms of
# attention; Metal and the CPU have no such cap (their decode steps are tens of ms, and a 32k
# prompt capped so ran ~340 forwards instead of 16).
CUDA_SCORES_BESIDE_DECODE = 1 << 21


@dataclass(frozen=True)
class StepDefaults:
    backend: str  # cuda, metal or cpu
    exact_shapes: bool  # no padding to buckets (`shapes.Ladders.exact`)
    chunk: int  # tokens of one request per prefill step
    budget: int  # padded tokens per prefill step
    beside_decode: int | None  # rows x width x keys of a prefill step beside decoding rows
    scores_held: bool  # a prefill chunk's attention materialises its scores (per head)
    prefill_in_chain: bool  # prompt chunks ride chained decode steps (`Scheduler._can_chain`)


def current() -> str:
    """The backend the default device runs on."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def step_defaults(
    config: EngineConfig, backend: str, head_dims: Iterable[tuple[int, int]]
) -> StepDefaults:
    """The step's sizes by backend, options set in `config` taking precedence; `head_dims`:
    (key, value) head dims of the model's full-attention layers."""
    fused = backend == "metal" and all(k == v and k in METAL_FUSED_HEAD_DIMS for k, v in head_dims)
    chunk, budget = {"cuda": (2048, 8192), "metal": (2048, 2048), "cpu": (512, 512)}[backend]
    budget = config.max_prefill_tokens or budget
    chunk = min(config.chunked_prefill_size or chunk, budget)
    beside = CUDA_SCORES_BESIDE_DECODE if backend == "cuda" else None
    return StepDefaults(
        backend=backend,
        exact_shapes=backend != "cuda",
        chunk=chunk,
        budget=budget,
        beside_decode=config.long_prefill_scores or beside,
        scores_held=not fused,
        # NOTE: off unless asked for. Where the device sets the pace (Metal, the CPU) the chain
        # gains nothing, and a prefill step hands the KV buffers to async_eval, which MLX's CPU
        # backend then holds while the next step would write them. On CUDA it was the default
        # until seating in flight came with it: 128 agents on an H200 then ran 6.5k tok/s
        # warm (first token p50 0.58 s) and 3.5k cold against 7.8k (0.24 s) and 3.9k without
        # (docs/benchmarks.md, session 47): seats in flight trickle a few prompts into each
        # chained step, where a break seats them all and prefills them in full-size steps.
        prefill_in_chain=config.prefill_in_chain == "on",
    )
