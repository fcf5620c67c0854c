"""The scheduler's model: loaded with mlx-lm, dequantized per the CPU policy, with its EOS ids.

Used by the scheduler process and by both in-process engines (mlx_engine/inprocess.py,
mlx_engine/offline.py): whoever runs a `Scheduler` loads its model here.
"""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from engine.tokenizer_loader import eos_ids


def load_for_scheduler(
    model: str | None, config: EngineConfig | None = None
) -> tuple[Any, list[int]]:
    """(model, eos ids), dequantized per `config.cpu_dequantize` on CPU; a weights-only
    directory (random test models) needs no tokenizer."""
    from engine.cpu_dequantize import maybe_dequantize
    from engine.models import load, load_weights_only, resolve_model_dir

    model_dir = resolve_model_dir(model)
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file():
        net, tokenizer = load(str(model_dir))
        eos = sorted(tokenizer.eos_token_ids)
    else:
        net, model_config = load_weights_only(model_dir)
        eos = eos_ids(model_config.get("eos_token_id")) or []
    net = maybe_dequantize(net, config)
    if config is not None and config.adapter_path:  # NOTE: after dequantizing: the adapter's
        from scheduler_proc.weights import load_adapter  # arrays take the dtype it computes in

        load_adapter(net, config.adapter_path)
    return net, eos
