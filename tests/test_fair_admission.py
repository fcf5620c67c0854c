"""Fair admission and scheduling across clients (docs/operations.md, "Fair admission"): a client
that floods holds no more than its share of admission or of running rows while others wait, and
a light client's request gets a row within a step.

The rules on their own (the waiting queue, the front door's share, who a client is), then the
scheduler on a tiny random model: a flood of long requests from one client, a light request
from another, the preempted rows' outputs still equal to mlx-lm's own greedy generation.
"""

from __future__ import annotations

import http.client
import json
import random
import time

import msgspec
import pytest
from engine_harness import LaunchedEngine, post_json, raw_dealer
from scheduler_util import (
    assert_pages_balanced,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine import api_keys
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.errors import Overloaded
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION
from engine.sampling_params import SamplingParams
from scheduler_proc.request import Req
from scheduler_proc.waiting import WaitingQueue
from tokenizer_proc.core import DoorSettings, FrontDoor, door_settings, peer_client
from tokenizer_proc.requests import Entry

pytestmark = pytest.mark.timeout(120)


# --- the waiting queue ------------------------------------------------------------------------


def _req(rid: str, client: str) -> Req:
    return Req(rid, [1], SamplingParams(), 0, 1, frozenset(), client)


def _drain(q: WaitingQueue, rows: dict[str, int]) -> list[str]:
    order = []
    while len(q):
        req = q.popleft(lambda c: rows.get(c, 0))
        order.append(req.rid)
        q.served(req.client)
        rows[req.client] = rows.get(req.client, 0) + 1
    return order


def test_one_client_is_served_in_arrival_order():
    q = WaitingQueue()
    for i in range(5):
        q.append(_req(f"r{i}", "a"))
    q.appendleft(_req("back", "a"))  # NOTE: a preempted or deferred request goes first again
    assert _drain(q, {}) == ["back", "r0", "r1", "r2", "r3", "r4"]


def test_clients_take_turns_and_the_one_with_fewest_rows_goes_first():
    q = WaitingQueue()
    for i in range(4):
        q.append(_req(f"hog{i}", "hog"))
    q.append(_req("light", "light"))
    # NOTE: the hog holds 3 rows already: the light client's one request goes before all of its
    assert _drain(q, {"hog": 3}) == ["light", "hog0", "hog1", "hog2", "hog3"]
    for i in range(3):
        q.append(_req(f"a{i}", "a"))
        q.append(_req(f"b{i}", "b"))
    assert _drain(q, {}) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_remove_and_iteration_and_no_state_left_behind():
    q = WaitingQueue()
    reqs = [_req("a0", "a"), _req("b0", "b"), _req("a1", "a")]
    for r in reqs:
        q.append(r)
    assert {r.rid for r in q} == {"a0", "a1", "b0"} and len(q) == 3
    q.remove(reqs[1])
    assert q.clients() == ["a"]
    _drain(q, {})
    assert len(q) == 0 and q.clients() == [] and not q._served


# --- the front door's share ---------------------------------------------------------------------


def _door(capacity: int = 32, cap: int = 0) -> FrontDoor:
    return FrontDoor(DoorSettings("m", 100, 64, capacity, client_cap=cap))


def _admit(d: FrontDoor, rid: str, client: str | None) -> None:
    d.admit(tt.Generate(rid, input_ids=[1], params={"max_tokens": 2}), Entry(rid, client=client))


def test_a_flooding_client_leaves_the_reserve_to_others():
    d = _door(32)  # NOTE: the reserve is 32 // 16 = 2 requests
    for i in range(30):
        _admit(d, f"hog{i}", "hog")
    with pytest.raises(Overloaded, match="fair share"):
        _admit(d, "hog30", "hog")
    _admit(d, "light", "light")  # NOTE: below its share: the reserve is its
    _admit(d, "other", "other")
    with pytest.raises(Overloaded, match="in flight"):  # NOTE: full: no one is admitted
        _admit(d, "late", "late")
    assert d.table.count("hog") == 30 and d.table.clients() == 3


def test_near_full_each_client_keeps_to_its_fair_share():
    d = _door(32)
    for i in range(20):
        _admit(d, f"a{i}", "a")
    for i in range(10):
        _admit(d, f"b{i}", "b")  # NOTE: 30 in flight: the reserve is next
    with pytest.raises(Overloaded, match="fair share"):
        _admit(d, "a20", "a")  # NOTE: 20 >= 30 // 2
    _admit(d, "b10", "b")  # NOTE: 10 < 15: b may still take the reserve
    for rid in [f"a{i}" for i in range(20)]:
        d.table.pop(rid)  # NOTE: a's requests finished: it may take what is free again
    _admit(d, "a-again", "a")


def test_the_static_cap_and_requests_outside_fairness():
    d = _door(32, cap=4)
    for i in range(4):
        _admit(d, f"a{i}", "a")
    with pytest.raises(Overloaded, match="client-share"):
        _admit(d, "a4", "a")
    for i in range(20):
        _admit(d, f"engine{i}", None)  # NOTE: health generations count for no client
    assert d.table.clients() == 1


def test_limits_count_the_schedulers_rows_and_the_share():
    config = EngineConfig(max_queued_requests=100, client_share=0.5)
    limits = door_settings(config, ("m", 100, 64, 28))
    assert limits.max_in_flight == 128 and limits.client_cap == 64


# --- who a client is ----------------------------------------------------------------------------


def test_an_http_client_is_its_peer_unless_a_trusted_proxy_names_it():
    proxies = frozenset({"10.0.0.1", "10.0.0.2"})
    assert peer_client("192.0.2.7", "1.2.3.4", proxies) == "peer:192.0.2.7"
    assert peer_client("10.0.0.1", "1.2.3.4", proxies) == "peer:1.2.3.4"
    # NOTE: the client may send its own X-Forwarded-For; only the proxies' last hop counts
    assert peer_client("10.0.0.2", "6.6.6.6, 1.2.3.4, 10.0.0.1", proxies) == "peer:1.2.3.4"
    assert peer_client("10.0.0.1", "", proxies) == "peer:10.0.0.1"
    assert peer_client(None, "", frozenset()) == "peer:unknown"


def test_with_client_keys_the_key_is_the_client(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# clients\nalice sk-alice-0001\n\nsk-anon-00002  # a key without a name\n")
    keys = api_keys.load(path)
    assert keys == {"sk-alice-0001": "alice", "sk-anon-00002": "key-4"}
    d = FrontDoor(DoorSettings("m", 100, 64, 8, api_key="owner-key-01", client_keys=keys))
    assert d.client_of("sk-alice-0001", "peer:127.0.0.1") == "key:alice"
    assert d.client_of("owner-key-01", "sdk:00ab") == "key:owner"
    assert d.key_ok("sk-anon-00002") and not d.key_ok("sk-wrong-000")
    # NOTE: only the owner's key controls the engine
    assert d.control_ok("owner-key-01") and not d.control_ok("sk-alice-0001")
    one_key = FrontDoor(DoorSettings("m", 100, 64, 8, api_key="owner-key-01"))
    assert one_key.client_of("owner-key-01", "peer:127.0.0.1") == "peer:127.0.0.1"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "no keys"),
        ("a b c\n", "NAME KEY"),
        ("alice short\n", "8\\+ characters"),
        ("alice sk-000000001\nbob sk-000000001\n", "key is taken"),
        ("alice sk-000000001\nalice sk-000000002\n", "name 'alice' is taken"),
        ("owner sk-000000001\n", "name 'owner' is taken"),
    ],
)
def test_a_bad_keys_file_names_its_line(tmp_path, text, error):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        api_keys.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        api_keys.load(tmp_path / "missing")


