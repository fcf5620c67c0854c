"""The paged KV pool through the scheduler: pages crossed, preemption, sharing, the defaults.

Every parity check compares with mlx-lm's own greedy generation on a tiny random model that sees
its context (tests/test_context_sensitive.py), so KV read from a wrong page changes tokens.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from scheduler_util import (
    assert_pages_balanced,
    bucketed,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from scheduler_proc import decode_attention
from scheduler_proc.kv_budget import MAX_AUTO_RUNNING, TYPICAL_REQUEST_TOKENS
from scheduler_proc.scheduler import Scheduler


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _parity(sched: Scheduler, model, reqs) -> dict:
    arrivals: dict = {}
    for rid, prompt, n, at in reqs:
        arrivals.setdefault(at, []).append((rid, prompt, greedy(n)))
    outs = drive(sched, arrivals)
    for rid, prompt, n, _ in reqs:
        assert tokens(outs[rid]) == reference_greedy(model, prompt, n), rid
        assert outs[rid][-1].completion_tokens == n
    assert_pages_balanced(sched)
    return outs


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_prompts_and_outputs_crossing_pages(llama, page_size, overlap):
    """Prompts ending one before, on and after a page boundary, chunks that cross pages, decode
    that opens new pages: every token as mlx-lm's."""
    rng = random.Random(page_size)
    lens = [page_size - 1 or 1, page_size, page_size + 1, 3 * page_size + 2, 37, 70]
    reqs = [(f"r{i}", random_prompt(rng, n), 2 * page_size + 3, i) for i, n in enumerate(lens)]
    sched = make_scheduler(
        llama, page_size=page_size, chunked_prefill_size=8, disable_overlap=not overlap
    )
    _parity(sched, llama, reqs)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_preempted_streams_are_identical_to_uninterrupted_ones(llama, overlap):
    """Too few pages for every stream to finish: the newest give their pages back mid-decode and
    are recomputed; each stream still equals mlx-lm's, no token lost, repeated or reordered."""
    rng = random.Random(7)
    reqs = [(f"r{i}", random_prompt(rng, 20 + 3 * i), 40, 0) for i in range(6)]
    # NOTE: 6 x (20..35 + 40) tokens need ~400; 160 tokens of pages hold about two at a time.
    sched = make_scheduler(
        llama,
        page_size=4,
        max_total_tokens=160,
        context_length=160,
        max_running_requests=6,
        disable_overlap=not overlap,
    )
    outs = _parity(sched, llama, reqs)
    assert sched.stats()["requests_preempted"] > 0
    for rid, _, n, _ in reqs:
        assert [o.finish_reason for o in outs[rid]][-1] == "length"
        assert sum(len(o.token_ids) for o in outs[rid]) == n


