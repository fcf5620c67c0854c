"""mlx-lm's tokenizer wrapper (and its streaming detokenizers) without importing MLX.

The tokenizer and detokenizer processes need only `mlx_lm.tokenizer_utils`, which depends on
transformers alone; importing the `mlx_lm` package itself pulls in `mlx.core`, and on a GPU its
module-level stream creation opens a device context in processes that never compute (memory, and
time-slicing of the device). The model-specific tokenizer defaults, which need the model code,
come from the scheduler process (see `tokenizer_defaults`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path, defaults_json: str = "null") -> Any:
    _mlx_lm_without_init()
    from mlx_lm import tokenizer_utils

    model_dir = Path(model_dir)
    return tokenizer_utils.load(
        model_dir, eos_token_ids=_config_eos(model_dir), defaults=json.loads(defaults_json)
    )


def tokenizer_defaults(model_dir: str | Path) -> str:
    """JSON of the model module's TOKENIZER_DEFAULTS (scheduler side: it has MLX anyway)."""
    from mlx_lm.utils import _tokenizer_defaults

    try:
        return json.dumps(_tokenizer_defaults(Path(model_dir)))
    except (TypeError, ValueError):
        return "null"


def _mlx_lm_without_init() -> None:
    """Register `mlx_lm` as a bare namespace so its submodules import without its __init__."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("mlx-lm is not installed")
    package = types.ModuleType("mlx_lm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["mlx_lm"] = package


def _config_eos(model_dir: Path) -> list[int] | None:
    try:
        return eos_ids(json.loads((model_dir / "config.json").read_text()).get("eos_token_id"))
    except (OSError, ValueError):
        return None


def eos_ids(value: int | list[int] | None) -> list[int] | None:
    """config.json's `eos_token_id` (absent, one id or a list) as a list; None when absent."""
    if value is None:
        return None
    return list(value) if isinstance(value, list) else [value]