# --- the scheduler ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _first_token_step(sched, rid: str, limit: int = 200) -> tuple[int, dict]:
    outs: dict = {}
    for step in range(1, limit):
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
        if tokens(outs.get(rid, [])):
            return step, outs
    raise AssertionError(f"{rid} got no token in {limit} steps")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_light_client_gets_a_row_within_a_step_while_another_floods(llama, overlap):
    """The hog fills all 8 rows and queues 24 more long requests; the light client's request
    takes a row from the hog at once (before, it waited behind all 24), and every preempted hog
    request still ends with mlx-lm's own greedy tokens."""
    sched = make_scheduler(llama, max_running_requests=8, disable_overlap=not overlap)
    rng = random.Random(7)
    hog = {f"hog{i}": random_prompt(rng, 24) for i in range(32)}
    for rid, prompt in hog.items():
        sched.submit(rid, prompt, greedy(40), client="hog")
    outs: dict = {}
    for _ in range(6):  # NOTE: every row decoding
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    assert sched.running.rows_of("hog") == 8
    light = random_prompt(rng, 16)
    sched.submit("light", light, greedy(4), client="light")
    steps, more = _first_token_step(sched, "light")
    assert steps <= 3, f"the light request waited {steps} steps for its first token"
    for rid, chunks in more.items():
        outs.setdefault(rid, []).extend(chunks)
    while sched.has_work():
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
    assert sched.stats()["requests_preempted"] >= 1
    assert tokens(outs["light"]) == reference_greedy(llama, light, 4)
    for rid in ("hog0", "hog7", "hog8", "hog31"):
        assert tokens(outs[rid]) == reference_greedy(llama, hog[rid], 40), rid
    assert all(outs[rid][-1].finish_reason == "length" for rid in hog)
    assert_pages_balanced(sched)


