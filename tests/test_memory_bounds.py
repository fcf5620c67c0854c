"""Bounded memory where the KV shares it (Apple silicon): the pool shrinks back when idle, MLX's
cache and wired memory are limited on Metal, the budget sees the memory other apps use.

The Metal branches run here with Metal's answers monkeypatched in (`mx.metal.is_available`,
`mx.device_info`, the OS's available memory) and MLX's setters recorded. The shrink runs for real
on the tiny llama, whose output depends on its context (tests/test_context_sensitive.py), so KV
lost or moved by a shrink changes tokens.
"""

from __future__ import annotations

import random
import time
from typing import Any

import mlx.core as mx
import pytest
from scheduler_util import drive, greedy, make_scheduler, random_prompt, tiny_model, tokens

from engine import memory
from engine.client import EngineClient
from mlx_engine.inprocess import InProcessEngine
from scheduler_proc import kv_budget, memory_limits
from scheduler_proc.kv_manager import growth_size
from scheduler_proc.scheduler import Scheduler

GIB = 2**30
PAGE = 16
INITIAL_PAGES = 4


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


@pytest.fixture
def small_start(monkeypatch):
    """The pool starts at INITIAL_PAGES pages, so a burst of a few requests grows it."""
    monkeypatch.setattr(kv_budget, "INITIAL_TOKENS", INITIAL_PAGES * PAGE)


def _burst(rng: random.Random, n: int = 6) -> dict[int, list]:
    return {0: [(f"b{i}", random_prompt(rng, 40 + 9 * i), greedy(12)) for i in range(n)]}


def _outputs(sched: Scheduler, arrivals: dict[int, list]) -> dict[str, list[int]]:
    return {rid: tokens(outs) for rid, outs in drive(sched, arrivals).items()}


def _fresh(llama: Any, arrivals: dict[int, list], **config: Any) -> dict[str, list[int]]:
    return _outputs(make_scheduler(llama, page_size=PAGE, **config), arrivals)


@pytest.mark.timeout(300)
def test_a_pool_grown_by_a_burst_shrinks_when_idle_and_serves_the_same_tokens(llama, small_start):
    sched = make_scheduler(llama, page_size=PAGE, disable_radix_cache=True)
    assert sched.pool.pages == INITIAL_PAGES
    rng = random.Random(1)
    burst = _burst(rng)
    first = _outputs(sched, burst)
    grown, grown_bytes = sched.pool.pages, sched.pool.nbytes
    assert grown >= 8 * INITIAL_PAGES, "the burst did not grow the pool"
    mx.clear_cache()
    before = mx.get_active_memory()
    sched.went_idle()
    assert sched.pool.pages == sched.kv.pages.size == INITIAL_PAGES
    freed = grown_bytes - sched.pool.nbytes
    assert before - mx.get_active_memory() >= freed, "the old buffers are still held"
    again = {0: [(f"again-{rid}", ids, p) for rid, ids, p in burst[0]]}
    later = {0: [(f"later{i}", random_prompt(rng, 30 + 7 * i), greedy(10)) for i in range(4)]}
    outs = _outputs(sched, again) | _outputs(sched, later)
    assert {rid[6:]: t for rid, t in outs.items() if rid.startswith("again-")} == first
    assert {r: t for r, t in outs.items() if r.startswith("later")} == _fresh(llama, later)


@pytest.mark.timeout(300)
def test_a_paused_request_keeps_its_kv_through_a_shrink(llama, small_start):
    """A request paused mid-decode while the engine idles, its first pages above those of a
    burst that ran beside it and ended: the pool shrinks to the growth step that holds its
    highest page, not below, and it finishes with the tokens it has on a fresh scheduler."""
    sched = make_scheduler(llama, page_size=PAGE, disable_radix_cache=True)
    rng = random.Random(2)
    burst = [
        (f"b{i}", random_prompt(rng, 40 + 9 * i), greedy(12 if i < 3 else 30)) for i in range(6)
    ]
    x = ("x", random_prompt(random.Random(3), 50), greedy(60))
    for rid, ids, params in burst[:3] + [x] + burst[3:]:
        sched.submit(rid, ids, params)
    got: list[int] = []
    while len(sched.in_flight()) > 1:
        got += [t for out in sched.step() if out.rid == "x" for t in out.token_ids]
    sched.quiesce()  # NOTE: as an operator's in-place pause (scheduler_proc/admin.py)
    sched.stepping = False
    got += [t for out in sched.step() for t in out.token_ids]
    assert not sched.has_work() and 0 < len(got) < 60
    grown, pages = sched.pool.pages, sched.kv.pages
    highest = pages.highest_in_use()
    assert highest > 2 * pages.in_use, "x's pages are not above the burst's: nothing to test"
    sched.went_idle()
    assert sched.pool.pages == growth_size(highest, INITIAL_PAGES, grown) < grown
    sched.stepping = True
    got += tokens(drive(sched, {})["x"])
    assert got == _fresh(llama, {0: [x]})["x"]


@pytest.mark.timeout(300)
def test_a_shrink_keeps_the_prefix_cache(llama, small_start):
    """Pages the prefix cache holds stay (nothing is evicted to shrink), and a later request
    that hits them gets a fresh scheduler's tokens."""
    sched = make_scheduler(llama, page_size=PAGE)
    burst = _burst(random.Random(4))
    _outputs(sched, burst)
    assert sched.prefix is not None
    cached = sched.prefix.tree.total_tokens
    sched.went_idle()
    assert sched.prefix.tree.total_tokens == cached, "the shrink evicted cached tokens"
    assert sched.kv.pages.highest_in_use() <= sched.pool.pages
    rid, ids, _ = burst[0][3]
    hit = {0: [("hit", ids + [5, 6, 7], greedy(12))]}
    outs = _outputs(sched, hit)
    assert sched.prefix.hit_tokens >= len(ids) - PAGE
    assert outs == _fresh(llama, hit)


