"""`mlx-engine launch` for the benchmark scripts: started with given options, used once READY,
always stopped (SIGTERM to its process group, then SIGKILL)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

READY_TIMEOUT_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def launched_engine(options: list[str], log_path: Path) -> Iterator[tuple[int, int]]:
    """The engine launched with `options` (its log in `log_path`), once READY: (SDK port,
    HTTP port)."""
    zmq_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--zmq-port", str(zmq_port)]
    cmd += ["--port", str(http_port), *options]
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "engine ready" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log_path.read_text()[-3000:])
            time.sleep(0.2)
        yield zmq_port, http_port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
