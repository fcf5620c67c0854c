"""Quantized KV pages (`--kv-bits 8|4`): the bytes a token costs, paging that moves codes and
scales as it moves plain KV, and the quality that holds on the default model.

Paging checks compare a quantized engine with itself under pressure (pages for two streams,
preemption, prefix hits, the disk tier): quantization is then the same on both sides, so any
difference is a paging bug. Quality is measured against plain KV on the real default model.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from engine_harness import bounded  # noqa: F401
from mlx_lm.generate import generate_step
from scheduler_util import (
    assert_pages_balanced,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    tiny_model,
    tokens,
)

from engine.config import EngineConfig
from engine.errors import ModelError
from engine.random_model import TINY_LLAMA, make_random_model
from engine.sampling_params import SamplingParams
from scheduler_proc import kv_cache
from scheduler_proc.kv_layout import LayerShape, Layout, bytes_per_token
from scheduler_proc.kv_quant import KVQuant

pytestmark = pytest.mark.usefixtures("bounded")


@pytest.fixture(scope="module")
def plain_llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny llama with heads of 32 (its own 16 is below MLX's smallest quantization group)."""
    shape = {**TINY_LLAMA, "head_dim": 32}
    return tiny_model(make_random_model(tmp_path_factory.mktemp("llama-hd32"), shape))


def make(model, **overrides):
    """A scheduler; `kv_bits` pages in groups of 32 (the tiny heads' width)."""
    if overrides.get("kv_bits"):
        overrides.setdefault("kv_group_size", 32)
    return make_scheduler(model, **overrides)


def test_a_token_costs_what_its_codes_and_scales_hold():
    """Llama-3.2-1B's shape in bf16: 1.88x the tokens at 8 bits, 3.56x at 4 (group 64)."""
    shapes = [LayerShape(8, 64, 64, mx.bfloat16)] * 16
    plain = bytes_per_token(shapes)
    assert plain == 16 * 8 * 128 * 2
    assert plain / bytes_per_token(shapes, KVQuant(8, 64)) == pytest.approx(128 / 68)
    assert plain / bytes_per_token(shapes, KVQuant(4, 64)) == pytest.approx(128 / 36)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_cpus_dequantize_by_ops_is_mlxs(bits, dtype):
    from scheduler_proc.kv_quant import _dequantize_by_ops

    x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(bits)).astype(dtype)
    q = KVQuant(bits, 32)
    codes, scales, biases = mx.quantize(x, group_size=32, bits=bits)
    want = mx.dequantize(codes, scales, biases, group_size=32, bits=bits)
    got = _dequantize_by_ops(codes, scales, biases, q, dtype)
    assert got.shape == x.shape and got.dtype == dtype
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=1e-2).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_the_pool_holds_the_bytes_the_budget_counts(llama, bits):
    sched = make(llama, kv_bits=bits)
    plain = make(llama)
    assert sched.pool.pages == plain.pool.pages
    assert sched.pool.token_bytes < plain.pool.token_bytes
    # NOTE: the budget divides memory by these bytes: --mem-fraction holds more tokens
    assert sched.kv_plan.budget.bytes_per_token == sched.pool.token_bytes
    full = sched.pool.nbytes / plain.pool.nbytes  # NOTE: every layer of the tiny llama is full
    assert full == pytest.approx(sched.pool.token_bytes / plain.pool.token_bytes, rel=0.01)


def _run(sched, prompts: dict[str, list[int]], n: int, at: int = 0) -> dict[str, list[int]]:
    outs = drive(sched, {at: [(rid, p, greedy(n)) for rid, p in prompts.items()]})
    return {rid: tokens(outs[rid]) for rid in prompts}


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_preempted_quantized_streams_equal_unpressed_ones(llama, bits, overlap):
    """Six streams in pages for two: the newest give their codes and scales back and are
    recomputed; each stream equals the same quantized engine with room for all."""
    rng = random.Random(bits)
    prompts = {f"r{i}": random_prompt(rng, 20 + 3 * i) for i in range(6)}
    roomy = make(llama, kv_bits=bits, page_size=4, disable_overlap=not overlap)
    tight = make(
        llama,
        kv_bits=bits,
        page_size=4,
        max_total_tokens=2 * 64,
        max_running_requests=6,
        disable_overlap=not overlap,
    )
    want = _run(roomy, prompts, 40)
    assert _run(tight, prompts, 40) == want
    assert tight.seats.preempted > 0
    assert_pages_balanced(tight)


