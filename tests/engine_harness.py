"""Launch real engines (`python -m mlx_engine.cli launch`) for tests, and always clean them up."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import generate_step

START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` consecutive free ports: a hostfile's ports and the one above its highest, where
    rank 0 listens for the frame links (a free port alone once had that one taken: 'Address
    already in use' in a full suite run)."""
    for _ in range(100):
        base = free_port()
        try:
            with ExitStack() as held:
                for p in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return list(range(base, base + n))
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


class LaunchedEngine:
    """One `mlx-engine launch` in its own process group; `stop()` leaves nothing running."""

    def __init__(self, model_dir: Path | None, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.http_port = free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--zmq-port", str(self.port)]
        cmd += ["--port", str(self.http_port)]
        cmd += ["--model", str(model_dir)] if model_dir is not None else []
        cmd += list(extra)
        self._log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> LaunchedEngine:
        deadline = time.monotonic() + timeout
        while "engine ready" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine did not start:\n{self.log()}")
            time.sleep(0.1)
        return self

    def child_pids(self) -> dict[str, int]:
        return {m[0]: int(m[1]) for m in re.findall(r"(\w+) ready \(pid (\d+)\)", self.log())}

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill whatever is left of the engine (launcher and children share one group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.child_pids().values():
            kill_quietly(pid)
        self.proc.wait(10)
        self._log.close()


def post_json(engine: LaunchedEngine, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    """One JSON POST to the engine's HTTP port: (status, decoded reply)."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    try:
        hdrs = {"Content-Type": "application/json", **headers}
        conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # NOTE: a zombie still answers kill(0); its state in /proc tells it apart where there is one.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def reference_greedy(model: object, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own single-request greedy generation."""
    import mlx.core as mx

    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(tok) for tok, _ in steps]


TEST_TIMEOUT_S = 120


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the main thread after `seconds` (the suite's per-test bound)."""

    def expire(signum: int, frame: object) -> None:
        # NOTE: scripts/planted_bugs.py tells a hang by this text.
        raise TimeoutError(f"the test ran past its deadline ({seconds} s)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def bounded() -> Iterator[None]:
    """Fail a test that launches processes past TEST_TIMEOUT_S instead of hanging CI."""
    with deadline(TEST_TIMEOUT_S):
        yield


@contextmanager
def raw_dealer(address: str) -> Iterator[Callable[[bytes], Any]]:
    """A bare DEALER socket to an engine: `ask(frame)` sends one frame, returns the decoded reply."""
    import zmq

    from engine.messages import to_client as tc
    from engine.protocol import Codec

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(address)
    codec = Codec(tc.ToClient)

    def ask(frame: bytes) -> tc.ToClient:
        sock.send(frame)
        return codec.decode(sock.recv())

    try:
        yield ask
    finally:
        sock.close()
        ctx.term()
