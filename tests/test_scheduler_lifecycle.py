"""Lifecycle: launch bookkeeping, chunked prefill interleaving, abort storms, admission limits."""

from __future__ import annotations

import random

import pytest
from scheduler_util import (
    VOCAB,
    assert_pages_balanced,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.errors import InvalidRequest, ShuttingDown
from engine.random_model import TINY_LLAMA, make_random_model
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny llama with a 512-token vocabulary: the storm's cost is steps, not the LM head."""
    path = tmp_path_factory.mktemp("tiny-llama-v512")
    return tiny_model(make_random_model(path, {**TINY_LLAMA, "vocab_size": 512}))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_launch_bookkeeping(llama, overlap):
    sched = make_scheduler(llama, disable_overlap=not overlap, chunked_prefill_size=32)
    launched, built, finalized = [], [], []
    sched.on_launch = lambda b: launched.append((b.step_index, b.launch_ts, b.chained))
    real_launch, real_finalize = sched.runner.launch, sched._finalize
    sched.runner.launch = lambda b, x, **kw: (built.append(b.step_index), real_launch(b, x, **kw))
    sched._finalize = lambda b: (finalized.append((b.step_index, b.launch_ts)), real_finalize(b))
    rng = random.Random(0)
    arrivals = {
        s: [(f"r{s}-{i}", random_prompt(rng, rng.randint(1, 90)), greedy(rng.randint(1, 30)))]
        for i, s in enumerate((0, 0, 3, 9, 20, 21))
    }
    drive(sched, arrivals)
    stats = sched.stats()
    assert stats["steps_launched"] == len(launched) == len(built)
    assert stats["steps_launched"] == stats["steps_fresh"] + stats["steps_chained"]
    assert [i for i, _, _ in launched] == list(range(1, len(launched) + 1))
    assert built == [i for i, _, _ in launched]  # stamped before the graph was built
    assert all(ts is not None for _, ts in finalized)
    assert sorted(i for i, _ in finalized) == [i for i, _, _ in launched]
    chained = sum(c for _, _, c in launched)
    assert (chained > 0) == overlap and chained == stats["steps_chained"]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_running_requests_decode_every_other_step_during_a_long_prefill(llama, overlap):
    sched = make_scheduler(
        llama, disable_overlap=not overlap, chunked_prefill_size=16, max_prefill_tokens=16
    )
    rng = random.Random(1)
    for i in range(8):
        sched.submit(f"d{i}", random_prompt(rng, 10), greedy(400))
    started: set[str] = set()
    while len(started) < 8:  # let the 8 reach steady decode
        started |= {o.rid for o in sched.step() if o.token_ids}
    long_prompt = random_prompt(rng, 1200)
    sched.submit("long", long_prompt, greedy(3))
    chunk_steps = 0
    got_long: list[int] = []
    idle = dict.fromkeys(range(8), 0)  # steps since each decoder's last token
    while not got_long:
        outs = {o.rid: o for o in sched.step()}
        got_long = outs["long"].token_ids if "long" in outs else []
        chunk_steps += 1
        for i in idle:
            idle[i] = 0 if f"d{i}" in outs and outs[f"d{i}"].token_ids else idle[i] + 1
        # NOTE: a step is one forward; decode steps alternate with prefill steps, so a running
        # request waits at most one prefill step for its next token.
        assert max(idle.values()) <= 1, chunk_steps
    assert chunk_steps >= 2 * (1200 // 16)
    for i in range(8):
        sched.abort(f"d{i}")
    outs = drive(sched, {})
    assert got_long + tokens(outs.get("long", [])) == reference_greedy(llama, long_prompt, 3)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_abort_storm_frees_all_kv_and_keeps_serving(small_vocab, overlap):
    sched = make_scheduler(
        small_vocab, disable_overlap=not overlap, max_running_requests=12, chunked_prefill_size=24
    )
    rng = random.Random(2)
    live: list[str] = []
    finishes: dict[str, list[str]] = {}
    for n in range(300):
        rid = f"a{n}"
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8]))
        sched.submit(rid, random_prompt(rng, rng.randint(1, 120), 512), params)
        live.append(rid)
        if rng.random() < 0.3:
            sched.abort(rid)  # while waiting
        for _ in range(rng.randint(0, 3)):
            for out in sched.step():
                if out.finish_reason:
                    finishes.setdefault(out.rid, []).append(out.finish_reason)
            for victim in rng.sample(live, k=min(len(live), rng.randint(0, 2))):
                sched.abort(victim)  # prefilling, decoding, in flight or already finished
        sched.abort("never-submitted")
    for rid in live:
        sched.abort(rid)
    for out in drive(sched, {}).values():
        for o in out:
            if o.finish_reason:
                finishes.setdefault(o.rid, []).append(o.finish_reason)
    assert sorted(finishes) == sorted(live)
    assert all(len(v) == 1 for v in finishes.values())  # exactly one terminal output each
    assert sum(v == ["abort"] for v in finishes.values()) > 100
    stats = sched.stats()
    assert stats["kv_slots_in_use"] == 0 and stats["kv_tokens_in_use"] == 0
    assert_pages_balanced(sched)
    assert stats["running"] == 0 and stats["waiting"] == 0 and not sched.has_work()
    prompt = random_prompt(rng, 50, 512)
    outs = drive(sched, {0: [("after", prompt, greedy(8))]})
    assert tokens(outs["after"]) == reference_greedy(small_vocab, prompt, 8)


