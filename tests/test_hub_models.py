"""`--model ORG/NAME[@REVISION]`: models by their Hugging Face name, from a cache this test lays out
the way huggingface_hub does (no network here: HF_HUB_OFFLINE=1), a GGUF repository among them,
through `resolve_model_dir` and a launched engine."""

from __future__ import annotations

import logging
import os
import pty
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from engine_harness import LaunchedEngine, free_port
from gguf_writer import hf_weights, write_llama_gguf

from engine.client import EngineClient
from engine.errors import ModelError
from engine.models import resolve_model_dir, served_name

pytestmark = pytest.mark.timeout(180)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out(cache: Path, repo: str, files: dict[str, Path], commit: str = COMMIT) -> Path:
    """A repository in huggingface_hub's cache layout: refs/main -> snapshots/<commit>/."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for name, src in files.items():
        shutil.copy(src, snapshot / name)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_dir):
    """An offline Hugging Face cache holding org/tiny (an MLX model) and org/tiny-gguf."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    files = {p.name: p for p in tiny_model_dir.iterdir() if p.is_file()}
    _lay_out(cache, "org/tiny", files)
    gguf = write_llama_gguf(tmp_path / "model.Q8.gguf", hf_weights(seed=0))
    _lay_out(cache, "org/tiny-gguf", {"model.Q8.gguf": gguf, "README.md": gguf})
    for name, value in (("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("MLX_ENGINE_HOME", str(tmp_path / "home"))  # NOTE: converted GGUFs
    return cache


def test_a_cached_model_resolves_by_name_and_revision(hub_cache):
    snapshot = hub_cache / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve_model_dir("org/tiny") == snapshot
    assert resolve_model_dir(f"org/tiny@{COMMIT}") == snapshot
    assert served_name("org/tiny@main", snapshot) == "org/tiny"
    assert served_name(str(snapshot), snapshot) == COMMIT  # NOTE: a path is served by its name
    # NOTE: a GGUF file by its own name, not its cached conversion's (which carries a hash)
    assert served_name("/m/tiny.Q4_1.gguf", Path("/c/tiny.Q4_1-0a1b2c")) == "tiny.Q4_1"
    assert served_name(None, Path("/c/x-0a1b2c")) == "SmolLM2-135M-Instruct.Q4_1"


def test_a_gguf_repository_gives_its_gguf_converted(hub_cache):
    out = resolve_model_dir("org/tiny-gguf")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert resolve_model_dir("org/tiny-gguf", gguf_file="model.Q8.gguf") == out
    with pytest.raises(ModelError, match="no file 'other.gguf'|not in the Hugging Face cache"):
        resolve_model_dir("org/tiny-gguf", gguf_file="other.gguf")


def test_a_missing_model_names_itself_the_cache_and_the_way_out(hub_cache):
    with pytest.raises(ModelError) as e:
        resolve_model_dir("org/missing")
    message = str(e.value)
    assert "org/missing" in message and str(hub_cache) in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelError, match="org/tiny@v9"):
        resolve_model_dir("org/tiny@v9")
    with pytest.raises(ModelError, match="ORG/NAME"):
        resolve_model_dir("./no/such/dir/here")


def test_launch_serves_a_model_by_its_hugging_face_name(hub_cache, tmp_path):
    engine = LaunchedEngine("org/tiny", tmp_path / "launch.log").wait_ready()  # type: ignore[arg-type]
    try:
        with EngineClient(engine.address) as c:
            assert c.info.model == "org/tiny"
            assert c.generate(input_ids=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2
    finally:
        engine.stop()


def test_launch_of_a_missing_model_fails_fast_and_says_why(hub_cache):
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--model", "org/missing"]
    cmd += ["--zmq-port", str(free_port()), "--port", str(free_port())]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert done.returncode != 0
    output = done.stderr + done.stdout
    assert "org/missing is not in the Hugging Face cache" in output
    assert "Traceback" not in output, output  # NOTE: the user's error, not the engine's
    assert took < 30.0, f"took {took:.1f} s"


def test_convert_takes_a_hugging_face_gguf_repository(hub_cache, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "mlx_engine.cli",
        "convert",
        "org/tiny-gguf",
        "--out",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (Path(done.stdout.strip()) / "config.json").is_file()


def _download_bars(what: str, shown: list) -> tuple[Any, Any, Any]:
    """The three bars snapshot_download makes, made as it makes them (huggingface_hub 1.x+):
    files fetched, bytes received, bytes written."""
    from huggingface_hub.utils.tqdm import _create_progress_bar

    from engine import hub

    bar = hub.progress_bar(what, shown)
    level = logging.WARNING
    files = _create_progress_bar(cls=bar, log_level=level, total=3, desc="Fetching 3 files")
    name = "huggingface_hub.snapshot_download"
    received = _create_progress_bar(
        cls=bar, log_level=level, name=f"{name}.transfer", total=0, unit="B", unit_scale=True
    )
    written = _create_progress_bar(
        cls=bar, log_level=level, name=name, total=0, unit="B", unit_scale=True
    )
    return files, received, written


def test_a_download_in_a_log_is_a_line_every_few_seconds(caplog, monkeypatch):
    """Not on a terminal: the bytes written, a line every LOG_EVERY_S, and when done its size
    and time; the other bars say nothing."""
    from engine import hub

    caplog.set_level(logging.INFO, logger="hub")
    monkeypatch.setattr(hub, "LOG_EVERY_S", 0.05)
    shown: list = []
    files, received, written = _download_bars("download org/m", shown)
    for i in range(100):
        if i % 50 == 0:  # NOTE: the total grows as each file's download starts
            written.total += 500_000
        written.update(10_000)
        received.update(10_000)
        time.sleep(0.003)
    files.update(3)
    for bar in (files, received, written):
        bar.close()
    for progress in shown:
        progress.finish()
    lines = [r.getMessage() for r in caplog.records]
    assert len(shown) == 1 and 2 <= len(lines) < 40, lines
    assert all(re.fullmatch(r"download org/m: \d+ of \d+ [kM]B, \d+ s", x) for x in lines[:-1])
    assert re.fullmatch(r"download org/m: 1 MB in [\d.]+ s", lines[-1]), lines


def test_a_download_on_a_terminal_is_one_bar(monkeypatch):
    """On a terminal one bar, the bytes written (huggingface_hub's own would be three)."""
    reader, writer = pty.openpty()
    stream = os.fdopen(writer, "w")
    os.set_blocking(reader, False)
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        files, received, written = _download_bars("download org/m", [])
        written.total = 2_000_000
        received.total = 2_000_000
        for _ in range(4):
            written.update(500_000)
            received.update(500_000)
            time.sleep(0.25)
        drawn = os.read(reader, 65536).decode()
    finally:
        monkeypatch.undo()
        stream.close()
        os.close(reader)
    assert drawn.startswith("\r\x1b[Kdownload org/m [") and "Fetching" not in drawn, repr(drawn)
    assert re.search(r"\] +\d+% [\d.]+ of 2 MB", drawn), repr(drawn)
