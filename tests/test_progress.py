"""Long work on a terminal draws a live bar; anywhere else it logs a line every few seconds and
writes no control character (engine/progress.py)."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

from engine import progress as progress_module
from engine.progress import Progress

pytestmark = pytest.mark.timeout(60)


class Screen:
    """What a pseudo-terminal's reader received, read as it comes (a full terminal buffer would
    block the writer)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.chunks: list[bytes] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # NOTE: EIO once the writing side is closed
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    def text(self, stream: TextIO) -> str:
        stream.close()
        self.thread.join(5)
        return b"".join(self.chunks).decode()


@pytest.fixture
def terminal() -> Iterator[tuple[TextIO, Screen]]:
    """(the writing side of a pseudo-terminal, what its reader received)."""
    reader, writer = pty.openpty()
    stream = os.fdopen(writer, "w")
    try:
        yield stream, Screen(reader)
    finally:
        if not stream.closed:
            stream.close()
        os.close(reader)


def _drawn(terminal: tuple[TextIO, Screen]) -> str:
    stream, screen = terminal
    return screen.text(stream)


def _log(caplog: pytest.LogCaptureFixture) -> logging.Logger:
    caplog.set_level(logging.INFO, logger="test.progress")
    return logging.getLogger("test.progress")


def test_on_a_terminal_a_bar_is_redrawn_in_place(terminal, caplog):
    stream = terminal[0]
    progress = Progress(_log(caplog), "convert x.gguf", 4_100_000_000, "B", stream=stream)
    for _ in range(10):
        progress.step(410_000_000)
        time.sleep(progress_module.REDRAW_S)
    progress.finish()
    drawn = _drawn(terminal)
    bars = drawn.split("\r\x1b[K")
    assert len(bars) >= 5 and "\n" not in drawn, repr(drawn)
    assert re.fullmatch(r"convert x\.gguf \[#+\.*\] +\d+% [\d.]+ of 4\.1 GB, \d+ s", bars[-2])
    assert bars[-1] == "", "the bar is erased when done"
    # NOTE: on a terminal the bar replaces the periodic lines; the time is logged when done
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [lines[-1]] and re.fullmatch(r"convert x\.gguf: 4\.1 GB in [\d.]+ s", lines[0])


def test_redraws_are_throttled(terminal, caplog):
    stream = terminal[0]
    progress = Progress(_log(caplog), "warm-up", 10**9, "step shapes", stream=stream)
    while progress.seconds < 1.0:
        progress.step()
    steps, seconds = progress.n, progress.close()
    draws = _drawn(terminal).count("warm-up [")
    assert steps > 1000 and 1 <= draws <= 2 + seconds / progress_module.REDRAW_S, (draws, steps)


def test_not_a_terminal_gets_log_lines_and_no_control_characters(caplog):
    stream = io.StringIO()
    progress = Progress(_log(caplog), "warm-up", 1000, "step shapes", every_s=0.05, stream=stream)
    for _ in range(1000):
        progress.step()
        time.sleep(0.0002)
    progress.finish()
    assert stream.getvalue() == "", "nothing drawn where no one watches"
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) < 100, lines
    assert all(re.fullmatch(r"warm-up: \d+ of 1000 step shapes, \d+ s", x) for x in lines[:-1])
    assert re.fullmatch(r"warm-up: 1000 step shapes in [\d.]+ s", lines[-1]), lines


def test_a_log_line_on_the_terminal_erases_the_bar_first(terminal):
    stream = terminal[0]
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    log = logging.getLogger("test.progress.line")
    log.setLevel(logging.INFO)
    try:
        with Progress(log, "loading m", 10, "groups", stream=stream) as progress:
            progress.step()
            log.warning("something to say")
            progress.step()
    finally:
        root.removeHandler(handler)
    drawn = _drawn(terminal)
    # NOTE: the line starts at column 0 of an erased line, not after the bar
    assert "\r\x1b[Ksomething to say\r\n\r\x1b[Kloading m [" in drawn, repr(drawn)
    assert handler.filters == [], "the bar's filter leaves with the bar"