@pytest.mark.timeout(300)
def test_the_in_process_engine_goes_idle(tiny_model_dir, small_start):
    """The in-process engine shrinks its pool once idle, as the scheduler process does."""
    engine = InProcessEngine(
        str(tiny_model_dir), page_size=PAGE, max_total_tokens=8192, disable_radix_cache=True
    )
    with EngineClient(transport=engine, timeout=120) as client:
        for n in (100, 150):  # NOTE: each prompt alone outgrows the pool's start
            client.generate(input_ids=list(range(5, 5 + n)), max_tokens=8)
        assert client.stats()["kv_pages_allocated"] > INITIAL_PAGES
        deadline = time.monotonic() + 30
        while client.stats()["kv_pages_allocated"] > INITIAL_PAGES:
            assert time.monotonic() < deadline, "the idle engine kept its grown pool"
            time.sleep(0.2)


# -- Metal, monkeypatched ----------------------------------------------------------------------
class Recorded:
    def __init__(self, previous: int) -> None:
        self.calls: list[int] = []
        self.previous = previous

    def __call__(self, limit: int) -> int:
        self.calls.append(limit)
        return self.previous


@pytest.fixture
def metal(monkeypatch):
    """Metal's answers: 32 GiB of memory, a 24 GiB working set, 22 GiB available to the OS."""
    info = {"memory_size": 32 * GIB, "max_recommended_working_set_size": 24 * GIB}
    setters = {"set_cache_limit": Recorded(7), "set_wired_limit": Recorded(0)}
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda *a: dict(info))
    monkeypatch.setattr(memory, "darwin_available", lambda: 22 * GIB)
    for name, setter in setters.items():
        monkeypatch.setattr(mx, name, setter)
    return info, setters


VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3000.
Pages active:                            245672.
Pages inactive:                          200000.
Pages speculative:                         1000.
Pages throttled:                              0.
Pages wired down:                        151306.
Pages purgeable:                          11034.
"Translation faults":                 2843473530.
Pages stored in compressor:              879935.
"""


def test_vm_stat_gives_free_speculative_and_inactive_pages():
    assert memory.parse_vm_stat(VM_STAT) == (3000 + 1000 + 200000) * 16384
    assert memory.parse_vm_stat("vm_stat: command not found") is None


@pytest.mark.timeout(60)
def test_the_metal_budget_is_the_smaller_of_the_working_set_and_available_memory(
    metal, monkeypatch
):
    monkeypatch.setattr(mx, "get_active_memory", lambda: 2 * GIB)
    monkeypatch.setattr(mx, "get_cache_memory", lambda: GIB)
    dev = memory.device_memory()
    assert (dev.backend, dev.capacity) == ("metal", 24 * GIB)
    assert dev.source == "Metal recommended working set"
    monkeypatch.setattr(memory, "darwin_available", lambda: 5 * GIB)
    dev = memory.device_memory()
    assert dev.capacity == (5 + 2 + 1) * GIB, "other apps' memory not seen"
    assert "available" in dev.source
    budget = memory.kv_budget(0, 0.5, 1024, 2 * GIB, dev)
    assert budget.tokens == 3 * GIB // 1024 and "available" in budget.source
    monkeypatch.setattr(memory, "darwin_available", lambda: None)
    assert memory.device_memory().capacity == 24 * GIB


@pytest.mark.timeout(300)
@pytest.mark.parametrize("working_set_gib", [24, 0.01])
def test_metal_start_up_limits_the_cache_and_wires_weights_and_kv(llama, metal, working_set_gib):
    """The wired limit is the weights + the planned KV, at most the working set; the cache limit
    is set (at least a step's peak); both are set back at shutdown."""
    info, setters = metal
    info["max_recommended_working_set_size"] = int(working_set_gib * GIB)
    sched = make_scheduler(llama, page_size=PAGE)
    weights = memory.weights_bytes(llama)
    kv = memory_limits.planned_kv_bytes(sched.kv_plan)
    wired = setters["set_wired_limit"].calls
    assert wired == [min(weights + kv, int(working_set_gib * GIB))]
    assert sched.limits.wired == wired[0]
    cache = setters["set_cache_limit"].calls
    assert cache == [sched.limits.cache] and 0 < cache[0] <= kv
    sched.shutdown()
    assert wired[-1] == 0 and cache[-1] == 7, "the limits were not set back"


def test_the_cache_limit_is_a_steps_peak_at_least_a_floor():
    floor = memory_limits.CACHE_FLOOR_BYTES
    kv = 64 * GIB
    assert memory_limits.cache_limit(0, kv) == floor
    assert memory_limits.cache_limit(3 * floor, kv) == 3 * floor
    assert memory_limits.cache_limit(0, 16 * 2**20) == 2**20, "the floor is not tied to the KV"


@pytest.mark.timeout(300)
def test_the_cpu_keeps_mlxs_own_limits(llama, monkeypatch):
    setters = {"set_cache_limit": Recorded(7), "set_wired_limit": Recorded(0)}
    for name, setter in setters.items():
        monkeypatch.setattr(mx, name, setter)
    sched = make_scheduler(llama, page_size=PAGE)
    sched.shutdown()
    assert not setters["set_cache_limit"].calls and not setters["set_wired_limit"].calls