def test_one_stream_answers_as_mlx_lms_quantized_cache(llama):
    """A single stream (pages in one run: written and read as slices) against mlx-lm's own
    `QuantizedKVCache` at 8 bits: the same greedy tokens for nearly every prompt (mlx-lm
    attends to a prompt's first chunk unquantized and through quantized matmuls after, so a
    rare near-tie may go the other way)."""
    rng = random.Random(0)
    same = 0
    for _ in range(6):
        prompt = random_prompt(rng, rng.randint(5, 90))
        steps = generate_step(
            mx.array(prompt),
            llama,
            max_tokens=24,
            sampler=lambda x: mx.argmax(x, axis=-1),
            kv_bits=8,
            kv_group_size=32,
            quantized_kv_start=0,
        )
        want = [int(t) for t, _ in steps]
        same += _run(make(llama, kv_bits=8), {"a": prompt}, 24)["a"] == want
    assert same >= 4, f"{same} of 6 prompts answered as mlx-lm's quantized cache does"


def test_a_prefix_hit_reads_the_cached_codes(llama):
    """A prompt served again hits its cached pages (a partly filled page copied, codes and
    scales alike) and answers as the first time."""
    rng = random.Random(1)
    prompt = random_prompt(rng, 70)
    sched = make(llama, kv_bits=8, page_size=16)
    first = _run(sched, {"a": prompt}, 12)["a"]
    outs = drive(sched, {0: [("b", prompt + [7], greedy(12)), ("c", prompt[:50], greedy(12))]})
    assert outs["b"][-1].cached_tokens == 70 and outs["c"][-1].cached_tokens == 49
    alone = make(llama, kv_bits=8, page_size=16)
    assert _run(alone, {"b": prompt + [7], "c": prompt[:50]}, 12) == {
        "b": tokens(outs["b"]),
        "c": tokens(outs["c"]),
    }
    assert first == _run(make(llama, kv_bits=8, page_size=16), {"a": prompt}, 12)["a"]
    assert_pages_balanced(sched)


@pytest.mark.parametrize("group_keys", [None, 1], ids=["grouped", "a-row-a-group"])
def test_lone_chunks_several_a_step_read_their_own_quantized_keys(llama, group_keys, monkeypatch):
    """`--long-prefill-chunk` with 8-bit pages: rows whose lone chunks read as many keys are
    gathered and dequantized together (up to `LONE_GROUP_KEYS` keys a group), then each attends
    on its own; every logprob is the padded prefill's (lone chunks off) on the same codes, and
    several rows ran in one step."""
    if group_keys is not None:
        monkeypatch.setattr(kv_cache, "LONE_GROUP_KEYS", group_keys)
    rng = random.Random(5)
    prompts = {f"r{i}": random_prompt(rng, 150 + 29 * i) for i in range(4)}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)

    def logprobs(sched) -> dict[str, list[float]]:
        outs = drive(sched, {0: [(rid, p, params) for rid, p in prompts.items()]})
        return {rid: [lp.logprob for o in outs[rid] for lp in o.logprobs] for rid in prompts}

    kw = dict(kv_bits=8, page_size=16, chunked_prefill_size=64, max_prefill_tokens=256)
    lone = make(llama, long_prefill_chunk=32, **kw)
    rows: list[int] = []
    lone.on_launch = lambda b: rows.append(len(b.slices)) if b.slices and b.slices[0].lone else 0
    got = logprobs(lone)
    assert max(rows) > 1, rows
    want = logprobs(make(llama, long_prefill_chunk=-1, **kw))
    for rid in prompts:
        assert got[rid] == pytest.approx(want[rid], abs=1e-4), rid


