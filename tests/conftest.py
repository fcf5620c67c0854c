"""Shared fixtures: tiny random models (seconds) and the real default model (slow tests)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cpu_backend import setup_cpu_backend

# NOTE: before anything imports mlx.core: in-process tests then run MLX on the optimized BLAS
# (Linux CPU), as the scheduler process does; a no-op elsewhere.
setup_cpu_backend(None, log_line=False)

from engine_harness import deadline  # noqa: E402

from engine.random_model import TINY_LLAMA, TINY_QWEN3, make_random_model  # noqa: E402

# NOTE: every test runs under a deadline, so a planted bug that hangs fails its test instead of
# the suite; `@pytest.mark.timeout(s)` gives a test its own.
TEST_TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def _deadline(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("timeout")
    seconds = int(marker.args[0]) if marker else TEST_TIMEOUT_S
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with deadline(seconds):
        yield


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M, converted from its GGUF once and cached."""
    from engine.models import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random llama sharing the default model's tokenizer."""
    out = tmp_path_factory.mktemp("tiny-llama")
    return make_random_model(out, TINY_LLAMA, tokenizer_from=default_model_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer random qwen3 (q/k norms, untied head) sharing the default tokenizer."""
    out = tmp_path_factory.mktemp("tiny-qwen3")
    return make_random_model(out, TINY_QWEN3, tokenizer_from=default_model_dir)


@pytest.fixture(scope="session")
def tiny_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random llama, weights only (no tokenizer): enough for the scheduler."""
    return make_random_model(tmp_path_factory.mktemp("tiny-llama-w"), TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_qwen3_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random qwen3, weights only (no tokenizer)."""
    return make_random_model(tmp_path_factory.mktemp("tiny-qwen3-w"), TINY_QWEN3)


@pytest.fixture(scope="session")
def tiny_think_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A tiny model whose every reply is a thought, then an answer (tests/think_model.py)."""
    from think_model import make_think_model

    return make_think_model(tmp_path_factory.mktemp("tiny-think"), default_model_dir)


@pytest.fixture(scope="session")
def tiny_tool_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """A 2-layer llama whose chat template has tools and whose greedy answer is a tool call."""
    from tool_model import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tiny-tools"), default_model_dir)


@pytest.fixture
def client(engine):
    """An SDK client of the module's `engine` fixture (a LaunchedEngine)."""
    from engine.client import EngineClient

    with EngineClient(engine.address, timeout=30.0) as c:
        yield c


@pytest.fixture
def raw(engine):
    """A bare DEALER socket to the module's `engine`: `ask(frame)` returns the decoded reply."""
    from engine_harness import raw_dealer

    with raw_dealer(engine.address) as ask:
        yield ask
