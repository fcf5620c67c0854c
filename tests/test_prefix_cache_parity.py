"""The radix prefix cache inside the scheduler: greedy tokens identical with the cache on and off.

Every case runs the same arrival schedule twice (`--disable-radix-cache` and not) and compares both
with mlx-lm's own single-request generation, token for token; reported `cached_tokens` are checked
exactly where the expected hit is known.
"""

from __future__ import annotations

import random

import pytest
from scheduler_util import (
    assert_pages_balanced,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.errors import InvalidRequest

CHUNK = 16


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _run(model, arrivals, cache: bool, **overrides):
    base = dict(chunked_prefill_size=CHUNK, max_prefill_tokens=64, disable_radix_cache=not cache)
    sched = make_scheduler(model, **{**base, **overrides})
    outs = drive(sched, arrivals)
    return sched, outs


def _check(model, arrivals, **overrides):
    """Both runs equal mlx-lm; returns the cached run's (scheduler, outputs)."""
    on, outs_on = _run(model, arrivals, cache=True, **overrides)
    _, outs_off = _run(model, arrivals, cache=False, **overrides)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            want = reference_greedy(model, prompt, params.max_tokens)
            assert tokens(outs_off[rid]) == want, f"{rid}: uncached run differs from mlx-lm"
            assert tokens(outs_on[rid]) == want, f"{rid}: cached run differs"
    _assert_clean(on)
    return on, outs_on


def _assert_clean(sched) -> None:
    stats = sched.stats()
    assert stats["kv_slots_in_use"] == 0 and stats["kv_tokens_in_use"] == 0
    assert_pages_balanced(sched)
    cache = sched.prefix
    assert cache.tree.locked_tokens == 0, "a lock outlived its request"


def _cached(outs, rid: str) -> int:
    return outs[rid][-1].cached_tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_full_partial_and_boundary_hits(llama, overlap):
    rng = random.Random(0)
    a = random_prompt(rng, 40)
    later = 60  # NOTE: a finished long before, so its KV is cached
    arrivals = {
        0: [("a", a, greedy(6))],
        later: [
            ("same", a, greedy(5)),  # hit equal to the whole prompt: last token computed
            ("longer", a + random_prompt(rng, 50), greedy(4)),  # full hit, several chunks after it
        ],
        2 * later: [
            ("at32", a[:32] + random_prompt(rng, 9), greedy(4)),  # ends at a chunk boundary
            ("at33", a[:33] + random_prompt(rng, 9), greedy(4)),  # one past it and past a split
            ("partial", a[:20] + random_prompt(rng, 30), greedy(4)),
            ("miss", random_prompt(rng, 30), greedy(4)),
        ],
    }
    sched, outs = _check(llama, arrivals, disable_overlap=not overlap)
    assert _cached(outs, "a") == 0 and _cached(outs, "miss") == 0
    assert _cached(outs, "same") == len(a) - 1
    assert _cached(outs, "longer") == len(a)
    assert _cached(outs, "at32") == 32 and _cached(outs, "at33") == 33
    assert _cached(outs, "partial") == 20
    assert sched.stats()["prefix_cache_hit_rate"] > 0


def test_decoded_tokens_are_reused_across_turns(llama):
    """A second turn extends the first turn's prompt with its reply: all of that is a hit."""
    rng = random.Random(1)
    turn1 = random_prompt(rng, 30)
    reply = reference_greedy(llama, turn1, 8)
    turn2 = turn1 + reply + random_prompt(rng, 7)
    arrivals = {0: [("t1", turn1, greedy(8))], 50: [("t2", turn2, greedy(6))]}
    _, outs = _check(llama, arrivals)
    assert _cached(outs, "t2") == len(turn1) + len(reply) - 1


def test_many_requests_share_one_prefix_at_once(llama):
    rng = random.Random(2)
    system = random_prompt(rng, 70)
    arrivals = {0: [("warm", system + random_prompt(rng, 3), greedy(2))]}
    arrivals[40] = [
        (f"u{i}", system + random_prompt(rng, rng.randint(1, 40)), greedy(5)) for i in range(12)
    ]
    arrivals[43] = [(f"v{i}", system[:50] + random_prompt(rng, 10), greedy(3)) for i in range(4)]
    sched, outs = _check(llama, arrivals)
    assert all(_cached(outs, f"u{i}") >= len(system) for i in range(12))
    assert sched.stats()["prefix_cache_locked_tokens"] == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_memory_pressure_evicts_and_every_request_completes(llama, overlap):
    """Pages for about three requests: requests wait for pages, the cache evicts, parity holds."""
    rng = random.Random(3)
    shared = [random_prompt(rng, 60) for _ in range(3)]
    arrivals: dict = {}
    for i in range(14):
        prompt = rng.choice(shared)[: rng.randint(10, 60)] + random_prompt(rng, rng.randint(1, 60))
        arrivals.setdefault(rng.randint(0, 60), []).append(
            (f"r{i}", prompt, greedy(rng.randint(1, 12)))
        )
    # NOTE: 20 pages of 16 tokens (a scratch page beside them), shared by the cache and requests.
    budget = dict(max_total_tokens=21 * 16, context_length=160, page_size=16)
    sched, outs = _check(llama, arrivals, disable_overlap=not overlap, **budget)
    stats = sched.stats()
    assert stats["kv_pages_total"] == 20
    assert stats["prefix_cache_evicted_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    plan = sched.kv_plan
    at_capacity = (sched.pool.capacity + 1) * plan.page_size * plan.budget.bytes_per_token
    assert sched.pool.nbytes <= at_capacity <= plan.budget.tokens * plan.budget.bytes_per_token


def test_a_prompt_that_can_never_fit_is_rejected(llama):
    sched = make_scheduler(llama, max_total_tokens=3 * 160, context_length=160)
    with pytest.raises(InvalidRequest):
        sched.submit("big", list(range(1, 200)), greedy(2))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_aborts_while_prefixes_are_shared(llama, overlap):
    """Aborts at random moments (waiting, prefilling, decoding) of requests sharing prefixes."""
    rng = random.Random(4)
    system = random_prompt(rng, 50)
    sched = make_scheduler(
        llama, chunked_prefill_size=CHUNK, max_prefill_tokens=48, disable_overlap=not overlap,
        max_total_tokens=6 * 256, context_length=256, max_running_requests=4,
    )  # fmt: skip
    kept: dict[str, tuple[list[int], int]] = {}
    live: list[str] = []
    outs: dict[str, list] = {}
    for step in range(400):
        if step < 300 and rng.random() < 0.3:
            rid, n = f"r{step}", rng.randint(1, 10)
            prompt = system[: rng.randint(0, 50)] + random_prompt(rng, rng.randint(1, 60))
            sched.submit(rid, prompt, greedy(n))
            kept[rid] = (prompt, n)
            live.append(rid)
        if live and rng.random() < 0.2:
            rid = live.pop(rng.randrange(len(live)))
            sched.abort(rid)
            kept.pop(rid)
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
        if step >= 300 and not sched.has_work():
            break
    assert not sched.has_work()
    for rid, (prompt, n) in kept.items():
        assert tokens(outs[rid]) == reference_greedy(llama, prompt, n), rid
    _assert_clean(sched)
    assert sched.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("system_len", [150, 30], ids=["long-system", "chat-template"])
def test_simultaneous_arrivals_compute_a_shared_prompt_once(llama, system_len):
    """Users arriving together with one system prompt: one prefills it, the rest reuse it.

    NOTE: 30 tokens is a chat template's own system prompt (SmolLM2's): the first wave of users
    after start used to compute it once each.
    """
    rng = random.Random(5)
    system = random_prompt(rng, system_len)
    users = [
        (f"u{i}", system + random_prompt(rng, rng.randint(3, 12)), greedy(4)) for i in range(6)
    ]
    sched, outs = _check(llama, {0: users})
    assert sum(_cached(outs, rid) >= len(system) for rid, _, _ in users) == len(users) - 1
    assert sched.stats()["prefill_tokens"] < 2 * len(system) + 6 * 12


@pytest.mark.parametrize("budget", [480, 5000, 65536, 10**6])
@pytest.mark.parametrize("running", [0, 1, 8, 64])
@pytest.mark.parametrize("slot_bytes", [0, 3000])
def test_everything_stays_within_the_budget(budget, running, slot_bytes):
    """Pages, their scratch page and every slot (rings, state) fit the budget; the context never
    exceeds what the pages hold; running requests as asked, or by the rule (0)."""
    from engine.config import EngineConfig
    from scheduler_proc.kv_budget import plan_kv

    config = EngineConfig(max_total_tokens=budget, context_length=160, max_running_requests=running)
    plan = plan_kv(config, 1024, None, slot_bytes=slot_bytes)
    assert plan.allocated_tokens <= max(budget, 2 * plan.page_size + plan.slot_tokens * 2)
    assert plan.context <= plan.tokens and plan.slots >= 1
    if running and plan.slot_tokens == 0:
        assert plan.slots == running


def test_offline_results_report_cached_tokens(tiny_weights_dir):
    from mlx_engine.offline import OfflineEngine

    prompt = random_prompt(random.Random(6), 40)
    config = dict(max_total_tokens=4 * 256, context_length=256, max_running_requests=2)
    with OfflineEngine(str(tiny_weights_dir), **config) as eng:
        first = eng.generate([prompt], dict(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        again = eng.generate([prompt], dict(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
        stats = eng.stats()
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids
    assert stats["prefix_cache_hit_tokens"] == len(prompt) - 1
    assert stats["prefix_cache_tokens"] >= len(prompt)