def test_requests_wait_for_kv_pages(llama):
    # NOTE: 8 pages of 32 tokens: a request of up to 120 tokens takes up to 4.
    sched = make_scheduler(
        llama, max_total_tokens=9 * 32, context_length=256, disable_radix_cache=True
    )
    assert sched.stats()["kv_pages_total"] == 8
    rng = random.Random(3)
    prompts = [random_prompt(rng, rng.randint(1, 100)) for _ in range(6)]
    reqs = [(f"w{i}", p, greedy(20)) for i, p in enumerate(prompts)]
    sched.submit(*reqs[0])
    peak = 0
    outs: dict = {}
    for rid, p, params in reqs[1:]:
        sched.submit(rid, p, params)
    while sched.has_work():
        for o in sched.step():
            outs.setdefault(o.rid, []).append(o)
        peak = max(peak, sched.stats()["running"])
    assert 1 <= peak < len(reqs)  # NOTE: the rest waited for pages
    for rid, p, _ in reqs:
        assert tokens(outs[rid]) == reference_greedy(llama, p, 20)


def test_request_capped_by_the_context(llama):
    sched = make_scheduler(llama, max_total_tokens=4 * 64, context_length=64)
    prompt = random_prompt(random.Random(4), 60)
    outs = drive(sched, {0: [("c", prompt, greedy(50))]})
    assert tokens(outs["c"]) == reference_greedy(llama, prompt, 4)
    assert outs["c"][-1].finish_reason == "length"
    with pytest.raises(InvalidRequest) as err:
        sched.submit("too-long", list(range(64)), greedy(1))
    assert err.value.field == "input_ids"
    with pytest.raises(InvalidRequest):
        sched.submit("bad-id", [VOCAB], greedy(1))


