"""Greedy parity with mlx-lm, token for token: staggered arrivals, long prompts, tiny chunks."""

from __future__ import annotations

import random

import pytest
from scheduler_util import (
    assert_pages_balanced,
    bucketed,
    count_forwards,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.sampling_params import SamplingParams
from scheduler_proc import decode_attention, prefill_attention

# NOTE: 17 and 33 leave a one-token last chunk at chunk size 16; 1 is a one-token prompt.
PROMPT_LENS = [1, 2, 15, 16, 17, 33, 64, 100, 257, 300, 511, 700, 1023, 1100, 1500, 5, 40, 9]


def _workload(seed: int):
    rng = random.Random(seed)
    reqs = []
    for i, n in enumerate(PROMPT_LENS):
        prompt = random_prompt(rng, n)
        max_tokens = rng.randint(1, 24)
        reqs.append((f"r{i}", prompt, max_tokens, rng.randint(0, 40)))  # arrival step
    return reqs


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_weights_dir):
    return tiny_model(tiny_qwen3_weights_dir)


def _check_parity(
    model, overlap: bool, buckets: bool = False, fused: bool = False, ops: bool = False
) -> None:
    sched = make_scheduler(
        model,
        chunked_prefill_size=16,
        max_prefill_tokens=64,
        disable_overlap=not overlap,
        fused_decode="on" if fused else "auto",
        prefill_attention="ops" if ops else "auto",
    )
    ops = ops or prefill_attention.by_ops("auto")  # NOTE: on CUDA prompt chunks take ops
    assert sched.runner.prefill_by_ops is ops
    ops_before = decode_attention.counts.prefill_ops
    fused = fused or decode_attention.available()  # NOTE: on CUDA the fused path is the default
    assert sched.runner.fused_decode is fused
    fused_before = decode_attention.counts.calls
    if buckets:
        bucketed(sched)
    forwards = count_forwards(sched)
    reqs = _workload(seed=1)
    arrivals: dict = {}
    for rid, prompt, max_tokens, at in reqs:
        arrivals.setdefault(at, []).append((rid, prompt, greedy(max_tokens)))
    outs = drive(sched, arrivals)
    for rid, prompt, max_tokens, _ in reqs:
        assert tokens(outs[rid]) == reference_greedy(model, prompt, max_tokens), rid
        assert outs[rid][-1].finish_reason == "length"
        assert outs[rid][-1].completion_tokens == max_tokens
    stats = sched.stats()
    assert stats["kv_tokens_in_use"] == 0 and stats["kv_slots_in_use"] == 0
    assert_pages_balanced(sched)
    if overlap:
        assert stats["steps_chained"] > 0
    # NOTE: one model forward per step, prefill steps and decode steps alike.
    assert forwards == [1] * stats["steps_launched"]
    assert stats["steps_prefill"] > 0 and stats["steps_decode"] > 0
    assert (decode_attention.counts.calls > fused_before) is fused
    assert (decode_attention.counts.prefill_ops > ops_before) is ops


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_parity_llama(llama, overlap):
    _check_parity(llama, overlap)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_parity_with_gpu_shape_buckets_after_the_warm_up(llama, overlap):
    """Padded rows, widths and key lengths (the GPU path) after every warm-up shape ran."""
    _check_parity(llama, overlap, buckets=True)


def test_greedy_parity_qwen3(qwen3):
    _check_parity(qwen3, overlap=True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_parity_with_the_fused_decode(llama, overlap):
    """Decode steps over whole buffers and row lengths (the CUDA path), bucketed shapes."""
    _check_parity(llama, overlap, buckets=True, fused=True)


def test_greedy_parity_qwen3_with_the_fused_decode(qwen3):
    _check_parity(qwen3, overlap=True, fused=True)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_greedy_parity_on_the_cuda_paths(model, request):
    """The CUDA defaults: the fused decode, and prompt chunks attending by MLX's ops
    (`prefill_attention`), bucketed shapes, the overlap loop."""
    _check_parity(request.getfixturevalue(model), overlap=True, buckets=True, fused=True, ops=True)


def test_overlap_and_sync_agree_with_eos(llama):
    """Both loops stop on the same eos token and report the same outputs."""
    rng = random.Random(3)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(1, 80))] for _ in range(12)]
    ref = [reference_greedy(llama, p, 12) for p in prompts]
    eos = ref[0][3]  # a token the first request emits, so at least one stops early
    results = []
    for overlap in (True, False):
        sched = make_scheduler(llama, eos=(eos,), disable_overlap=not overlap)
        params = SamplingParams(max_tokens=12, temperature=0.0)
        outs = drive(sched, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
        results.append({rid: (tokens(o), o[-1].finish_reason) for rid, o in outs.items()})
    assert results[0] == results[1]
    toks, reason = results[0]["r0"]
    assert reason == "stop" and toks == ref[0][: ref[0].index(eos) + 1]
