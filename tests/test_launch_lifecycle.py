"""The launcher's lifecycle with real processes: graceful SIGTERM, kill -9 of each child, a child
that cannot start, a second signal, and a launcher that dies under its children."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engine_harness import (  # noqa: F401
    LaunchedEngine,
    alive,
    bounded,
    free_port,
    kill_quietly,
    wait_gone,
)

from engine.client import EngineClient
from engine.errors import EngineDead, ShuttingDown

pytestmark = pytest.mark.usefixtures("bounded")
STALLED_CLIENT = Path(__file__).with_name("stalled_client.py")
STALL_S = 1.5
LONG = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
SMALL_POOL = ("--max-total-tokens", "8192", "--context-length", "1024")


@pytest.fixture
def launch(tiny_model_dir: Path, tmp_path: Path):
    engines: list[LaunchedEngine] = []

    def start(*extra: str) -> LaunchedEngine:
        engines.append(
            LaunchedEngine(tiny_model_dir, tmp_path / f"launch{len(engines)}.log", *extra)
        )
        return engines[-1].wait_ready()

    yield start
    for e in engines:
        e.stop()


class Streams:
    """n streams on their own threads; records each one's last chunk or error."""

    def __init__(self, address: str, n: int) -> None:
        self.client = EngineClient(address, timeout=60.0)
        self.started = [threading.Event() for _ in range(n)]
        self.ends: list[object] = [None] * n
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()
        for e in self.started:
            assert e.wait(60), "a stream produced no token"

    def _run(self, i: int) -> None:
        try:
            for chunk in self.client.stream(input_ids=[i + 1, 7, 9], **LONG):
                self.started[i].set()
                self.ends[i] = chunk.finish_reason
                if chunk.error:
                    self.ends[i] = f"error: {chunk.error}"
        except Exception as e:  # noqa: BLE001 - recorded for the test to check
            self.ends[i] = e
            self.started[i].set()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"


def test_sigterm_with_16_streams_in_flight(launch):
    engine = launch("--shutdown-grace", "1")
    children = list(engine.child_pids().values())
    streams = Streams(engine.address, 16)
    engine.signal(signal.SIGTERM)
    while streams.client.health():  # NOTE: the launcher needs a moment to pass the word on
        time.sleep(0.02)
    with pytest.raises((ShuttingDown, EngineDead)):
        streams.client.generate(input_ids=[1], max_tokens=1)
    assert engine.wait(timeout=1 + 15) == 0
    streams.join(10)
    assert all(end in ("abort", "length") for end in streams.ends), streams.ends
    assert wait_gone(children, 5) == []
    assert "engine stopped" in engine.log()


def test_sigterm_while_a_client_is_stopped_it_still_gets_every_chunk(launch):
    """A client that reads nothing while the engine drains (a starved machine stops one just so)
    still gets every chunk when it runs again: the front door waits for it to read them. Before,
    the front door exited with them in its kernel buffers, and the client's first frame on waking
    (a liveness ping) reached a closed socket: the kernel reset the connection, dropping them."""
    engine = launch("--shutdown-grace", "1")
    cmd = [sys.executable, str(STALLED_CLIENT), engine.address, "8"]
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        assert client.stdout.readline() == "started\n"
        client.send_signal(signal.SIGSTOP)
        time.sleep(STALL_S)  # NOTE: a backlog larger than the client's socket buffers
        engine.signal(signal.SIGTERM)
        while engine.proc.poll() is None and "to read their last replies" not in engine.log():
            time.sleep(0.05)
        client.send_signal(signal.SIGCONT)
        ends = json.loads(client.stdout.readline())
        assert engine.wait(timeout=15) == 0
    finally:
        client.kill()
        client.communicate(timeout=10)
    assert all(e.get("finish") in ("abort", "length") for e in ends), ends
    assert all(e["received"] == e["counted"] for e in ends), ends
    # NOTE: the client's answer, not its goodbye or the front door's deadline, ended the wait.
    assert "every client read its last replies" in engine.log()


