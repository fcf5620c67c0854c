"""Every tested architecture family, token for token with mlx-lm's own `generate_step`.

Tiny random models of each family (`engine.random_model.TINY_FAMILIES`): plain attention (llama,
qwen3, phi3), mixture of experts (qwen3_moe, gpt_oss), sliding-window layers (gemma3_text,
gemma4_text, gpt_oss with attention sinks, ministral3; a 16-token window, so prompts and decodes
cross it) and hybrid recurrent layers (qwen3_next and qwen3_5: gated delta net, nemotron_h and
granitemoehybrid: Mamba-2, lfm2: short convolutions). Greedy, staggered arrivals under continuous
batching, chunked prefill (chunk 8 < window), the prefix cache on and off, overlap on and off.
"""

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

from engine.random_model import TINY_FAMILIES, TINY_WINDOW, make_random_model

WINDOWED = ["gemma3_text", "gemma4_text", "gpt_oss", "ministral3"]
HYBRID = ["qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid", "lfm2"]
FAMILIES = ["qwen3_moe", "phi3", *WINDOWED, *HYBRID]

# NOTE: around the window (16) and the chunk (8): 1-token prompts, one chunk, a chunk and a
# one-token tail, prompts crossing the window once and several times.
PROMPT_LENS = [1, 2, 7, 8, 9, 15, 16, 17, 24, 31, 33, 40, 57, 90]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    path = make_random_model(tmp_path_factory.mktemp(name), TINY_FAMILIES[name])
    return name, tiny_model(path)


def _workload(seed: int, lens: list[int] = PROMPT_LENS):
    rng = random.Random(seed)
    reqs = []
    for i, n in enumerate(lens):
        # NOTE: up to 30 new tokens, so decodes cross the window too.
        reqs.append((f"r{i}", random_prompt(rng, n), rng.randint(1, 30), rng.randint(0, 30)))
    return reqs


def _run(model, reqs, buckets: bool = False, launches: list | None = None, **overrides):
    base = dict(chunked_prefill_size=8, max_prefill_tokens=32)
    sched = make_scheduler(model, **{**base, **overrides})
    if buckets:
        bucketed(sched)
    if launches is not None:
        sched.on_launch = launches.append
    forwards = count_forwards(sched)
    arrivals: dict = {}
    for rid, prompt, max_tokens, at in reqs:
        arrivals.setdefault(at, []).append((rid, prompt, greedy(max_tokens)))
    return sched, drive(sched, arrivals), forwards


def _check(model, reqs, launches: list | None = None, **overrides):
    sched, outs, forwards = _run(model, reqs, launches=launches, **overrides)
    for rid, prompt, max_tokens, _ in reqs:
        assert tokens(outs[rid]) == reference_greedy(model, prompt, max_tokens), rid
        assert outs[rid][-1].finish_reason == "length"
    stats = sched.stats()
    assert stats["kv_tokens_in_use"] == 0 and stats["kv_slots_in_use"] == 0
    assert_pages_balanced(sched)
    assert forwards == [1] * stats["steps_launched"]
    return sched


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_parity(family, overlap):
    _, model = family
    sched = _check(model, _workload(1), disable_overlap=not overlap)
    if overlap:
        assert sched.stats()["steps_chained"] > 0


# NOTE: the start-up check keeps the masked decode for these: attention sinks (the kernel has
# none), and layers reusing another layer's KV, whose attention never asks the cache for lengths.
KEEP_THE_MASK = {"gpt_oss", "gemma4_text"}


@pytest.mark.parametrize(
    "fused,prefill", [("off", "fast"), ("on", "ops")], ids=["as-on-metal", "as-on-cuda"]
)
def test_greedy_parity_with_gpu_shape_buckets(family, fused, prefill):
    """Padded rows, widths and key lengths: padding must not reach any row's KV or state. The
    steps as on Metal (masked decode, MLX's fast attention for prompt chunks) and as on CUDA
    (fused decode: whole buffers and row lengths for full-attention layers, the window layers
    still masked; prompt chunks attending by MLX's ops, `prefill_attention`)."""
    name, model = family
    sched = _check(model, _workload(2), buckets=True, fused_decode=fused, prefill_attention=prefill)
    assert sched.runner.fused_decode is (fused == "on" and name not in KEEP_THE_MASK)
    assert sched.runner.prefill_by_ops is (prefill == "ops")


def test_greedy_parity_prefix_cache_on_and_off(family):
    """Shared prefixes (longer than the window) hit where the model allows it; same tokens."""
    name, model = family
    rng = random.Random(3)
    system = random_prompt(rng, 3 * TINY_WINDOW)
    reqs = [(f"s{i}", system + random_prompt(rng, 5 + 7 * i), 6, 25 * i) for i in range(4)]
    for cache in (True, False):
        sched = _check(model, reqs, disable_radix_cache=not cache)
        hits = sched.stats().get("prefix_cache_hit_tokens", 0)
        if not cache:
            assert hits == 0
        elif name in WINDOWED or name in HYBRID:
            # NOTE: rings and recurrent state come back from a snapshot: the first request that
            # shares the system prompt takes one where the sharing ends, the later ones hit it.
            assert hits >= 2 * len(system), hits
        else:
            assert hits >= 3 * len(system), hits


