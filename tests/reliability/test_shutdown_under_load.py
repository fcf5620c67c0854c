"""Repeated graceful shutdown under load: each time, every stream gets its last chunk,
the launcher exits 0 and no process is left."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest
from engine_harness import LaunchedEngine, bounded, wait_gone  # noqa: F401
from figures import SOAK_S

from engine.client import EngineClient

pytestmark = pytest.mark.usefixtures("bounded")
CYCLES = 2 if not SOAK_S else 5
STREAMS = 8
OPTIONS = ("--max-total-tokens", "8192", "--context-length", "512", "--shutdown-grace", "0.5")


def _stream(client: EngineClient, i: int, started: threading.Event, ends: list) -> None:
    try:
        for chunk in client.stream(input_ids=[i + 1, 2], max_tokens=400, ignore_eos=True):
            started.set()
            ends[i] = chunk.finish_reason
    except Exception as e:  # noqa: BLE001 - recorded for the test
        ends[i] = e
        started.set()


def test_repeated_shutdown_under_load(tiny_model_dir: Path, tmp_path: Path, report):
    results = []
    for cycle in range(CYCLES):
        engine = LaunchedEngine(tiny_model_dir, tmp_path / f"cycle{cycle}.log", *OPTIONS)
        try:
            engine.wait_ready()
            pids = list(engine.child_pids().values())
            client = EngineClient(engine.address)
            ends: list[object] = [None] * STREAMS
            started = [threading.Event() for _ in range(STREAMS)]
            threads = [
                threading.Thread(target=_stream, args=(client, i, started[i], ends))
                for i in range(STREAMS)
            ]
            for t in threads:
                t.start()
            assert all(e.wait(60) for e in started)
            engine.signal(signal.SIGTERM)
            code = engine.wait(timeout=30)
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads), "a stream hangs after shutdown"
            client.close()
            left = wait_gone(pids, 5)
            results.append((code, ends, left))
            assert code == 0 and left == [], (code, left)
            assert all(end in ("abort", "length") for end in ends), ends
        finally:
            engine.stop()
    report["repeated shutdown under load"] = (
        f"{CYCLES} cycles x {STREAMS} streams: exit codes {[r[0] for r in results]}, "
        f"every stream ended with its last chunk, no process left"
    )