def test_an_early_stop_says_how_far_it_got(caplog):
    progress = Progress(_log(caplog), "warm-up", 40, "step shapes", stream=io.StringIO())
    progress.step(12)
    progress.finish()
    assert re.fullmatch(
        r"warm-up: 12 of 40 step shapes in [\d.]+ s", caplog.records[-1].getMessage()
    )


@pytest.mark.parametrize("directory", ["tiny_weights_dir", "tiny_model_dir"])
def test_the_model_load_reports_bytes_read_and_its_time(request, directory, caplog, monkeypatch):
    """The load reads the parameters group by group, a progress step each (both of the
    scheduler's paths: with a tokenizer through mlx-lm's load, weights only)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from engine import parameters
    from scheduler_proc.model_loader import load_for_scheduler

    model_dir = request.getfixturevalue(directory)
    monkeypatch.setattr(parameters, "GROUP_BYTES", 64 << 10)
    monkeypatch.setattr(parameters, "LOG_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="models")
    net, _ = load_for_scheduler(str(model_dir))
    lines = [r.getMessage() for r in caplog.records if r.name == "models"]
    assert len(lines) >= 3, lines
    assert all(re.fullmatch(r"loading model: \d+ of \d+ [kMG]B, \d+ s", x) for x in lines[:-1])
    assert re.fullmatch(r"loading model: \d+ [kMG]B in [\d.]+ s", lines[-1]), lines
    # NOTE: the same parameters mlx-lm's eager load gives
    eager, _ = load_model(model_dir)
    ours, theirs = dict(tree_flatten(net.parameters())), dict(tree_flatten(eager.parameters()))
    assert ours.keys() == theirs.keys()
    assert all(mx.array_equal(ours[k], theirs[k]).item() for k in ours)


def _convert(src: Path, out: Path, stderr: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlx_engine.cli", "convert", str(src), "--out", str(out)]
    root = Path(__file__).resolve().parents[1]  # NOTE: this checkout's engine, not an installed one
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, cwd=root, timeout=50)


def test_convert_on_a_terminal_draws_a_bar_and_in_a_pipe_logs_lines(tmp_path):
    """`mlx-engine convert`: stdout is the directory alone; stderr a bar on a terminal, plain
    lines (what, and how long it took) anywhere else."""
    from gguf_writer import hf_weights, write_llama_gguf

    src = write_llama_gguf(tmp_path / "m.gguf", hf_weights())
    reader, writer = pty.openpty()
    screen = Screen(reader)
    try:
        done = _convert(src, tmp_path / "on-terminal", writer)
        drawn = screen.text(os.fdopen(writer, "w"))
    finally:
        os.close(reader)
    assert done.returncode == 0 and done.stdout.decode().strip() == str(tmp_path / "on-terminal")
    assert "\r\x1b[Kconverting m.gguf [" in drawn, repr(drawn)
    assert re.search(r"converted m\.gguf in [\d.]+ s", drawn), repr(drawn)
    logged = _convert(src, tmp_path / "in-a-pipe", subprocess.PIPE)
    assert logged.returncode == 0, logged.stderr[-2000:]
    text = logged.stderr.decode()
    assert re.search(r"converted m\.gguf in [\d.]+ s", text) and "\r" not in text, repr(text)
    assert "\x1b" not in text


def test_dequantizing_for_the_cpu_reports_progress(tiny_weights_dir, caplog, monkeypatch):
    """The CPU path's dequantize (4 s of SmolLM2-135M's 5 s load on this CPU) reports too."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    from engine import parameters
    from engine.cpu_dequantize import dequantize_model

    net, _ = load_model(tiny_weights_dir)
    nn.quantize(net, group_size=32, bits=4)
    monkeypatch.setattr(parameters, "GROUP_BYTES", 64 << 10)
    monkeypatch.setattr(parameters, "LOG_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="engine.cpu_dequantize")
    dequantize_model(net)
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.cpu_dequantize"]
    assert len(lines) >= 3, lines
    assert all(
        re.fullmatch(r"dequantizing for the CPU: \d+ of \d+ MB, \d+ s", x) for x in lines[:-1]
    )
    assert re.fullmatch(r"dequantizing for the CPU: \d+ MB in [\d.]+ s", lines[-1]), lines