def test_greedy_parity_with_prompts_beside_the_chain(family):
    """`--prefill-in-chain on`: prompts prefill in steps queued beside chained decode steps,
    sliding windows and recurrent state included; shared prefixes still hit, their snapshots
    taken while nothing is in flight (the chain breaks at a snapshot point)."""
    name, model = family
    rng = random.Random(4)
    system = random_prompt(rng, 3 * TINY_WINDOW)
    reqs = [(f"s{i}", system + random_prompt(rng, 5 + 7 * i), 20, 25 * i) for i in range(4)]
    reqs += [(f"r{i}", random_prompt(rng, 40 + 9 * i), 24, 2 * i) for i in range(4)]
    launches: list = []
    sched = _check(model, reqs, launches=launches, prefill_in_chain="on")
    assert any(b.is_prefill and b.chained for b in launches)
    if name in WINDOWED or name in HYBRID:
        assert sched.stats()["prefix_cache_hit_tokens"] >= 2 * len(system)


def test_the_family_models_see_their_context(family):
    """Changing only the first prompt token (out of the window of a sliding layer) changes the
    output, and the output is not one token repeated: a KV, window or state bug shows."""
    _, model = family
    rng = random.Random(0)
    changed = 0
    for _ in range(8):
        prompt = random_prompt(rng, rng.randint(20, 60))
        other = [(prompt[0] + 1) % 49152, *prompt[1:]]
        out = reference_greedy(model, prompt, 16)
        changed += out != reference_greedy(model, other, 16)
        assert len(set(out)) > 1, out
    assert changed >= 4


def test_a_model_with_an_unsupported_cache_kind_is_refused(tmp_path):
    """The named error, not a wrong answer: a chunked-attention cache has no rows in the pool."""
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    from engine.errors import ModelError

    model = tiny_model(make_random_model(tmp_path, TINY_FAMILIES["llama"]))
    model.make_cache = lambda: [ChunkedKVCache(16), KVCache()]
    try:
        with pytest.raises(ModelError, match="unsupported cache types .*ChunkedKVCache"):
            make_scheduler(model)
    finally:
        del model.make_cache


def test_a_reused_row_starts_from_a_clean_state(family):
    """Short prompts on rows that longer requests just left (and rows moved into the holes):
    a recurrent state left behind would change their first tokens."""
    _, model = family
    rng = random.Random(4)
    reqs = [(f"long{i}", random_prompt(rng, 40 + i), 3 + 2 * i, 0) for i in range(3)]
    reqs += [(f"short{i}", random_prompt(rng, 1 + i % 3), 4, 20 + 3 * i) for i in range(6)]
    _check(model, reqs)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_window_layers_keep_a_ring_of_window_plus_chunk(name, tmp_path):
    """A window layer's memory per row is bounded by its window (plus one chunk), not the row."""
    model = tiny_model(make_random_model(tmp_path, TINY_FAMILIES[name]))
    sched = make_scheduler(model, chunked_prefill_size=8)
    pool, plan = sched.pool, sched.kv_plan
    for k, ring in zip(pool.keys, pool.rings, strict=True):
        if ring is None:  # NOTE: full attention: pages of tokens
            assert k.shape[1] == (pool.pages + 1) * plan.page_size
        else:
            assert ring == TINY_WINDOW + 8 - 1
            assert (k.shape[0], k.shape[2]) == (plan.slots + 1, ring)
    # NOTE: the budget counts the rings (and a snapshot of each slot), not full rows: what it
    # plans is what the pool holds once grown to its capacity, to a token per slot.
    bpt = plan.budget.bytes_per_token
    at_capacity = pool.nbytes + (pool.capacity - pool.pages) * plan.page_size * bpt
    slot = plan.slot_tokens * bpt
    snapshots = (plan.slots + 1) * slot // 2
    assert 0 <= plan.allocated_tokens * bpt - at_capacity - snapshots <= (plan.slots + 1) * bpt


@pytest.mark.parametrize("name", WINDOWED)
def test_a_prefix_hit_needs_its_whole_window(name, tmp_path):
    """A cached prefix ending where the ring layers' tokens were no longer kept (they had left
    the request's ring before it was saved) is cut back to where the whole window is stored."""
    model = tiny_model(make_random_model(tmp_path, TINY_FAMILIES[name]))
    rng = random.Random(5)
    long = random_prompt(rng, 90)
    reqs = [
        ("long", long, 4, 0),
        ("early", long[:40] + random_prompt(rng, 6), 5, 40),  # its window left long's ring
        ("late", long + random_prompt(rng, 6), 5, 40),  # the whole prompt: window stored
    ]
    sched, outs, _ = _run(model, reqs)
    for rid, prompt, max_tokens, _ in reqs:
        assert tokens(outs[rid]) == reference_greedy(model, prompt, max_tokens), rid
    assert outs["late"][-1].cached_tokens >= len(long) - 1
    assert outs["early"][-1].cached_tokens < 40 - TINY_WINDOW


@pytest.mark.parametrize("name", WINDOWED)
def test_greedy_parity_window_layers_without_a_ring(name, tmp_path):
    """Rows too short for a ring to save anything (window + chunk - 1 >= row): window layers keep
    the whole row and attend through the window mask; a lone decode row reads its last W keys."""
    model = tiny_model(make_random_model(tmp_path, TINY_FAMILIES[name]))
    rng = random.Random(6)
    reqs = [(f"r{i}", random_prompt(rng, n), 60 - n, 3 * i) for i, n in enumerate([1, 9, 20, 33])]
    reqs.append(("alone", random_prompt(rng, 30), 30, 200))  # NOTE: decodes as a lone row
    sched = _check(model, reqs, context_length=64, chunked_prefill_size=64, max_prefill_tokens=64)
    assert {r for r in sched.pool.rings if r is not None} == {64}


def test_unpadded_prefill_only_where_padding_reaches_the_state(family):
    """The start-up probe (`state_padding`): nemotron_h's Mamba scan takes no lengths, so its
    prefill chunks run unpadded; every other family pads (its layers honour `cache.lengths`)."""
    name, model = family
    assert make_scheduler(model).runner.uniform_prefill == (name == "nemotron_h")