def test_preemption_with_the_prefix_cache_and_bucketed_shapes(llama):
    """Preempted requests recompute through the prefix cache (their own KV, cached when they
    gave their pages back), on the GPU's padded shapes."""
    rng = random.Random(8)
    system = random_prompt(rng, 24)
    reqs = [(f"r{i}", system + random_prompt(rng, 5 + i), 30, 2 * i) for i in range(6)]
    sched = make_scheduler(
        llama, page_size=4, max_total_tokens=192, context_length=128, max_running_requests=6
    )
    bucketed(sched)
    _parity(sched, llama, reqs)
    stats = sched.stats()
    assert stats["requests_preempted"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_concurrent_hits_share_pages_and_copy_only_the_partial_one(llama):
    """Eight requests on one system prompt run at once: they hold its whole pages together (the
    pages in use are far fewer than their tokens) and each copies at most the partly filled one."""
    rng = random.Random(9)
    system = random_prompt(rng, 64 + 6)  # NOTE: 4 whole pages of 16 and 6 tokens of a fifth
    reqs = [(f"r{i}", system + random_prompt(rng, 3 + i), 24, 0) for i in range(8)]
    sched = make_scheduler(llama, page_size=16)
    seen: list[tuple[int, int]] = []

    def on_launch(batch) -> None:
        if len(batch.decode) == 8:
            stats = sched.stats()
            seen.append((stats["kv_request_tokens_allocated"], stats["kv_tokens_in_use"]))
            tables = [r.pages for r in batch.decode]
            assert all(t[:4] == tables[0][:4] for t in tables), "whole pages not shared"
            assert len({t[4] for t in tables}) == 8, "a partly filled page shared, not copied"

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert seen, "the eight never decoded together"
    allocated, held = seen[0]
    assert allocated < 0.6 * held, (allocated, held)
    assert sched.stats()["prefix_cache_hit_tokens"] >= 7 * len(system)


def test_hits_seated_together_copy_their_partial_pages_at_once(llama):
    """Requests seated in one pass, each hitting a cached prompt's partly filled page, copy
    those pages in one copy: each copy waits for the device twice (196 hits of a wave, one at a
    time, held the H200's next step 1.2 s). Their streams are still mlx-lm's own."""
    rng = random.Random(11)
    system = random_prompt(rng, 64 + 6)  # NOTE: 4 whole pages of 16 and 6 tokens of a fifth
    sched = make_scheduler(llama, page_size=16)
    _parity(sched, llama, [("first", system + random_prompt(rng, 4), 4, 0)])
    copies: list[int] = []
    real = sched.pool.copy_tokens

    def counted(src: list[int], dst: list[int]) -> None:
        copies.append(len(src))
        real(src, dst)

    sched.pool.copy_tokens = counted  # type: ignore[method-assign]
    _parity(sched, llama, [(f"r{i}", system + random_prompt(rng, 3 + i), 8, 0) for i in range(8)])
    assert copies == [8 * 6], copies


def test_a_flood_is_seated_without_comparing_every_prompt_with_every_other(llama, monkeypatch):
    """Whether a waiting request shares a prefix with a prompt being prefilled is asked of two
    sorted neighbours, not of each such prompt: compared with each, a seating pass of W waiting
    and P prefilling requests made W x P comparisons (0.2 s a pass for 256 at once on this CPU)."""
    from scheduler_proc import prefix_cache

    asked, compared = [0], [0]
    real_wait, real_common = prefix_cache.PrefixCache.should_wait, prefix_cache.common_prefix

    def should_wait(self, *args):
        asked[0] += 1
        return real_wait(self, *args)

    def common_prefix(a, b):
        compared[0] += 1
        return real_common(a, b)

    monkeypatch.setattr(prefix_cache.PrefixCache, "should_wait", should_wait)
    monkeypatch.setattr(prefix_cache, "common_prefix", common_prefix)
    rng = random.Random(12)
    sched = make_scheduler(llama)
    drive(sched, {0: [(f"r{i}", random_prompt(rng, 24), greedy(2)) for i in range(96)]})
    assert asked[0] >= 96 and compared[0] <= 2 * asked[0], (asked, compared)


def test_kv_in_use_follows_the_tokens_held(llama):
    """Memory held by running requests is their tokens, rounded up to whole pages, nothing more:
    no row reserved at the longest allowed request."""
    rng = random.Random(10)
    reqs = [(f"r{i}", random_prompt(rng, 10 + 13 * i), 12, 0) for i in range(12)]
    sched = make_scheduler(llama, page_size=16, context_length=4096, disable_radix_cache=True)
    worst = []

    def on_launch(batch) -> None:
        rows = batch.rows
        if rows:
            held = sum(r.kv_len for r in rows)
            pages = sum(len(r.pages) for r in rows)
            worst.append(pages * 16 - held)
            assert pages * 16 - held < 16 * len(rows) + 16, "more than one partial page each"

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert worst


def test_a_prompt_longer_than_the_context_names_the_limit(llama):
    sched = make_scheduler(llama, context_length=64)
    with pytest.raises(InvalidRequest, match=r"context holds 64.*--context-length"):
        sched.submit("r", [1] * 64, greedy(1))


def test_defaults_are_the_models_context_and_what_memory_holds(llama):
    """No --context-length: the model's own limit; no --max-running-requests: the budget at a
    typical request size, capped; both said in the plan's description."""
    budget = 300 * TYPICAL_REQUEST_TOKENS
    sched = Scheduler(EngineConfig(max_total_tokens=budget), llama, ())
    plan = sched.kv_plan
    assert plan.context == llama.args.max_position_embeddings
    assert plan.slots == min(MAX_AUTO_RUNNING, budget // TYPICAL_REQUEST_TOKENS)
    text = plan.describe()
    assert "max_position_embeddings" in text and f"at most {MAX_AUTO_RUNNING}" in text
    assert "the budget holds 300: --max-running-requests runs more" in text
    small = Scheduler(EngineConfig(max_total_tokens=5 * TYPICAL_REQUEST_TOKENS), llama, ())
    assert small.kv_plan.slots == 5 and "runs more" not in small.kv_plan.describe()
    tiny = Scheduler(EngineConfig(max_total_tokens=1000), llama, ())
    assert tiny.kv_plan.context <= tiny.kv_plan.tokens and "cut to" in tiny.kv_plan.describe()


def test_long_prompts_take_narrower_chunks_as_their_keys_grow(llama, monkeypatch):
    """A prefill step's attention scores stay within PREFILL_SCORES_MAX: fewer rows, then
    narrower chunks, as a long prompt's keys grow; every token as mlx-lm's."""
    from scheduler_proc import prefill_plan

    heads = llama.args.num_attention_heads
    limit = 64 * 256  # NOTE: per head: 64 queries over 256 keys
    monkeypatch.setattr(prefill_plan, "PREFILL_SCORES_MAX", limit * heads)
    rng = random.Random(11)
    reqs = [(f"r{i}", random_prompt(rng, n), 4, 0) for i, n in enumerate([700, 90, 300])]
    sched = make_scheduler(llama, chunked_prefill_size=256, max_prefill_tokens=512)
    widths: list[int] = []

    def on_launch(batch) -> None:
        if batch.slices:
            width = max(c.end - c.start for c in batch.slices)
            keys = max(c.end for c in batch.slices)
            assert len(batch.slices) * width * keys <= limit or width <= 16
            widths.append(width)

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert max(widths) >= 64 and min(widths) <= 32, widths


def test_long_prompts_later_chunks_stay_small_while_others_decode(llama):
    """While requests decode, a long prompt's later chunks (more keys than one chunk) run in
    steps of their own within --long-prefill-scores: on an H200 such steps at the full bound
    took the chats beside 4 prompts of 32k tokens from 7 to 50 ms between tokens. Short prompts'
    steps keep the full bound, and with nothing decoding long chunks do too; every token as
    mlx-lm's."""
    limit, chunk = 32 * 256, 64
    rng = random.Random(14)
    reqs = [(f"long{i}", random_prompt(rng, 900), 3, 0) for i in range(2)]
    reqs += [(f"chat{i}", random_prompt(rng, 30), 12, 0) for i in range(3)]
    reqs += [(f"mid{i}", random_prompt(rng, 60), 12, 8) for i in range(4)]
    reqs += [("late", random_prompt(rng, 20), 12, 60)]
    sched = make_scheduler(
        llama, chunked_prefill_size=chunk, max_prefill_tokens=256, long_prefill_scores=limit
    )
    beside: list[int] = []
    alone: list[int] = []
    short: list[int] = []

    def on_launch(batch) -> None:
        if not batch.slices:
            return
        width = max(c.end - c.start for c in batch.slices)
        keys = max(c.end for c in batch.slices)
        scores = len(batch.slices) * width * keys
        if keys <= chunk:
            short.append(scores)
        elif sched.running.n_decode:
            assert all(c.end > chunk for c in batch.slices), "a short chunk in a long one's step"
            assert scores <= limit or width <= 16
            beside.append(width)
        else:
            alone.append(width)

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert beside and alone and min(beside) < chunk == max(alone), (beside, alone)
    assert max(short) > limit, short


@pytest.mark.parametrize("warm", [False, True], ids=["exact", "bucketed"])
def test_long_prompts_later_chunks_run_alone_by_the_causal_kernel(llama, warm):
    """--long-prefill-chunk: a later chunk starting on a multiple of it is a lone chunk, padded
    to it, its keys ending on a multiple of it (bottom-right causal, no mask), in a step of lone
    chunks only, several a step, each row attending on its own: a prefix hit is cut back to a
    multiple when the rest crosses one, chunks that start off a multiple end on one first, the
    last chunk is padded, chats decode beside; every token as mlx-lm's. Bucketed: the GPU's
    shapes, each warmed before the first request."""
    w = 32
    rng = random.Random(15)
    system = random_prompt(rng, 75)  # NOTE: a hit of 75 tokens starts off a multiple of 32
    reqs = [(f"long{i}", random_prompt(rng, 300 + 37 * i), 3, 0) for i in range(2)]
    reqs += [("sys", system + random_prompt(rng, 20), 4, 0)]
    reqs += [(f"chat{i}", random_prompt(rng, 20), 24, 0) for i in range(3)]
    reqs += [("hit", system + random_prompt(rng, 230), 6, 30)]
    sched = make_scheduler(
        llama, chunked_prefill_size=64, max_prefill_tokens=128, long_prefill_chunk=w
    )
    if warm:
        bucketed(sched)
    assert sched.runner.long_chunk == sched.planner.long_chunk == w
    assert decode_attention.install(llama)  # NOTE: counts the attention calls (as on CUDA)
    before = decode_attention.counts.prefill_causal
    lone: list[tuple[str, int, int]] = []
    rows: list[int] = []

    def on_launch(batch) -> None:
        if any(c.lone for c in batch.slices):
            assert all(c.lone for c in batch.slices), "a lone chunk in a step with others"
            rows.append(len(batch.slices))
        for c in batch.slices:
            if c.lone:
                assert c.start % w == 0 and c.end - c.start <= w
                lone.append((c.req.rid, c.start, c.end))
            elif c.start % w:
                assert c.end <= (c.start // w + 1) * w, "a chunk crossed a multiple of the width"

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert any(e % w for _, _, e in lone), "no padded last chunk"
    assert ("hit", 64, 96) in lone, "the hit was not cut back to a multiple"
    assert max(rows) > 1, "never several lone chunks in one step"
    assert decode_attention.counts.prefill_causal - before >= len(lone) * 2  # NOTE: 2 layers


@pytest.mark.parametrize("warm", [True, False], ids=["bucketed", "exact"])
def test_first_chunks_attend_to_their_own_keys(llama, warm):
    """A step of first chunks (every row from position 0) of different lengths, right-padded to
    one width: each attends to its own keys by a causal mask, none read back from the pages;
    every token as mlx-lm's, later chunks and decode reading what those steps wrote."""
    rng = random.Random(16)
    reqs = [(f"r{i}", random_prompt(rng, n), 6, 0) for i, n in enumerate([5, 17, 31, 40, 90])]
    # NOTE: arriving while the long ones are in their later chunks: steps that mix both kinds
    reqs += [(f"late{i}", random_prompt(rng, n), 6, 1 + i) for i, n in enumerate([9, 26])]
    sched = make_scheduler(llama, chunked_prefill_size=32, max_prefill_tokens=256)
    if warm:
        bucketed(sched)
    assert decode_attention.install(llama)  # NOTE: counts the attention calls (as on CUDA)
    before = decode_attention.counts.prefill_causal
    firsts: list[int] = []
    mixed = 0

    def on_launch(batch) -> None:
        nonlocal mixed
        starts = [c.start for c in batch.slices]
        if starts and not any(starts):
            firsts.append(len(starts))
        mixed += 0 in starts and any(starts)

    sched.on_launch = on_launch
    _parity(sched, llama, reqs)
    assert firsts and max(firsts) > 1, "no step of several first chunks"
    assert mixed, "no step with first and later chunks"
    assert decode_attention.counts.prefill_causal - before >= len(firsts) * 2  # NOTE: 2 layers


def test_short_prompts_are_not_held_behind_a_long_one(llama):
    """Long prompts being prefilled in many chunks do not hold back the first tokens of short
    prompts that arrive after them."""
    rng = random.Random(12)
    reqs = [(f"long{i}", random_prompt(rng, 800), 2, 0) for i in range(4)]
    reqs += [(f"chat{i}", random_prompt(rng, 20), 2, 2) for i in range(4)]
    sched = make_scheduler(llama, chunked_prefill_size=64, max_prefill_tokens=128)
    first: dict[str, int] = {}
    arrivals: dict = {}
    for rid, prompt, n, at in reqs:
        arrivals.setdefault(at, []).append((rid, prompt, greedy(n)))
    step = 0
    while step <= 2 or sched.has_work():
        for rid, ids, params in arrivals.get(step, []):
            sched.submit(rid, ids, params)
        for out in sched.step():
            if out.token_ids:
                first.setdefault(out.rid, step)
        step += 1
    assert (
        max(first[f"chat{i}"] for i in range(4)) < min(first[f"long{i}"] for i in range(4)) / 4
    ), first


def test_the_warm_up_runs_the_lone_row_decode(llama):
    """The single-stream decode path is warmed before READY (its first use after READY once
    cost 3.9 s on a fresh H200), and it writes nothing a request holds."""
    sched = bucketed(make_scheduler(llama))
    assert (1, 1, -1) in sched.runner.shapes_seen
    rng = random.Random(13)
    _parity(sched, llama, [("alone", random_prompt(rng, 30), 8, 0)])


@pytest.mark.parametrize("long_chunk", [-1, 32], ids=["ops", "causal"])
def test_the_warm_up_runs_every_prefill_shape_the_planner_makes(llama, long_chunk):
    """Long prompts' later chunks read more keys than their first: each (rows, width, keys)
    first seen after READY cost an H200 a 20-140 ms step, every decoding row waiting. The CUDA
    paths (a decode's keys are no dimension of its shape there), later chunks by ops or alone by
    the causal kernel (a cuDNN graph per shape)."""
    cuda = dict(fused_decode="on", prefill_attention="ops", long_prefill_chunk=long_chunk)
    sched = bucketed(make_scheduler(llama, chunked_prefill_size=64, max_prefill_tokens=256, **cuda))
    rng = random.Random(21)
    lens = [900, 40, 300, 1500, 70, 5, 2000, 130, 640]
    arrivals: dict = {}
    for i, n in enumerate(lens):
        arrivals.setdefault(i % 3 * 4, []).append((f"r{i}", random_prompt(rng, n), greedy(3)))
    drive(sched, arrivals)
    stats = sched.stats()
    assert stats["steps_prefill"] > 10 and stats["steps_new_shape"] == 0


def test_the_warm_up_runs_the_split_decode_path(llama):
    """Rows of 1,024 keys or more decode in splits, by kernels of their own: left out of the
    warm-up, they were built on the first such step after READY (H200: a 3.9 s step, 16 users
    waiting)."""
    sched = make_scheduler(llama, fused_decode="on")
    before = decode_attention.counts.split
    bucketed(sched)
    assert decode_attention.counts.split > before


def test_a_shared_partly_filled_page_is_copied_in_place(llama):
    """A prefix hit copies its partly filled page into the new request's page. Read and written
    in one graph, every layer's buffer was copied whole instead (an H200's 65 GiB pool: the
    steps after such hits took 2.7-4.9 s)."""
    pool = make_scheduler(llama).pool
    for buf in pool.keys + pool.values:
        buf[:, 32:64] = mx.random.normal((buf.shape[0], 32, buf.shape[2])).astype(buf.dtype)
    mx.eval(pool.keys, pool.values)
    want = [mx.array(b[:, 32:45]) for b in pool.keys + pool.values]
    mx.eval(want)
    whole = max(b.nbytes for b in pool.keys)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pool.copy_tokens(list(range(32, 45)), list(range(64, 77)))
    assert mx.get_peak_memory() - before < whole / 4
    for w, buf in zip(want, pool.keys + pool.values, strict=True):
        assert mx.array_equal(buf[:, 64:77], w).item()


def test_admission_leaves_a_page_for_every_decoding_request(llama):
    """A request is admitted only beside a free page per decoding request (their next tokens'),
    so an admission never forces a preemption at the next decode step."""
    sched = make_scheduler(llama, max_total_tokens=48 * 16, page_size=16, disable_radix_cache=True)
    admit, seen = sched.kv.seat, []

    def watched(req, reserve, in_flight=False):
        ok = admit(req, reserve, in_flight)
        if ok:
            seen.append((sched.kv.pages.available, sched.running.n_decode))
        return ok

    sched.kv.seat = watched
    rng = random.Random(8)
    arrivals: dict = {}
    for i in range(24):
        prompt = random_prompt(rng, rng.randint(60, 200))
        arrivals.setdefault(i * 3, []).append((f"r{i}", prompt, greedy(rng.randint(20, 60))))
    drive(sched, arrivals)
    assert any(n > 0 for _, n in seen), "no admission beside decoding requests"
    assert all(free >= n for free, n in seen), seen


def test_lone_chunks_several_a_step_give_mlx_lms_logprobs(llama):
    """Lone chunks of several prompts in one step, each row attending on its own over its own
    keys (`decode_attention.by_groups`): every token's logprob is mlx-lm's to float tolerance, a
    bound tight enough to see a row's queries read one key past their own (greedy tokens of a
    2-layer random model over 300 keys do not move for that)."""
    w = 32
    rng = random.Random(15)
    prompts = [random_prompt(rng, 200 + 37 * i) for i in range(3)]
    sched = make_scheduler(
        llama, chunked_prefill_size=64, max_prefill_tokens=128, long_prefill_chunk=w
    )
    rows: list[int] = []
    sched.on_launch = lambda b: rows.append(len(b.slices)) if b.slices and b.slices[0].lone else 0
    _assert_mlx_lms_logprobs(sched, llama, prompts, 4)
    assert max(rows) == 3, rows


def _assert_mlx_lms_logprobs(sched, model, prompts: list[list[int]], n: int) -> None:
    """All prompts at once, `n` greedy tokens each: every logprob mlx-lm's to 1e-4."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = drive(sched, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        got = [lp.logprob for o in outs[f"r{i}"] for lp in o.logprobs]
        steps = generate_step(
            mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        want = [float(lp[int(tok)]) for tok, lp in steps]
        assert got == pytest.approx(want, abs=1e-4), f"r{i}"


def test_decode_rows_of_very_different_lengths_attend_in_groups(llama):
    """A long request decoding beside short ones: the rows attend in groups by length, each
    reading up to its own longest row, every token's logprob mlx-lm's; a decode step's memory
    no longer grows with rows x the longest row (a 7,000-token request made 15 short streams
    decode 35x slower on this CPU: every row's keys were gathered to its length)."""
    rng = random.Random(23)
    prompts = [random_prompt(rng, 1500)] + [random_prompt(rng, 20 + 3 * i) for i in range(15)]
    sched = make_scheduler(llama, chunked_prefill_size=512, max_prefill_tokens=2048)
    assert sched.runner.split_decode
    before = decode_attention.counts.grouped
    _assert_mlx_lms_logprobs(sched, llama, prompts, 6)
    assert decode_attention.counts.grouped > before


def _skewed(model, split: bool, seed: int):
    """A scheduler decoding 15 rows of 20 prompt tokens beside one of 3,000."""
    sched = make_scheduler(
        model,
        chunked_prefill_size=1024,
        max_prefill_tokens=4096,
        context_length=4096,
        max_total_tokens=16 * 4096,
    )
    sched.runner.split_decode = split
    rng = random.Random(seed)
    sched.submit("long", random_prompt(rng, 3000), greedy(40))
    for i in range(15):
        sched.submit(f"s{i}", random_prompt(rng, 20), greedy(40))
    while sched.running.n_decode < 16:
        sched.step()
    return sched


def _decode_peak(model, split: bool) -> tuple[int, int]:
    """Peak memory over decode steps of 15 short rows beside one of 3,000 tokens, and what one
    layer's K of a row of 3,000 tokens holds."""
    sched = _skewed(model, split, seed=5)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(4):
        sched.step()
    mx.synchronize()
    layer = sched.pool.shapes[0]
    return mx.get_peak_memory() - base, 3000 * layer.kv_heads * layer.k_dim * layer.dtype.size


def test_a_decode_beside_a_long_row_reads_no_short_row_to_its_length(llama):
    grouped, row = _decode_peak(llama, split=True)
    padded, _ = _decode_peak(llama, split=False)
    # NOTE: padded, 16 rows x 3,000 keys of K and V (a layer's, two layers' at the peak);
    # grouped, the long row's own gather (its decode pages break its run) and the short rows'.
    assert padded > 24 * row, (padded, row)
    assert grouped < padded / 3, (grouped, padded, row)


def _gathered_per_held(model, split: bool) -> float:
    """Bytes a decode step's attention gathers (K and V, every layer) over the KV its rows hold:
    15 rows of 20 tokens beside one of 3,000, four steps."""
    sched = _skewed(model, split, seed=6)
    held = sched.running.tokens_in_use() * sched.pool.token_bytes
    before = sched.pool.gathered_bytes
    for _ in range(4):
        sched.step()
    return (sched.pool.gathered_bytes - before) / (4 * held)


@pytest.mark.timeout(300)
def test_a_skewed_decode_step_gathers_at_most_twice_the_kv_it_holds(llama):
    """Off CUDA a decode step copies the keys it reads; with the rows grouped by length it
    copies at most 2x what they hold (a Mac's unified memory has no room for more: padded to
    the longest row, 32 rows beside one of 100k tokens of an 8B model copied ~12 GiB a layer)."""
    assert _gathered_per_held(llama, split=True) <= 2.0
    assert _gathered_per_held(llama, split=False) > 10  # NOTE: the counter sees the padding


@pytest.mark.parametrize("lone", [None, 16], ids=["chunks", "lone-chunks"])
def test_prompts_prefill_beside_chained_decode_steps(llama, lone):
    """`--prefill-in-chain on` (opt-in): while prompts prefill, the decode rows keep
    chaining and each chained step has a prefill step queued beside it. Every token is mlx-lm's
    (a chunk written beside a decode reads and writes only its own row), the chain goes on
    through the prompts' chunks, and a prompt whose last chunk ran beside the chain joins the
    decode rows in the next fresh step (the chain breaks for it)."""
    rng = random.Random(21)
    short = [(f"s{i}", random_prompt(rng, 10 + i), 48, 0) for i in range(3)]
    long = [(f"l{i}", random_prompt(rng, 150 + 41 * i), 6, 4) for i in range(3)]
    sched = make_scheduler(
        llama,
        chunked_prefill_size=16,
        max_prefill_tokens=32,
        long_prefill_chunk=lone or 0,
        prefill_in_chain="on",
    )
    launches: list = []
    sched.on_launch = launches.append
    _parity(sched, llama, short + long)
    beside = [b for b in launches if b.is_prefill and b.chained]
    assert len(beside) >= 8, len(beside)
    assert any(b.chained and b.joined for b in launches), "no prompt joined a chained step"
    for rid, *_ in long:
        last = max(i for i, b in enumerate(launches) for c in b.slices if c.req.rid == rid)
        joined = next(i for i, b in enumerate(launches) if any(r.rid == rid for r in b.joined))
        # NOTE: its last chunk, the chained decode step queued before it finalized, the join
        assert joined - last <= 3, (rid, last, joined)
    stats = sched.stats()
    assert stats["batches_finalized"] == stats["steps_launched"]


def test_off_the_chain_prefill_and_decode_steps_take_turns(llama):
    """`--prefill-in-chain off` (the default): no prefill step is chained."""
    rng = random.Random(21)
    short = [(f"s{i}", random_prompt(rng, 10 + i), 24, 0) for i in range(2)]
    long = [(f"l{i}", random_prompt(rng, 120), 4, 4) for i in range(2)]
    sched = make_scheduler(llama, chunked_prefill_size=16, prefill_in_chain="off")
    launches: list = []
    sched.on_launch = launches.append
    _parity(sched, llama, short + long)
    assert not [b for b in launches if b.is_prefill and b.chained]
    assert sched.defaults.prefill_in_chain is False


def test_sampled_streams_are_the_same_in_the_chain_and_off_it(llama):
    """Prompts joining a chained step get a sampler state rebuilt for the new rows, the rows
    already decoding one token further (`Runner.chained_inputs`): seeded sampling draws by
    position, so every stream is token for token what it is with decode and prefill steps
    taking turns; a penalised row (its counts on the device) keeps prompts out of the chain."""
    rng = random.Random(8)
    seeded = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    penalised = SamplingParams(
        max_tokens=30, temperature=0.0, repetition_penalty=1.3, ignore_eos=True
    )
    arrivals: dict = {0: [(f"s{i}", random_prompt(rng, 12 + i), seeded) for i in range(3)]}
    arrivals[3] = [(f"l{i}", random_prompt(rng, 90 + 23 * i), seeded) for i in range(3)]
    arrivals[30] = [("p", random_prompt(rng, 20), penalised)]
    arrivals[33] = [(f"m{i}", random_prompt(rng, 70), seeded) for i in range(2)]
    outs = {}
    for mode in ("on", "off"):
        sched = make_scheduler(
            llama, chunked_prefill_size=16, max_prefill_tokens=32, prefill_in_chain=mode
        )
        launches: list = []
        sched.on_launch = launches.append
        outs[mode] = {rid: tokens(o) for rid, o in drive(sched, arrivals).items()}
        assert_pages_balanced(sched)
        if mode == "on":
            assert any(b.chained and b.joined for b in launches)
    assert outs["on"] == outs["off"]


def test_a_prompt_aborted_while_it_prefills_beside_the_chain_runs_no_more_chunks(llama):
    """An abort ends a prompt at once, but its row is released only at the next settle, which
    a chain puts off: no chunk of it is planned after the abort, and the rest are served."""
    rng = random.Random(5)
    sched = make_scheduler(
        llama, chunked_prefill_size=16, max_prefill_tokens=32, prefill_in_chain="on"
    )
    sched.submit("s", random_prompt(rng, 10), greedy(60))
    sched.submit("long", random_prompt(rng, 400), greedy(4))
    launches: list = []
    sched.on_launch = launches.append
    while not any(b.chained and b.beside for b in launches):
        sched.step()
    sched.abort("long")
    aborted_at = len(launches)
    outs: dict = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).append(o)
    late = [c for b in launches[aborted_at:] for c in b.slices if c.req.rid == "long"]
    assert not late, len(late)
    assert outs["long"][-1].finish_reason == "abort"
    assert outs["s"][-1].finish_reason == "length"
    assert_pages_balanced(sched)


def _agents(sched: Scheduler, model, agents: int, turns: int) -> dict[str, int]:
    """`agents` conversations on one system prompt, each turn sent when the one before ended:
    the last prompt, its reply and a new message. Every reply is mlx-lm's; returns the chain
    breaks by reason."""
    rng = random.Random(agents)
    system = random_prompt(rng, 50)
    prompts = {f"a{i}": system + random_prompt(rng, 5 + 3 * i) for i in range(agents)}
    lengths = {rid: 4 + i % 7 for i, rid in enumerate(prompts)}
    turn = dict.fromkeys(prompts, 0)
    got: dict[str, list[int]] = {}
    for rid, prompt in prompts.items():
        sched.submit(f"{rid}.0", prompt, greedy(lengths[rid]))
    for _ in range(20_000):
        if not sched.has_work():
            break
        for out in sched.step():
            got.setdefault(out.rid, []).extend(out.token_ids)
            if out.finish_reason is None:
                continue
            rid, n = out.rid.split(".")[0], turn[out.rid.split(".")[0]]
            prompt = prompts[rid]
            assert got[out.rid] == reference_greedy(model, prompt, lengths[rid]), out.rid
            if n + 1 < turns:
                prompts[rid] = prompt + got[out.rid] + random_prompt(rng, 7)
                turn[rid] = n + 1
                sched.submit(f"{rid}.{n + 1}", prompts[rid], greedy(lengths[rid]))
    assert all(n == turns - 1 for n in turn.values()) and not sched.has_work()
    assert_pages_balanced(sched)
    stats = sched.stats()
    return {k.removeprefix("chain_breaks_"): v for k, v in stats.items() if "chain_breaks" in k}


def test_agents_turn_after_turn_keep_the_chain(llama):
    """With prompts in the chain, rows move while a step is in flight: a finished turn gives
    its row back and the next turn is seated (its prefix hit shares every full page, a page two
    requests wrote included) without breaking the chain, and every reply is mlx-lm's. Before,
    each turn broke the chain twice (its finish, then its successor's seating)."""
    # NOTE: no speculation: a speculating row's step is followed by a fresh one by design
    sched = make_scheduler(
        llama, page_size=8, chunked_prefill_size=16, prefill_in_chain="on", spec="off"
    )
    breaks = _agents(sched, llama, agents=6, turns=4)
    assert breaks["seat"] + breaks["finish"] <= 2, breaks
    stats = sched.stats()
    assert stats["steps_chained"] >= 0.8 * stats["steps_launched"], stats


def test_agents_replies_are_mlx_lms_off_the_chain(llama):
    """The same agents where prompts stay off the chain (the CPU's and Metal's default), and
    with no overlap: rows finish in flight, seats wait for a break; every reply is mlx-lm's."""
    for overlap in (True, False):
        sched = make_scheduler(
            llama, page_size=8, chunked_prefill_size=16, disable_overlap=not overlap
        )
        _agents(sched, llama, agents=5, turns=3)


def test_a_seat_in_flight_waits_for_the_pool_to_grow_rather_than_evict(llama, monkeypatch):
    """With prompts in the chain, a request seated while a step is in flight may take only free
    pages (the pool grows at a break). Where the pool could still grow, the seat waits for that
    break rather than evict what the prefix cache holds: seats in flight had evicted other
    agents' conversations (64 agents on the CPU: 25k cached tokens), whose next turns then
    computed them again."""
    from scheduler_proc import kv_budget

    monkeypatch.setattr(kv_budget, "INITIAL_TOKENS", 16 * 8)  # NOTE: 16 pages of 8 at start
    rng = random.Random(31)
    sched = make_scheduler(llama, page_size=8, chunked_prefill_size=16, prefill_in_chain="on")
    start = sched.kv.pool.pages
    cached = random_prompt(rng, 70)
    drive(sched, {0: [("cached", cached, greedy(2))]})  # NOTE: its 9 pages stay in the cache
    sched.submit("decoding", random_prompt(rng, 10), greedy(60))
    while not sched.running.decoding():
        sched.step()
    sched.step()  # NOTE: now a chained step is in flight whenever the next request arrives
    sched.submit("new", random_prompt(rng, 60), greedy(4))
    outs: dict = {}
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).append(o)
    assert outs["new"][-1].finish_reason == "length"
    stats = sched.stats()
    assert stats["prefix_cache_evicted_tokens"] == 0, stats
    assert sched.kv.pool.pages > start
    again = drive(sched, {0: [("again", cached + random_prompt(rng, 5), greedy(1))]})
    assert again["again"][-1].cached_tokens >= 64
    assert_pages_balanced(sched)