@pytest.mark.parametrize("victim", ["scheduler", "tokenizer", "detokenizer"])
def test_kill_9_of_a_child(launch, victim):
    engine = launch()
    pids = engine.child_pids()
    streams = Streams(engine.address, 4)
    kill_quietly(pids[victim])
    streams.join(15)
    assert all(isinstance(end, EngineDead) for end in streams.ends), streams.ends
    assert engine.wait(timeout=15) != 0
    assert wait_gone(list(pids.values()), 5) == []
    with pytest.raises(EngineDead):
        streams.client.generate(input_ids=[1], max_tokens=1)


def test_child_that_cannot_start_is_reported(launch, tiny_model_dir, tmp_path):
    engine = LaunchedEngine(tiny_model_dir, tmp_path / "bad.log", "--model", str(tmp_path / "nope"))
    try:
        assert engine.wait(timeout=60) != 0
        assert "scheduler failed to start" in engine.log() and "nope" in engine.log()
    finally:
        engine.stop()


def test_port_in_use_fails_fast_before_the_model_loads(tiny_model_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        engine = LaunchedEngine(tiny_model_dir, tmp_path / "busy.log", "--zmq-port", port)
        try:
            assert engine.wait(timeout=60) != 0
            assert "address already in use" in engine.log() and port in engine.log()
            assert "scheduler" not in engine.log(), "the model was loaded before the bind"
        finally:
            engine.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER")
def test_the_launcher_exits_after_every_process_it_started(tiny_model_dir, tmp_path):
    """Run the launcher under a subreaper: whatever it started and left behind (the resource
    tracker of multiprocessing was one) is re-parented to the subreaper instead of vanishing."""
    port = free_port()
    launch = [sys.executable, "-m", "mlx_engine.cli", "launch", "--model", str(tiny_model_dir)]
    launch += ["--zmq-port", str(port), "--shutdown-grace", "1", *SMALL_POOL]
    wrapper = subprocess.run(
        [sys.executable, "-c", SUBREAPER, json.dumps(launch)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert wrapper.returncode == 0, wrapper.stderr[-3000:]
    report = json.loads(wrapper.stdout.splitlines()[-1])
    ok = report["launcher_exit"] == 0 and report["left_behind"] == []
    assert ok, (report, wrapper.stderr[-3000:])


SUBREAPER = r"""
import ctypes, json, os, signal, subprocess, sys, tempfile, time
import psutil
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
log = tempfile.NamedTemporaryFile("w+", suffix=".log")
launcher = subprocess.Popen(json.loads(sys.argv[1]), stderr=log)
deadline = time.monotonic() + 60
while "engine ready" not in open(log.name).read():  # NOTE: not while it is still starting
    assert launcher.poll() is None and time.monotonic() < deadline, open(log.name).read()
    time.sleep(0.1)
started = [p.pid for p in psutil.Process(launcher.pid).children(recursive=True)]
launcher.send_signal(signal.SIGTERM)
code = launcher.wait(30)
left = [(p.pid, p.name(), p.status()) for p in psutil.Process().children(recursive=True)]
for pid, _, _ in left:
    os.kill(pid, signal.SIGKILL)
print(json.dumps({"launcher_exit": code, "started": started, "left_behind": left}))
if code != 0:
    print(open(log.name).read(), file=sys.stderr)
"""


def test_second_signal_forces_a_fast_exit(launch):
    engine = launch("--shutdown-grace", "60")
    children = list(engine.child_pids().values())
    streams = Streams(engine.address, 2)
    engine.signal(signal.SIGTERM)
    time.sleep(0.5)
    engine.signal(signal.SIGINT)
    assert engine.wait(timeout=10) != 0
    assert wait_gone(children, 5) == []
    streams.join(15)


def test_children_exit_when_the_launcher_dies(launch):
    engine = launch()
    children = list(engine.child_pids().values())
    kill_quietly(engine.proc.pid)
    assert wait_gone(children, 10) == [], "orphaned children kept running"
    assert not alive(engine.proc.pid) or engine.proc.poll() is not None