def test_in_flight_lasts_until_the_terminal_output_is_reported(llama):
    """The scheduler process drains and exits by `in_flight()`: it must hold every request, in
    any state, until the step that reports its end, and nothing after."""
    sched = make_scheduler(llama, max_running_requests=1, context_length=64)
    sched.submit("a", [1, 2, 3], greedy(2))
    sched.submit("b", [4, 5], greedy(50))  # waits for a's row
    assert sched.in_flight() == {"a": 3, "b": 2}
    sched.abort("b")
    assert "b" in sched.in_flight()  # its abort is not reported yet
    reported: set[str] = set()
    while sched.has_work():
        outs = sched.step()
        reported |= {o.rid for o in outs if o.finish_reason is not None}
        assert set(sched.in_flight()) == {"a", "b"} - reported
    assert reported == {"a", "b"} and sched.in_flight() == {}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_shutdown_aborts_everything_and_refuses_new_work(llama, overlap):
    sched = make_scheduler(llama, disable_overlap=not overlap, max_running_requests=2)
    rng = random.Random(5)
    for i in range(4):
        sched.submit(f"s{i}", random_prompt(rng, 20), greedy(50))
    for _ in range(4):
        sched.step()  # two decoding (a step in flight with overlap), two waiting
    sched.shutdown()
    outs = sched.step()
    assert sorted(o.rid for o in outs) == [f"s{i}" for i in range(4)]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not sched.has_work() and sched.stats()["kv_slots_in_use"] == 0
    with pytest.raises(ShuttingDown):
        sched.submit("late", [1], greedy(1))


def test_failed_admission_keeps_deferred_requests(llama):
    """A step failing while admitting must not lose a request deferred earlier in that step."""
    sched = make_scheduler(llama, chunked_prefill_size=32, max_prefill_tokens=4096)
    rng = random.Random(5)
    shared = random_prompt(rng, 200)
    sched.submit("first", shared + [1], greedy(4))
    sched.submit("waits", shared + [2], greedy(4))  # deferred: shares 200 tokens with "first"
    sched.submit("boom", random_prompt(rng, 40), greedy(4))
    real_admit = sched.kv.seat

    def admit(req, reserve):
        if req.rid == "boom":
            raise RuntimeError("admission failed")
        return real_admit(req, reserve)

    sched.kv.seat = admit  # type: ignore[method-assign]
    outs = sched.step()
    assert {o.rid: o.finish_reason for o in outs} == dict.fromkeys(
        ("first", "waits", "boom"), "error"
    )
    assert not sched.has_work()
    assert sched.stats()["kv_slots_in_use"] == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("where", ["launch", "finalize"])
def test_a_failed_step_fails_only_its_requests(llama, overlap, where, monkeypatch):
    """A step that raises ends its own requests with an error; a waiting request still runs."""
    import scheduler_proc.scheduler as scheduler_mod

    sched = make_scheduler(llama, max_running_requests=1, disable_overlap=not overlap)
    rng = random.Random(9)
    waiting = random_prompt(rng, 12)
    sched.submit("bad", random_prompt(rng, 12), greedy(3))
    sched.submit("waiting", waiting, greedy(3))
    if where == "launch":  # NOTE: graph building raises
        monkeypatch.setattr(sched.runner, "launch", _fails_once(sched.runner.launch))
    else:  # NOTE: evaluation raises, where the step's tokens are brought to the host
        monkeypatch.setattr(scheduler_mod, "_host", _fails_once(scheduler_mod._host))
    outs = drive(sched, {0: []})
    assert outs["bad"][-1].finish_reason == "error"
    assert outs["waiting"][-1].finish_reason == "length"
    assert tokens(outs["waiting"]) == reference_greedy(llama, waiting, 3)
    assert sched.stats()["kv_slots_in_use"] == 0


def _fails_once(fn):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("step failed")
        return fn(*args, **kwargs)

    return wrapped


def test_a_dropped_scheduler_frees_its_kv_at_once(llama):
    """No reference cycle holds a Scheduler: dropped, its KV pool is freed right away, not when
    the cyclic collector next runs (a Seating callback into the scheduler made one; the tests
    that measure peak memory then saw an earlier scheduler's pool freed mid-measurement)."""
    import gc
    import weakref

    sched = make_scheduler(llama)
    drive(sched, {0: [("r", random_prompt(random.Random(3), 20), greedy(4))]})
    ref = weakref.ref(sched)
    gc.disable()
    try:
        del sched
        assert ref() is None, "a reference cycle holds the scheduler"
    finally:
        gc.enable()
