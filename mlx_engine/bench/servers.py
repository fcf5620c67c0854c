"""Start the servers a benchmark measures (this engine, `mlx_lm.server`) and always stop them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

START_TIMEOUT_S = 600.0


def unwind_on_sigterm() -> None:
    """SIGTERM (a `timeout`, a supervisor) unwinds like Ctrl-C, so the servers this process
    started are stopped by their `finally` blocks. By default it ends the process at once and
    leaves them running in their own sessions, holding the port and a GPU's memory."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S) -> None:
    """Poll `url/health` until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            name = cast("list[str]", proc.args)[2]
            raise RuntimeError(f"{name} exited during start-up (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not become healthy in {timeout:.0f} s")


@dataclass(frozen=True)
class Server:
    """A server the bench started: its base URL, its process, where its output goes."""

    url: str
    proc: subprocess.Popen
    log: Path | None = None

    def exit_code(self, wait: float = 0.0) -> int | None:
        """Its exit code if it has exited (a crash mid-run), else None; `wait`: seconds to
        give a server that may be exiting (its clients saw the connection drop first)."""
        try:
            return self.proc.wait(timeout=wait) if wait else self.proc.poll()
        except subprocess.TimeoutExpired:
            return None


@contextlib.contextmanager
def running(
    cmd: Sequence[str], port: int, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[Server]:
    """`serve`, its output written to `log`; yields the server, not only its URL."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "w")) if log else subprocess.DEVNULL
        proc = stack.enter_context(_process(cmd, port, env, out))
        yield Server(f"http://127.0.0.1:{port}", proc, log)


@contextlib.contextmanager
def serve(
    cmd: Sequence[str], port: int, env: dict[str, str] | None = None, log: IO | None = None
) -> Iterator[str]:
    """Run `cmd` (a server on `port`) in its own process group; yield its base URL once healthy."""
    with _process(cmd, port, env, log or subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def _process(
    cmd: Sequence[str], port: int, env: dict[str, str] | None, out: IO | int
) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(
        list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    # NOTE: the engine's launcher forwards SIGTERM to its children and drains; the group kill
    # afterwards leaves nothing behind if it does not finish in time.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def engine_command(model: str | None, launch_args: Sequence[str], port: int) -> list[str]:
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--port", str(port)]
    cmd += ["--zmq-port", str(free_port())]
    return cmd + (["--model", model] if model else []) + list(launch_args)


def mlx_lm_command(model_dir: Path, port: int) -> list[str]:
    """`mlx_lm.server` with its defaults, as a user starts it."""
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    return cmd + ["--port", str(port), "--log-level", "WARNING"]


def eos_token_ids(model_dir: Path) -> list[int]:
    """The model's end tokens, for a `logit_bias` that makes a server without `ignore_eos`
    generate exactly `max_tokens`."""
    from engine.tokenizer_loader import load_tokenizer  # NOTE: the config's end tokens too

    return sorted(int(t) for t in load_tokenizer(model_dir).eos_token_ids)


def float32_copy(model_dir: Path) -> Path:
    """The model with float32 weights, written once under /tmp (the model itself if it is not
    quantized): what the engine's CPU path runs, for a peer in the same environment.

    NOTE: on MLX's CPU backend a quantized matmul runs a generic kernel many times slower than the
    float32 BLAS path; a float32 directory gives both engines the same fast weights.
    """
    from mlx_lm.utils import load_model, save_model

    from engine.cpu_dequantize import dequantize_model, is_quantized

    out = Path("/tmp") / f"bench-prefix-f32-{model_dir.name}"
    if (out / "config.json").is_file():
        return out
    model, config = load_model(model_dir)
    if not is_quantized(model):
        return model_dir
    dequantize_model(model)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out
