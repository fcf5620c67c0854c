"""Changing the running model in place: new weights from disk, a LoRA adapter on or off.

Both keep the model object the runner holds (its attention hooks, the warmed shapes) and change
only its parameters or some of its layers; the scheduler calls them between steps with nothing in
flight (scheduler_proc/admin.py), and flushes the prefix cache after.

New weights are loaded lazily and checked against the running model's parameters (names, shapes,
dtypes) before anything changes, so a checkpoint that does not fit leaves the old weights serving;
then each parameter is replaced, and an old array goes as its new one is read, so the swap needs
about one copy of the weights, not two (except where the CPU path dequantizes, which reads the
new checkpoint whole first).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine import safetensors_check
from engine.config import ADAPTER_FILES, EngineConfig
from engine.errors import EngineError, InvalidRequest

log = logging.getLogger("scheduler")

MISMATCHES_SHOWN = 3


def swap_weights(model: nn.Module, model_path: str, config: EngineConfig) -> dict[str, Any]:
    """Replace `model`'s parameters by those of the checkpoint at `model_path` (a directory,
    .gguf file or Hugging Face name); `InvalidRequest("model_path")` when it cannot be read or
    does not fit, with the model unchanged. Any adapter must be off (its layers are not in a
    checkpoint)."""
    t0 = time.monotonic()
    new = _load_lazily(model_path, config)
    params = dict(tree_flatten(new.parameters()))
    problems = mismatches(dict(tree_flatten(model.parameters())), params)
    if problems:
        shown = "; ".join(problems[:MISMATCHES_SHOWN])
        more = len(problems) - MISMATCHES_SHOWN
        tail = f" (and {more} more)" if more > 0 else ""
        raise InvalidRequest(
            "model_path", f"{model_path} does not fit the running model: {shown}{tail}"
        )
    del new  # NOTE: its arrays live on in `params` until each one is swapped in
    for name in list(params):
        # NOTE: one parameter at a time: the old array is dropped as soon as its successor is
        # read, so memory holds one model and one tensor, not two models.
        array = params.pop(name)
        mx.eval(array)
        model.load_weights([(name, array)], strict=False)
    mx.clear_cache()
    seconds = time.monotonic() - t0
    log.info("weights from %s swapped in %.2f s", model_path, seconds)
    return {"swap_s": round(seconds, 3)}


def _load_lazily(model_path: str, config: EngineConfig) -> nn.Module:
    """The checkpoint as a model whose arrays are read only when evaluated."""
    from mlx_lm.utils import load_model

    from engine.cpu_dequantize import maybe_dequantize
    from engine.models import resolve_model_dir

    try:
        model_dir = resolve_model_dir(model_path)
        # NOTE: a damaged file is named with what is wrong (engine/safetensors_check.py)
        safetensors_check.check_dir(Path(model_dir))
        new, _ = load_model(model_dir, lazy=True)
    except EngineError as e:
        raise InvalidRequest("model_path", str(e)) from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # NOTE: MLX's are RuntimeErrors
        raise InvalidRequest("model_path", f"{model_path}: cannot load: {e}") from None
    return maybe_dequantize(new, config)


def mismatches(running: dict[str, mx.array], new: dict[str, mx.array]) -> list[str]:
    """What keeps `new` from replacing `running` parameter for parameter (empty: it fits)."""
    out = [f"{k}: missing" for k in running if k not in new]
    out += [f"{k}: not in the running model" for k in new if k not in running]
    for k in running.keys() & new.keys():
        a, b = running[k], new[k]
        if a.shape != b.shape:
            out.append(f"{k}: shape {tuple(b.shape)}, running {tuple(a.shape)}")
        elif a.dtype != b.dtype:
            out.append(f"{k}: dtype {b.dtype}, running {a.dtype}")
    return sorted(out)


# --- LoRA adapters -----------------------------------------------------------------------------


def load_adapter(model: nn.Module, path: str) -> int:
    """Apply the mlx-lm adapter in directory `path` to `model` (any adapter on it is removed
    first); returns how many layers it changed. `InvalidRequest("lora_path")` when it cannot be
    used, with the model unchanged."""
    directory = _adapter_dir(path)
    remove_adapter(model)
    from mlx_lm.tuner.utils import load_adapters

    before = dict(model.named_modules())
    try:
        safetensors_check.check_dir(directory)
        load_adapters(model, str(directory))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        remove_adapter(model)
        raise InvalidRequest("lora_path", f"{path}: cannot load the adapter: {e}") from None
    after = dict(model.named_modules())
    changed = [after[k] for k in before if k in after and after[k] is not before[k]]
    for layer in changed:
        _match_dtype(layer)
    # NOTE: new layers are built in training mode: their dropout would run at inference.
    model.eval()
    mx.eval(model.parameters())
    log.info("adapter %s: %d layers", directory, len(changed))
    return len(changed)


def remove_adapter(model: nn.Module) -> int:
    """Put back the layers an adapter wrapped; returns how many (0: none was on)."""
    base = [(name, _base_of(m)) for name, m in model.named_modules() if _base_of(m) is not None]
    if base:
        model.update_modules(tree_unflatten(base))
    return len(base)


def _adapter_dir(path: str) -> Path:
    directory = Path(path).expanduser()
    missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise InvalidRequest(
            "lora_path", f"{path}: not an mlx-lm adapter directory (no {', '.join(missing)})"
        )
    try:
        kind = json.loads((directory / ADAPTER_FILES[0]).read_text()).get("fine_tune_type")
    except (OSError, ValueError, AttributeError) as e:
        raise InvalidRequest("lora_path", f"{path}: unreadable adapter_config.json: {e}") from None
    if kind == "full":
        raise InvalidRequest(
            "lora_path", f"{path}: a full fine-tune is new weights: use update_weights_from_disk"
        )
    return directory


def _base_of(layer: nn.Module) -> nn.Module | None:
    """The layer an adapter layer wraps (mlx-lm's LoRA and DoRA layers keep it as `linear` or
    `embedding`), else None."""
    from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
    from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear

    if isinstance(layer, (LoRALinear, LoRASwitchLinear, DoRALinear)):
        return layer.linear
    if isinstance(layer, (LoRAEmbedding, DoRAEmbedding)):
        return layer.embedding
    return None


def _match_dtype(layer: nn.Module) -> None:
    """The adapter's own arrays in the dtype the wrapped layer computes in (a float32 adapter on a
    bfloat16 model would turn every activation after it into float32)."""
    base = _base_of(layer)
    if base is None:
        return
    dtype = (base.scales if "scales" in base else base.weight).dtype
    own = {k: v.astype(dtype) for k, v in layer.items() if isinstance(v, mx.array)}
    layer.update(own)
