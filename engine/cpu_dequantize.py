"""The CPU compute path for quantized checkpoints: dequantize to float32 once, at load.

On MLX's CPU backend a quantized matmul runs a generic kernel, while a float32 matmul goes to the
BLAS; with an optimized BLAS (see `engine.cpu_backend`) the float32 path is many times faster at
batch > 1 and no slower at batch 1, for 4x-8x the weight memory (SmolLM2-135M: ~0.55 GB).
On Metal and CUDA the quantized kernels are the fast path, so "auto" leaves the model alone there.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from engine import parameters
from engine.config import ON_OFF_AUTO, EngineConfig
from engine.cpu_backend import BackendInfo, backend_info
from engine.memory import weights_bytes

log = logging.getLogger("engine.cpu_dequantize")


def resolve_dequantize(value: str, info: BackendInfo | None) -> bool:
    """Resolve `config.cpu_dequantize` (auto, on or off, as `EngineConfig.validate()` allows):
    "auto" is on for the CPU backend with an optimized BLAS."""
    if value not in ON_OFF_AUTO:
        raise ValueError(f"cpu_dequantize must be auto, on or off, got {value!r}")
    if value != "auto":
        return value == "on"
    return _on_cpu() and info is not None and info.optimized


def maybe_dequantize(model: nn.Module, config: EngineConfig | None = None) -> nn.Module:
    """Apply the dequantize policy to a loaded mlx-lm model; returns the model (changed in place)."""
    value = config.cpu_dequantize if config is not None else "auto"
    if not resolve_dequantize(value, backend_info()) or not is_quantized(model):
        return model
    before = weights_bytes(model)
    dequantize_model(model)
    log.info(
        "cpu path: weights dequantized to float32 (%.0f MB -> %.0f MB)",
        before / 1e6,
        weights_bytes(model) / 1e6,
    )
    return model


def is_quantized(model: nn.Module) -> bool:
    return any(_is_quantized_leaf(m) for _, m in model.named_modules())


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace quantized Linear / Embedding layers by float32 ones; cast the rest to float32."""
    swaps = [(path, _float_layer(m)) for path, m in model.named_modules() if _is_quantized_leaf(m)]
    model.update_modules(tree_unflatten(swaps))
    # NOTE: norms and scales may be float16; a float16 activation would miss the BLAS path.
    model.set_dtype(mx.float32)
    parameters.evaluate(model, log, "dequantizing for the CPU")
    return model


def _is_quantized_leaf(m: nn.Module) -> bool:
    return isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def _float_layer(m: nn.Module) -> nn.Module:
    weight = _dequantized_weight(m)
    if isinstance(m, nn.QuantizedEmbedding):
        layer: nn.Module = nn.Embedding(*weight.shape)
        layer.weight = weight
        return layer
    out_dims, in_dims = weight.shape
    layer = nn.Linear(in_dims, out_dims, bias="bias" in m)
    layer.weight = weight
    if "bias" in m:
        layer.bias = m.bias.astype(mx.float32)
    return layer


def _dequantized_weight(m: nn.Module) -> mx.array:
    w = mx.dequantize(
        m.weight,
        m.scales,
        m.get("biases"),
        group_size=m.group_size,
        bits=m.bits,
        mode=getattr(m, "mode", "affine"),
    )
    return w.astype(mx.float32)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.cpu