@pytest.mark.parametrize("bits", [0, 8])
def test_lone_rows_are_gathered_together_within_the_group_bound(bits, monkeypatch):
    """A step of lone chunks: rows reading as many keys share one gather a layer, never more
    than `LONE_GROUP_KEYS` keys in one (a group's gather is held until its last row is copied
    out); each row still gets its own keys, in row order."""
    monkeypatch.setattr(kv_cache, "LONE_GROUP_KEYS", 200)
    layout = Layout.attention_only([LayerShape(2, 32, 32, mx.float32)])
    quant = KVQuant(bits, 32) if bits else None
    pool = kv_cache.KVPool(layout, 64, 16, slots=6, context=256, chunk=32, quant=quant)
    starts = [64, 64, 64, 64, 32]  # NOTE: four rows of 96 keys (two a group), one of 64
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(5)]
    plan = kv_cache.StepRows(list(range(5)), tables, starts, [32] * 5, 32)
    gathered: list[tuple[int, int]] = []
    real = pool.gather

    def counted(tables, keys, buf, arr=None, run=False):
        gathered.append((len(tables), keys))
        return real(tables, keys, buf, arr, run)

    monkeypatch.setattr(pool, "gather", counted)
    groups = pool.ragged_view(plan, 96, causal=True)[0].groups()
    assert sorted(set(gathered)) == [(1, 64), (2, 96)], gathered  # NOTE: K and V each
    assert [p.keys.shape[2] for p in groups.parts] == [96, 96, 96, 96, 64]
    assert [p.rows for p in groups.parts] == [slice(i, i + 1) for i in range(5)]


def test_the_disk_tier_keeps_quantized_blocks_bit_for_bit(llama, tmp_path):
    rng = random.Random(2)
    system = random_prompt(rng, 300)
    first = make(llama, kv_bits=4, page_size=16, kv_cache_dir=str(tmp_path))
    _run(first, {"a": system + [1, 2]}, 4)
    first.shutdown()
    second = make(llama, kv_bits=4, page_size=16, kv_cache_dir=str(tmp_path))
    outs = drive(second, {0: [("b", system + [3, 4], greedy(4))]})
    assert outs["b"][-1].cached_tokens == 256
    assert second.kv.disk is not None and second.kv.disk.cache.fmt.arrays[0][0] == "uint32"
    prefix = system[:256]
    read = [second.pool.read_tokens(second.prefix.tree.match_prefix(prefix).slots)]
    wrote = [first.pool.read_tokens(first.prefix.tree.match_prefix(prefix).slots)]
    for a, b in zip(read[0], wrote[0], strict=True):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    plain_dir = tmp_path / "plain"
    plain = make(llama, page_size=16, kv_cache_dir=str(plain_dir))
    assert plain.kv.disk is not None and plain.kv.disk.cache.folder.parent == plain_dir
    assert plain.kv.disk.cache.fmt != second.kv.disk.cache.fmt  # NOTE: other files, other keys


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    """The heads-of-32 llama in bfloat16, the dtype whose lanes the quantized kernel takes at
    both widths (`decode_attention.quant_fit`)."""
    shape = {**TINY_LLAMA, "head_dim": 32}
    folder = tmp_path_factory.mktemp("llama-hd32-bf16")
    return tiny_model(make_random_model(folder, shape, dtype=mx.bfloat16))


@pytest.mark.parametrize("bits", [8, 4])
def test_the_fused_decode_reads_quantized_pages_as_the_gathered_decode_does(llama_bf16, bits):
    """`--fused-decode on` (off CUDA, the kernel's masked twin): every full layer's decode reads
    the codes through the page table with their scales and biases (`QuantPages`), and twelve
    streams of different lengths answer as the gathered, dequantized decode."""
    from scheduler_proc import decode_attention

    rng = random.Random(bits)
    prompts = {f"r{i}": random_prompt(rng, 20 + 37 * i) for i in range(12)}
    want = _run(make(llama_bf16, kv_bits=bits, page_size=16), prompts, 16)
    fused = make(llama_bf16, kv_bits=bits, page_size=16, fused_decode="on")
    assert fused.runner.fused_decode
    before = decode_attention.counts.calls
    assert _run(fused, prompts, 16) == want
    assert decode_attention.counts.calls > before


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kv_bits": 3}, "kv_bits"),
        ({"kv_bits": 8, "kv_group_size": 16}, "kv_group_size"),
    ],
)
def test_settings_that_cannot_hold_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides).validate()


