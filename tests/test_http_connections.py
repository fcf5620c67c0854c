"""HTTP connections as a bounded resource: connections that never send their request headers are
closed at `--client-timeout`, a peer beyond its cap is refused at once, the log says so in one
line, not one per connection, and the SDK endpoint keeps serving throughout."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401

from engine.client import EngineClient

pytestmark = pytest.mark.usefixtures("bounded")
CAP, SLOW = 24, 2.0


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("conns") / "launch.log"
    extra = ("--http-max-connections-per-peer", str(CAP), "--client-timeout", str(SLOW))
    launched = LaunchedEngine(tiny_model_dir, log, *extra).wait_ready()
    yield launched
    launched.stop()


def _silent(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # NOTE: never finished
        socks.append(s)
    return socks


def _closed(s: socket.socket, within: float) -> float | None:
    """Seconds until the server closed `s` (None: still open after `within`)."""
    s.settimeout(within)
    t0 = time.monotonic()
    try:
        data = s.recv(1024)
    except (TimeoutError, ConnectionResetError) as e:
        return time.monotonic() - t0 if isinstance(e, ConnectionResetError) else None
    return time.monotonic() - t0 if data == b"" else None


def _complete(engine) -> int:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(engine.http + "/v1/completions", body, method="POST")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


def test_slow_headers_are_closed_and_a_peer_over_its_cap_refused(engine):
    start = len(engine.log())
    held = _silent(engine.http_port, CAP)
    extra = _silent(engine.http_port, 10)
    try:
        assert all(_closed(s, 1.0) is not None for s in extra), "over the cap, still open"
        with EngineClient(engine.address, timeout=10) as c:  # NOTE: ZMQ serves meanwhile
            assert c.generate(input_ids=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2
        waits = [_closed(s, SLOW + 5) for s in held]
        assert all(w is not None for w in waits), waits
        assert _complete(engine) == 200
    finally:
        for s in held + extra:
            s.close()
    log = engine.log()[start:]
    lines = [ln for ln in log.splitlines() if "HTTP connections:" in ln]
    assert 1 <= len(lines) <= 3 and "Traceback" not in log, lines
