"""The I/O-free front-door core on its own: admission order, ownership of aborts, the health
rule, the health probe's verdicts, keys, and what stats and metrics report."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import EngineDead, InvalidRequest, Overloaded, ShuttingDown
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from tokenizer_proc import core as core_module
from tokenizer_proc.core import DoorSettings, FrontDoor, HealthProbe
from tokenizer_proc.requests import Entry


def door(key: str | None = None, max_in_flight: int = 2) -> FrontDoor:
    return FrontDoor(DoorSettings("m", 100, 64, max_in_flight, key))


def gen(rid: str, **params) -> tt.Generate:
    return tt.Generate(rid, input_ids=[1], params={"max_tokens": 2, **params})


def test_admission_refusals_in_order_and_counted():
    d = door()
    d.admit(gen("a"), Entry("c1"))
    with pytest.raises(InvalidRequest, match="unique"):
        d.admit(gen("a"), Entry("c1"))
    with pytest.raises(InvalidRequest) as e:
        d.admit(gen("b", top_p=0.0), Entry("c1"))
    assert e.value.field == "top_p"
    d.admit(gen("b"), Entry("c1"))
    with pytest.raises(Overloaded):
        d.admit(gen("c"), Entry("c1"))
    d.draining = True
    with pytest.raises(ShuttingDown):
        d.admit(gen("d"), Entry("c1"))
    d.dead = True
    with pytest.raises(EngineDead):
        d.admit(gen("e"), Entry("c1"))
    assert d.counters["requests_received"] == 7 and d.counters["requests_rejected"] == 5
    assert d.stats({})["requests_in_flight"] == 2


def test_only_the_owner_aborts_and_an_unsent_request_is_not_forwarded():
    d = door()
    mine = Entry("me")
    d.admit(gen("r"), mine)
    with pytest.raises(InvalidRequest, match="another client"):
        d.abort("r", "someone else")
    assert not mine.aborted
    assert d.abort("r", "me") is False  # NOTE: not sent yet: nothing to tell the scheduler
    assert d.forwarded("r", mine) is False and "r" not in d.table
    assert d.abort("gone", "me") is False  # unknown rid: a no-op


def test_a_lost_client_aborts_only_its_own_requests():
    d = door(max_in_flight=4)
    for rid, owner in (("a", "x"), ("b", "x"), ("c", "y")):
        entry = Entry(owner)
        d.admit(gen(rid), entry)
        d.forwarded(rid, entry)
    assert sorted(d.owner_gone("x")) == ["a", "b"]
    assert not d.table.get("c").aborted and d.table.get("a").gone


def test_health_rule():
    d = door()
    assert d.health() == (True, "")
    d.last_tick = time.monotonic() - core_module.HEALTHY_WITHIN_S - 1
    healthy, detail = d.health()
    assert not healthy and "silent" in detail
    d.tick()
    d.draining = True
    assert d.health() == (False, "shutting down")


def test_health_probe_verdicts():
    p = HealthProbe()
    assert p.request().params == {"max_tokens": 1, "temperature": 0.0}
    assert p.feed(tc.Chunk(p.rid, token_ids=[5])) is None
    assert p.feed(tc.Chunk(p.rid, finish_reason="length")) == (True, "")
    empty = HealthProbe()
    assert empty.feed(tc.Chunk(empty.rid, finish_reason="stop"))[0] is False  # no token
    failed = HealthProbe()
    assert failed.feed(tc.Failure(failed.rid, "overloaded", "busy")) == (False, "overloaded: busy")
    late = HealthProbe()
    assert late.expired() is None
    late.deadline = time.monotonic() - 0.1
    assert late.expired()[0] is False


def test_welcome_checks_version_then_key():
    d = door(key="k")
    reply = d.welcome(tt.Hello("h", PROTOCOL_VERSION + 1, "k"))
    assert isinstance(reply, tc.Failure) and reply.kind == "protocol"
    assert d.welcome(tt.Hello("h", PROTOCOL_VERSION, "bad")).kind == "unauthorized"
    assert isinstance(d.welcome(tt.Hello("h", PROTOCOL_VERSION, "k")), tc.Welcome)
    assert door().key_ok(None) and not d.key_ok(None)


def test_metrics_count_chain_breaks_by_reason():
    """Every reason the scheduler counts a decode step that did not chain is a label on
    `mlx_engine_chain_breaks_total`, read from its stats."""
    from scheduler_proc.scheduler import BREAKS
    from tokenizer_proc.metrics import CHAIN_BREAKS

    assert CHAIN_BREAKS == BREAKS
    d = door()
    text = d.metrics.render(d.stats({"chain_breaks_seat": 3, "chain_breaks_finish": 1})).decode()
    samples = {
        dict(s.labels).get("reason"): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mlx_engine_chain_breaks_total"
    }
    assert samples == {**dict.fromkeys(BREAKS, 0.0), "seat": 3.0, "finish": 1.0}


def test_metrics_observe_a_request_timeline():
    d = door()
    entry = Entry("c")
    d.admit(gen("r"), entry)
    d.forwarded("r", entry)
    d.on_chunk(tc.Chunk("r", token_ids=[1]))
    d.on_chunk(tc.Chunk("r", token_ids=[2, 3]))
    d.on_chunk(tc.Chunk("r", finish_reason="length", prompt_tokens=1, completion_tokens=3))
    text = d.metrics.render(d.stats({"kv_tokens_in_use": 3, "kv_tokens_free": 5})).decode()
    samples = {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["mlx_engine_time_to_first_token_seconds_count[]"] == 1
    assert samples["mlx_engine_inter_token_latency_seconds_count[]"] == 2
    assert samples["mlx_engine_e2e_request_latency_seconds_count[]"] == 1
    assert samples["mlx_engine_requests_finished_total[('reason', 'length')]"] == 1
    assert samples["mlx_engine_prompt_tokens_total[]"] == 1
    assert samples["mlx_engine_kv_tokens_total[]"] == 8
