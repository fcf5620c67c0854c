"""The reliability suite: one engine on loopback through storms of aborts and
disconnects, thousands of fuzzed frames and hostile clients; nothing lost, nothing stalled, KV and
resident memory back where they started. Figures go to the "reliability figures" summary."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import zmq
from engine_harness import LaunchedEngine
from figures import SOAK_S
from fuzz import frames
from good_client import GoodClient
from hostile import NeverReader, huge_inputs
from http_fuzz import probes, send
from load import Tally, client_loop, closing_clients, killed_clients, resetter
from tcp_proxy import TcpProxy

from engine import open_files
from engine.client import EngineClient
from engine.messages import to_tokenizer as tt
from engine.transport import encode_request

STORM_S = SOAK_S or 12.0
FUZZ_FRAMES = int(3000 * max(1.0, SOAK_S / 12.0))
HTTP_FUZZ = int(3000 * max(1.0, SOAK_S / 12.0))
HTTP_FUZZ_S = max(SOAK_S, 15.0)  # NOTE: the time bound; the count is usually reached first
HTTP_FUZZ_WORKERS = 4
HOSTILE_S = min(SOAK_S, 60.0) or 10.0
FLOOD_CONNECTIONS = 5000
WORST_LATENCY_BOUND_S = 5.0
OPTIONS = (
    "--max-total-tokens", "16384", "--context-length", "512", "--max-running-requests", "16",
    "--max-queued-requests", "32", "--client-share", "0.25", "--shutdown-grace", "1",
)  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("reliability") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log, *OPTIONS).wait_ready()
    with EngineClient(launched.address) as c:  # NOTE: warm up before memory is measured
        for i in range(8):
            c.generate(input_ids=[i + 1] * 40, max_tokens=24, ignore_eos=True)
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def rss_before(engine) -> dict[str, int]:
    # NOTE: structured output builds its llguidance tokenizer and grammar caches once, on first
    # use (+90 MB in the scheduler for 49k tokens, flat over the next 400 constrained requests):
    # warmed here so that the soak measures growth, not that one-time build.
    with EngineClient(engine.address, timeout=60) as c:
        schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        for i in range(8):
            c.generate(input_ids=[1, 2, 3, i], max_tokens=12, json_schema=schema, seed=i)
            c.generate(input_ids=[1, 2, 3, i], max_tokens=6, regex="[0-9]{3}", seed=i)
    return _rss(engine)


def _rss(engine: LaunchedEngine) -> dict[str, int]:
    pids = {"launcher": engine.proc.pid, **engine.child_pids()}
    return {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}


def _settled(client: EngineClient, within: float = 20.0) -> dict[str, float]:
    """Stats once nothing is in flight and no KV is held (fails the test after `within`)."""
    deadline = time.monotonic() + within
    while True:
        stats = client.stats()
        busy = stats["requests_in_flight"] + stats["running"] + stats["waiting"]
        if busy == 0 and stats["kv_tokens_in_use"] == 0 and stats["kv_slots_in_use"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine did not settle: {stats}"
        time.sleep(0.1)


def _run_threads(targets: list[tuple], timeout: float) -> int:
    threads = [threading.Thread(target=f, args=a, daemon=True) for f, *a in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return sum(t.is_alive() for t in threads)


def test_storm_of_aborts_and_disconnects_loses_nothing(engine, rss_before, report):
    tally = Tally()
    proxy = TcpProxy(engine.port)
    until = time.monotonic() + STORM_S
    try:
        hung = _run_threads(
            [
                (client_loop, engine.address, 1, until, tally),
                (client_loop, engine.address, 2, until, tally),
                (client_loop, engine.address, 3, until, tally),
                (client_loop, proxy.address, 4, until, tally),
                (client_loop, proxy.address, 5, until, tally),
                (resetter, proxy, until, tally),
                (closing_clients, engine.address, 6, until, tally),
                (killed_clients, engine.address, 3, tally),
            ],
            timeout=STORM_S + 60,
        )
    finally:
        proxy.close()
    with EngineClient(engine.address) as c:
        stats = _settled(c)
    counts = dict(tally.counts)
    report["storm requests"] = (
        f"sent {counts['submitted']}, completed {counts['completed']}, aborted "
        f"{counts['aborted']}, errored {counts['errored']}, lost {counts.get('lost', 0) + hung}"
    )
    report["storm faults injected"] = f"{sum(tally.faults.values())} {dict(tally.faults)}"
    report["storm engine counters"] = {k: v for k, v in stats.items() if k.startswith("finish_")}
    assert hung == 0 and counts.get("lost", 0) == 0, counts
    assert counts["submitted"] == tally.ended, counts
    assert tally.faults["connection resets"] > 0 and counts["errored"] > 0, counts


def test_thousands_of_fuzzed_frames_never_stop_the_engine(engine, rss_before, report):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.address)
    good = GoodClient(engine.address, duration=3.0)
    replies = 0
    try:
        for frame in frames(seed=7, n=FUZZ_FRAMES):
            sock.send(frame)
            while sock.poll(0):
                sock.recv()
                replies += 1
        sock.send(encode_request(tt.Goodbye()))  # NOTE: its valid requests end with it
        while sock.poll(1000):
            sock.recv()
            replies += 1
    finally:
        sock.close()
        ctx.term()
        good.join()
    assert engine.proc.poll() is None, "the engine died"
    with EngineClient(engine.address) as c:
        assert c.health_generate()
        stats = _settled(c)
    report["fuzz"] = (
        f"{FUZZ_FRAMES} frames sent, {replies} replies, {int(stats.get('bad_frames', 0))} "
        f"refused as malformed; good client {good.summary()}"
    )
    assert good.errors == [] and len(good.latencies) > 0, good.errors


def test_thousands_of_fuzzed_http_requests_are_never_a_500(engine, rss_before, report):
    """Generated HTTP requests (tests/reliability/http_fuzz.py) from a few connections at once:
    bad input is a 4xx (or a closed connection), never a 5xx or a hang; the engine lives, serves
    a well-behaved request right after and settles with nothing in flight."""
    statuses: Counter[str] = Counter()
    examples: dict[str, bytes] = {}
    generated = probes(seed=11, n=HTTP_FUZZ)
    lock = threading.Lock()
    deadline = time.monotonic() + HTTP_FUZZ_S
    log_start = len(engine.log())

    def worker() -> None:
        while time.monotonic() < deadline:
            with lock:
                probe = next(generated, None)
            if probe is None:
                return
            status = send(engine.http_port, probe, timeout=30.0)
            with lock:
                statuses[status] += 1
                examples.setdefault(status, probe.data[:300])

    good = GoodClient(engine.address, duration=3.0)
    try:
        hung = _run_threads([(worker,)] * HTTP_FUZZ_WORKERS, timeout=HTTP_FUZZ_S + 60)
    finally:
        good.join()
    tried = sum(statuses.values())
    report["HTTP fuzz"] = (
        f"{tried} requests tried; by status {dict(sorted(statuses.items()))}; good client "
        f"{good.summary()}"
    )
    assert engine.proc.poll() is None, "the engine died"
    assert hung == 0 and statuses["timeout"] == 0, (statuses, examples.get("timeout"))
    errors = {s: examples[s] for s in statuses if s[0] == "5"}
    assert not errors, errors
    log = engine.log()[log_start:]
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 200) :][:3000]
    assert _http_chat(engine) == 200
    with EngineClient(engine.address) as c:
        _settled(c)
    assert good.errors == [] and len(good.latencies) > 0, good.errors


def _http_chat(engine: LaunchedEngine) -> int:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        resp = conn.getresponse()
        assert json.loads(resp.read())["choices"], "no choices"
        return resp.status
    finally:
        conn.close()


def test_a_flood_of_silent_connections_leaves_everyone_else_served(engine, report):
    """5,000 HTTP connections that never finish their headers, opened as fast as they go: those
    beyond the per-peer cap are refused at once, the SDK keeps serving a good client (p99 under
    1 s) and a new one connects, the log grows by one line a report, and HTTP answers once they
    are gone (before, 1,100 such connections took the whole front door down, ZMQ included)."""
    open_files.raise_limit()
    start = len(engine.log())
    good = GoodClient(engine.address, duration=6.0)
    socks, failed = [], 0
    t0 = time.monotonic()
    for _ in range(FLOOD_CONNECTIONS):
        try:
            s = socket.create_connection(("127.0.0.1", engine.http_port), timeout=5)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        except OSError:
            failed += 1
    opened = time.monotonic() - t0
    try:
        with EngineClient(engine.address, timeout=10) as c:
            assert c.generate(input_ids=[5, 6, 7], max_tokens=4).usage.completion_tokens == 4
        time.sleep(2.0)
    finally:
        for s in socks:
            s.close()
    good.join()
    grown = len(engine.log()) - start
    p99 = good.quantile(0.99)
    report["connection flood"] = (
        f"{FLOOD_CONNECTIONS} silent connections in {opened:.1f} s ({failed} failed to connect); "
        f"good client {good.summary()}; log +{grown} bytes"
    )
    assert good.errors == [] and p99 <= 1.0, good.summary()
    assert grown < 1 << 20 and "Traceback" not in engine.log()[start:]
    assert _http_chat(engine) == 200


def test_hostile_clients_do_not_stall_a_good_one(engine, rss_before, report):
    baseline = GoodClient(engine.address, n=30)
    baseline.join()
    tally = Tally()
    proxy = TcpProxy(engine.port)
    never = NeverReader(engine.address, 8, tally)
    good = GoodClient(engine.address, duration=HOSTILE_S)
    until = time.monotonic() + HOSTILE_S
    try:
        hung = _run_threads(
            [
                (huge_inputs, engine.address, until, tally),
                (client_loop, proxy.address, 11, until, tally),
                (resetter, proxy, until, tally, 0.2),
            ],
            timeout=HOSTILE_S + 90,
        )
    finally:
        good.join()
        never.close()
        proxy.close()
    with EngineClient(engine.address) as c:
        _settled(c)
    report["hostile"] = (
        f"{HOSTILE_S:.0f}s of huge inputs ({tally.counts['bad inputs']} tried: "
        f"{ {k: v for k, v in tally.counts.items() if k[0].isupper()} }), resets "
        f"({tally.faults['connection resets']}), a never-reading client"
    )
    report["good client latency, quiet"] = baseline.summary()
    report["good client latency, under hostile load"] = good.summary()
    assert hung == 0
    assert good.errors == [], good.errors
    assert max(good.latencies) < WORST_LATENCY_BOUND_S, good.summary()


def test_resident_memory_is_flat(engine, rss_before, report):
    mib = 1 << 20

    # NOTE: 64 MiB of slack over 1.25x: after the hostile phase the front door measured 137 ->
    # 192, 196 and 211 MiB in three whole-suite runs (211 failed a 32 MiB slack), the scheduler
    # 211 -> 219 and 293 (its KV pool grown by the flood, shrunk only once idle with no cached
    # page high in it). A leak grows with the thousands of requests sent; this does not.
    def flat(after: dict[str, int]) -> bool:
        return all(after[k] < before * 1.25 + 64 * mib for k, before in rss_before.items())

    # NOTE: the front door gives memory back a second after a large input (tokenizer_proc.trim),
    # on its tokenization pool: on a loaded box the pool may still be busy with hostile inputs.
    deadline = time.monotonic() + 30
    while not flat(after := _rss(engine)) and time.monotonic() < deadline:
        time.sleep(0.25)
    report["RSS before -> after (MiB)"] = {
        k: f"{rss_before[k] / mib:.0f} -> {after[k] / mib:.0f}" for k in after
    }
    assert flat(after), report["RSS before -> after (MiB)"]
