"""The engine under a real supervisord, configured by `mlx-engine supervisor-conf`:
start -> healthy; kill -9 of the scheduler -> non-zero exit -> restarted -> healthy again, old
clients got EngineDead; `supervisorctl stop` with streams in flight -> every stream gets its last
chunk, stopped within stopwaitsecs, no process left."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from engine_harness import alive, bounded, free_port, kill_quietly, wait_gone  # noqa: F401

from engine.client import EngineClient
from engine.errors import EngineDead, EngineError

pytestmark = pytest.mark.usefixtures("bounded")
LONG = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
GRACE_S = 2
SUPERVISORD_CONF = """\
[unix_http_server]
file={tmp}/supervisor.sock

[supervisord]
logfile={tmp}/supervisord.log
pidfile={tmp}/supervisord.pid
nodaemon=true

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{tmp}/supervisor.sock

"""


class Supervised:
    """supervisord on a temp dir running one engine program named `engine`."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        options = ["--model", str(model_dir), "--zmq-port", str(self.port)]
        # NOTE: a context long enough that no stream ends by itself during the test.
        options += ["--shutdown-grace", str(GRACE_S), "--max-total-tokens", "32768"]
        options += ["--context-length", "4096", "--name", "engine", "--log-dir", str(tmp)]
        section = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlx_engine.cli",
                "supervisor-conf",
                *options,
                "--startsecs",
                "3",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        self.stop_wait = int(re.search(r"stopwaitsecs=(\d+)", section).group(1))
        self.conf = tmp / "supervisord.conf"
        self.conf.write_text(SUPERVISORD_CONF.format(tmp=tmp) + section)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.supervisord", "-c", str(self.conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def ctl(self, *args: str) -> str:
        cmd = [sys.executable, "-m", "supervisor.supervisorctl", "-c", str(self.conf), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout

    def engine_log(self) -> str:
        path = self.tmp / "engine.log"
        return path.read_text() if path.exists() else ""

    def pids(self) -> dict[str, int]:
        """The latest launch's children (the log keeps every restart) and its launcher."""
        found = {
            m[0]: int(m[1]) for m in re.findall(r"(\w+) ready \(pid (\d+)\)", self.engine_log())
        }
        found["launcher"] = int(self.ctl("pid", "engine").strip() or 0)
        return found

    def wait_healthy(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with EngineClient(self.address, connect_timeout=2.0) as c:
                    if c.health_generate():
                        return
            except EngineError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"engine not healthy under supervisord:\n{self.engine_log()[-3000:]}")

    def close(self) -> None:
        kill_quietly(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            import os

            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Streams:
    """n streams on their own threads of one client; records each one's end."""

    def __init__(self, client: EngineClient, n: int) -> None:
        self.ends: list[object] = [None] * n
        self.started = [threading.Event() for _ in range(n)]
        self.threads = [threading.Thread(target=self._run, args=(client, i)) for i in range(n)]
        for t in self.threads:
            t.start()
        assert all(e.wait(60) for e in self.started), "a stream produced no token"

    def _run(self, client: EngineClient, i: int) -> None:
        try:
            for chunk in client.stream(input_ids=[i + 1, 5], **LONG):
                self.started[i].set()
                self.ends[i] = chunk.finish_reason
        except Exception as e:  # noqa: BLE001 - recorded for the test
            self.ends[i] = e
            self.started[i].set()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream hangs"


@pytest.fixture
def supervised(tmp_path: Path, tiny_model_dir: Path):
    s = Supervised(tmp_path, tiny_model_dir)
    yield s
    s.close()


def test_supervisord_restarts_a_crashed_engine_and_stops_a_busy_one(supervised):
    supervised.wait_healthy()
    first = supervised.pids()

    # kill -9 of the scheduler: the launcher exits non-zero, supervisord starts it again.
    old = EngineClient(supervised.address)
    streams = Streams(old, 4)
    kill_quietly(first["scheduler"])
    streams.join(15)
    assert all(isinstance(end, EngineDead) for end in streams.ends), streams.ends
    assert wait_gone(list(first.values()), 15) == []
    supervised.wait_healthy()
    assert "exit status 1; not expected" in (supervised.tmp / "supervisord.log").read_text()
    assert old.health_generate(), "an old client did not recover with the restarted engine"
    old.close()

    # supervisorctl stop with streams in flight: each gets its last chunk; nothing is left.
    second = supervised.pids()
    assert second["launcher"] != first["launcher"]
    client = EngineClient(supervised.address)
    streams = Streams(client, 4)
    t0 = time.monotonic()
    assert "stopped" in supervised.ctl("stop", "engine")
    stopped_in = time.monotonic() - t0
    streams.join(10)
    assert all(end in ("abort", "length") for end in streams.ends), streams.ends
    assert stopped_in < supervised.stop_wait, stopped_in
    assert wait_gone(list(second.values()), 2) == [], "a process outlived supervisorctl stop"
    assert "engine stopped" in supervised.engine_log()
    client.close()