def test_two_flooding_clients_converge_to_equal_rows(llama):
    sched = make_scheduler(llama, max_running_requests=8)
    rng = random.Random(3)
    for i in range(16):
        sched.submit(f"a{i}", random_prompt(rng, 16), greedy(200), client="a")
    for _ in range(4):
        sched.step()
    for i in range(16):
        sched.submit(f"b{i}", random_prompt(rng, 16), greedy(200), client="b")
    for _ in range(12):
        sched.step()
    assert sched.running.rows_of("a") == sched.running.rows_of("b") == 4
    preempted = sched.stats()["requests_preempted"]
    for _ in range(20):  # NOTE: balanced: no more rows change hands
        sched.step()
    assert sched.stats()["requests_preempted"] == preempted == 4


# --- through a launched engine ------------------------------------------------------------------

KEYS = {"alice": "sk-alice-0001", "bob": "sk-bob-000001"}


@pytest.fixture(scope="module")
def keyed(tiny_model_dir, tmp_path_factory):
    """Client keys, 2 rows and 6 queued: admission holds 8, the reserve is 1."""
    d = tmp_path_factory.mktemp("fair")
    (d / "keys").write_text("".join(f"{n} {k}\n" for n, k in KEYS.items()))
    options = ("--api-keys-file", str(d / "keys"), "--client-share", "1")
    options += ("--max-running-requests", "2", "--max-queued-requests", "6")
    launched = LaunchedEngine(tiny_model_dir, d / "launch.log", *options).wait_ready()
    yield launched
    launched.stop()


def _send_long(engine: LaunchedEngine, key: str) -> http.client.HTTPConnection:
    """A long streamed completion, sent; its reply is not read (a queued request's headers come
    with its first token)."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    body = {"prompt": "tell me", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    return conn


def _in_flight(client: EngineClient, n: int, within: float = 20.0) -> None:
    """Until the scheduler holds `n` requests, running or waiting (the front door's count came
    first: on a loaded box bob's request once overtook alice's on their way to the scheduler,
    took a row still free, and no row changed hands)."""
    deadline = time.monotonic() + within
    while (stats := client.stats())["running"] + stats["waiting"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests in flight: {stats}"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_key_that_floods_leaves_room_and_rows_to_another(keyed):
    """Alice's 8 long streams: 7 admitted, the 8th refused for her fair share (the reserve is
    Bob's); Bob's request is then admitted, takes a row from Alice at once and answers; only
    the owner's token stops the engine or reads its stats, not a client key."""
    owner = EngineClient(keyed.address, api_key=KEYS["bob"], timeout=10.0)
    conns = [_send_long(keyed, KEYS["alice"]) for _ in range(7)]
    try:
        _in_flight(owner, 7)
        conns.append(_send_long(keyed, KEYS["alice"]))
        refused = conns[-1].getresponse()
        assert refused.status == 429 and "fair share" in refused.read().decode()
        t0 = time.monotonic()
        status, reply = post_json(
            keyed,
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 4, "ignore_eos": True},
            Authorization=f"Bearer {KEYS['bob']}",
        )
        waited = time.monotonic() - t0
        assert status == 200 and reply["usage"]["completion_tokens"] == 4, reply
        assert waited < 10.0, f"bob waited {waited:.1f} s behind alice's streams"
        with raw_dealer(keyed.address) as ask:
            hello = tt.Hello("h", PROTOCOL_VERSION, KEYS["alice"])
            assert isinstance(ask(msgspec.msgpack.encode(hello)), tc.Welcome)
            reply = ask(msgspec.msgpack.encode(tt.GetStats("s", KEYS["alice"])))
            assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized", reply
        stats = owner.stats()  # NOTE: this user's SDK sends the owner's token, not bob's key
        assert stats["requests_preempted"] >= 1 and stats["requests_in_flight"] == 7
    finally:
        for conn in conns:
            conn.close()
        owner.close()
    assert "Traceback" not in keyed.log()


def test_a_burst_between_steps_fills_the_free_rows_and_the_queue(llama):
    """The front door admits running rows + queued; so does the scheduler, though none of a
    burst has a row yet (before, it refused all beyond --max-queued-requests: 1 in 7 here)."""
    sched = make_scheduler(llama, max_running_requests=2, max_queued_requests=2)
    for i in range(4):
        sched.submit(f"r{i}", [1, 2, 3], greedy(2))
    with pytest.raises(Overloaded, match="already waiting"):
        sched.submit("r4", [1, 2, 3], greedy(2))
    while sched.has_work():
        sched.step()
    assert sched.stats()["requests_finished"] == 4
