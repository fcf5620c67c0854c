"""Each backend's step defaults, and what they make of a 32k prompt beside decoding rows (pure
planning, no model): Metal's fused attention holds no scores, so its chunks stay whole."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from scheduler_proc.backend import step_defaults
from scheduler_proc.prefill_plan import PrefillPlanner
from scheduler_proc.request import Req
from scheduler_proc.shapes import Ladders

LLAMA_1B = [(64, 64)] * 16  # NOTE: (key, value) head dims of the full-attention layers
PROMPT = 32768


def _planner(backend: str, dims=LLAMA_1B, **options) -> tuple[PrefillPlanner, Ladders]:
    d = step_defaults(EngineConfig(**options), backend, dims)
    ladders = Ladders.for_pool(slots=64, context=131072, chunk=d.chunk, exact=d.exact_shapes)
    planner = PrefillPlanner(
        d.chunk, d.budget, heads=32, beside_decode=d.beside_decode, scores_held=d.scores_held
    )
    return planner, ladders


def _widths(planner: PrefillPlanner, ladders: Ladders, n: int = PROMPT) -> list[int]:
    """The chunk widths of one prompt of `n` tokens planned beside decoding rows, step by step."""
    req = Req("long", list(range(n)), SamplingParams(max_tokens=8), 0, 8, frozenset())
    widths: list[int] = []
    while req.prefilled < n - 1:  # NOTE: the last token runs with the decode rows
        (chunk,) = planner.plan([req], ladders, decoding=True).chunks
        widths.append(chunk[1])
        req.prefilled += chunk[1]
    return widths


@pytest.mark.timeout(60)
def test_a_32k_prompt_beside_decodes_runs_in_whole_chunks_on_metal():
    """16 forwards of 2048 tokens (the last one short by the token left for decode)."""
    assert _widths(*_planner("metal")) == [2048] * 15 + [2047]


@pytest.mark.timeout(60)
def test_a_metal_head_dim_without_the_fused_kernel_keeps_the_score_bound():
    """Head dim 96 is not one `sdpa_full` takes: the scores are held, and the late chunks of a
    long prompt narrow so they fit (a 1 GiB bound of float32 scores)."""
    widths = _widths(*_planner("metal", dims=[(96, 96)] * 16))
    assert sum(widths) == PROMPT - 1 and len(widths) > 16 and min(widths) < 2048


@pytest.mark.timeout(60)
def test_cuda_caps_a_long_prompts_steps_beside_decodes():
    """CUDA's bound beside decode keeps each step to a few ms: a 32k prompt's chunks narrow to
    a few dozen tokens (the ~340 forwards Metal had with CUDA's defaults)."""
    widths = _widths(*_planner("cuda"))
    assert sum(widths) == PROMPT - 1 and len(widths) > 300


@pytest.mark.timeout(60)
def test_defaults_by_backend_and_options_first():
    cuda, metal, cpu = (
        step_defaults(EngineConfig(), b, LLAMA_1B) for b in ("cuda", "metal", "cpu")
    )
    assert not cuda.exact_shapes and metal.exact_shapes and cpu.exact_shapes
    assert (cuda.chunk, cuda.budget) == (2048, 8192) and (cpu.chunk, cpu.budget) == (512, 512)
    assert cpu.scores_held and cuda.scores_held and not metal.scores_held
    assert metal.beside_decode is None and cpu.beside_decode is None
    # NOTE: prompts off the chain everywhere unless asked for (on a GPU they lost 1.2x on agents)
    assert not (cuda.prefill_in_chain or metal.prefill_in_chain or cpu.prefill_in_chain)
    on = step_defaults(EngineConfig(prefill_in_chain="on"), "cuda", LLAMA_1B)
    assert on.prefill_in_chain
    set_ = step_defaults(
        EngineConfig(chunked_prefill_size=1024, max_prefill_tokens=4096, long_prefill_scores=7),
        "metal",
        LLAMA_1B,
    )
    assert (set_.chunk, set_.budget, set_.beside_decode) == (1024, 4096, 7)
