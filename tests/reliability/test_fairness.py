"""Fair admission under floods (docs/operations.md, "Fair admission"): one client key floods the
engine with long requests, over HTTP (1,100 connections) or one SDK connection (500 queued);
another key's client keeps being served, and new clients connect.

Before, admission was first come, first served: the flood filled every admission slot and every
running row, and the good client got timeouts, then 429 / `Overloaded` 30 of 30 times. The
engine runs its launch defaults (rows from the KV budget, 1,024 queued) except the keys file, a
context that holds 4,000 tokens, and no per-peer connection cap (on loopback every client is
one address). Figures go to the "reliability figures" summary.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from pathlib import Path

import pytest
from engine_harness import LaunchedEngine
from good_client import GoodClient

from engine import open_files
from engine.client import EngineClient
from engine.messages import to_tokenizer as tt

ATTACKER, GOOD = "sk-attacker-01", "sk-good-00001"
HTTP_FLOOD = 1100
SDK_FLOOD = 500
LONG = {"max_tokens": 4000, "ignore_eos": True}
OPTIONS = ("--context-length", "4608", "--http-max-connections-per-peer", "0")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    d = tmp_path_factory.mktemp("fairness")
    (d / "keys").write_text(f"attacker {ATTACKER}\ngood {GOOD}\n")
    options = (*OPTIONS, "--api-keys-file", str(d / "keys"))
    launched = LaunchedEngine(tiny_model_dir, d / "launch.log", *options).wait_ready()
    yield launched
    launched.stop()


def _settled(client: EngineClient, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while (stats := client.stats())["requests_in_flight"] + stats["running"] + stats["waiting"]:
        assert time.monotonic() < deadline, f"the engine did not settle: {stats}"
        time.sleep(0.2)


def _flood_http(engine: LaunchedEngine, n: int) -> list[socket.socket]:
    """`n` connections, each one non-streamed 4,000-token completion, never read."""
    body = json.dumps({"prompt": "tell me a story", **LONG}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ATTACKER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", engine.http_port), timeout=10)
        s.sendall(head + body)
        socks.append(s)
    return socks


def _until_in_flight(client: EngineClient, n: int, within: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + within
    while (stats := client.stats())["requests_in_flight"] < n:
        assert time.monotonic() < deadline, f"the flood did not arrive: {stats}"
        time.sleep(0.2)
    return stats


def _steps(stats: dict[str, float]) -> str:
    """The flood's step times: what a light request's tokens wait for, one a step."""
    kinds = sorted(k for k in stats if k.startswith("step_median_"))
    return "median steps " + ", ".join(f"{k[12:-2]} {stats[k] * 1e3:.0f} ms" for k in kinds)


# NOTE: before, the light client timed out at 20 s (or got 429s); now it gets a row within a
# step, then a token a step at the flood's pace (about 350 ms a step for 256 rows on this 2-core
# CPU: a first token in about 1 s, four tokens in about 2.2 s). The bounds leave a slower CI box
# room.
FIRST_TOKEN_BOUND_S = 5.0
FOUR_TOKENS_BOUND_S = 8.0


def test_a_key_flooding_http_with_long_requests_leaves_another_key_served(engine, report):
    open_files.raise_limit()
    with EngineClient(engine.address, api_key=GOOD) as owner:
        slots = int(owner.stats()["kv_slots_total"])
        start = len(engine.log())
        socks = _flood_http(engine, HTTP_FLOOD)
        try:
            flood = _until_in_flight(owner, min(HTTP_FLOOD, slots))
            sdk = GoodClient(engine.address, duration=8.0, key=GOOD)
            http = GoodClient(engine.http, duration=8.0, kind="http", key=GOOD)
            time.sleep(2.0)
            with EngineClient(engine.address, api_key=GOOD, timeout=10) as new:
                assert new.generate(input_ids=[5, 6, 7], max_tokens=4).usage.completion_tokens
            sdk.join()
            http.join()
            during = owner.stats()
        finally:
            for s in socks:
                s.close()
        _settled(owner)
    grown = len(engine.log()) - start
    report["long-request HTTP flood"] = (
        f"{HTTP_FLOOD} connections x 4,000-token completions from one key: "
        f"{int(flood['requests_in_flight'])} in flight ({slots} rows), "
        f"{int(during['requests_preempted'])} rows given back; another key: SDK "
        f"{sdk.summary()}; HTTP {http.summary()}; {_steps(during)}; log +{grown} bytes"
    )
    assert sdk.errors == [] and http.errors == [], (sdk.errors[:3], http.errors[:3])
    bound = FOUR_TOKENS_BOUND_S
    assert sdk.quantile(0.99) <= bound and http.quantile(0.99) <= bound, report
    assert grown < 1 << 20 and "Traceback" not in engine.log()[start:]


def test_one_sdk_connection_with_500_queued_requests_does_not_delay_another(engine, report):
    quiet = GoodClient(engine.address, n=20, kind="ttft", key=GOOD).join()
    hog = EngineClient(engine.address, api_key=ATTACKER)
    try:
        for i in range(SDK_FLOOD):
            rid = f"hog-{i}"
            hog._t.register(rid, lambda msg: None)  # NOTE: replies dropped as they come
            hog._t.send(tt.Generate(rid, input_ids=[7, 8, 9, i % 500 + 10], params=LONG))
        with EngineClient(engine.address, api_key=GOOD) as owner:
            stats = _until_in_flight(owner, SDK_FLOOD)
            loaded = GoodClient(engine.address, duration=8.0, kind="ttft", key=GOOD).join()
            during = owner.stats()
            ratio = statistics.median(loaded.latencies) / statistics.median(quiet.latencies)
            report["500 queued on one SDK connection"] = (
                f"{int(stats['waiting'])} waiting, {int(stats['running'])} running; another "
                f"key's first token: quiet {quiet.summary()}; beside the flood "
                f"{loaded.summary()} (p50 {ratio:.1f}x quiet); {_steps(during)}"
            )
    finally:
        hog.close()
    with EngineClient(engine.address, api_key=GOOD) as owner:
        _settled(owner)
    assert loaded.errors == [] and loaded.latencies, loaded.errors[:3]
    bound = FIRST_TOKEN_BOUND_S
    assert loaded.quantile(0.99) <= bound, report["500 queued on one SDK connection"]