def test_a_group_that_does_not_divide_the_head_dim_is_named(plain_llama):
    with pytest.raises(ModelError, match="head dim 16: use one of none"):
        make_scheduler(plain_llama, kv_bits=8, kv_group_size=32)


# -- quality on the default model ------------------------------------------------------------------
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish.",
    "Give me a short tip for writing clear emails.",
]


@pytest.fixture(scope="module")
def default_model(default_model_dir):
    from engine.tokenizer_loader import load_tokenizer
    from scheduler_proc.model_loader import load_for_scheduler

    model, _ = load_for_scheduler(str(default_model_dir), EngineConfig())
    tok = load_tokenizer(default_model_dir)
    prompts = {
        f"q{i}": tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        for i, q in enumerate(QUESTIONS)
    }
    return model, prompts


def _greedy_with_logprobs(model, prompts, n: int, **overrides):
    """Each prompt's greedy tokens and their logprobs, the KV format alone changed: no
    speculation, whose verify chunks' other matrix shapes move the default model's one
    near-tie (docs/kv_cache.md, "A near-tie, not a bug")."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    sched = make_scheduler(model, **{"spec": "off", **overrides})
    outs = drive(sched, {0: [(rid, p, params) for rid, p in prompts.items()]})
    return {
        rid: (
            [t for o in outs[rid] for t in o.token_ids],
            [lp.logprob for o in outs[rid] for lp in o.logprobs],
        )
        for rid in prompts
    }


def test_8_bit_kv_answers_the_default_models_questions_as_plain_kv(default_model):
    """Greedy, 48 tokens of each of 8 chat questions: identical with 8-bit pages; with 4-bit
    pages the chosen tokens' logprobs stay close while the answers agree."""
    model, prompts = default_model
    plain = _greedy_with_logprobs(model, prompts, 48)
    eight = _greedy_with_logprobs(model, prompts, 48, kv_bits=8)
    assert {r: t for r, (t, _) in eight.items()} == {r: t for r, (t, _) in plain.items()}
    four = _greedy_with_logprobs(model, prompts, 48, kv_bits=4)
    errors = []
    for rid, (want, lps) in plain.items():
        got, got_lps = four[rid]
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), 48)
        errors += [abs(a - b) for a, b in zip(lps[:same], got_lps[:same], strict=True)]
    # NOTE: 4 bits moves this small model's answers early (34 of 384 positions agree before
    # the first difference, measured): what is held is the error while they agree
    assert len(errors) >= 16, "4-bit answers left plain KV's at once"
    assert float(np.mean(errors)) < 0.25


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_rings_and_recurrent_state_stay_plain_beside_quantized_pages(family, tmp_path):
    """A windowed and a hybrid model (heads of 32): their rings and state are not quantized,
    their full-attention pages are; prefix hits (restoring a slot's snapshot with the pages)
    and every stream given back mid-decode and recomputed answer as the same quantized engine
    with no cache, left alone."""
    from engine.random_model import TINY_FAMILIES
    from scheduler_proc.kv_quant import QuantBuffer

    model = tiny_model(make_random_model(tmp_path, {**TINY_FAMILIES[family], "head_dim": 32}))
    rng = random.Random(3)
    system = random_prompt(rng, 40)
    prompts = {f"r{i}": system + random_prompt(rng, 5 + 3 * i) for i in range(6)}
    alone = make(model, kv_bits=8, page_size=4, disable_radix_cache=True)
    quantized = [isinstance(b, QuantBuffer) for b in alone.pool.keys]
    assert any(quantized) and (not all(quantized) or alone.pool.states)
    want = _run(alone, prompts, 24)
    sched = make(model, kv_bits=8, page_size=4)
    _run(sched, {"warm": system}, 2)  # NOTE: the system prompt cached, its snapshot taken
    for rid, p in prompts.items():
        sched.submit(rid, p, greedy(24))
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    steps = 0
    while sched.has_work():
        for chunk in sched.step():
            got[chunk.rid] += chunk.token_ids
        steps += 1
        if steps == 12:  # NOTE: mid-decode: every stream gives its pages back, recomputed
            sched.quiesce()
            assert sched.retract_running() == 6
    assert got == want
    assert sched.prefix is not None and sched.prefix.hit_tokens > 0
