"""LoRA adapters for tests: mlx-lm's adapter format with random, non-zero weights."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten


def make_adapter(out: Path, base_dir: Path, rank: int = 4, seed: int = 3) -> Path:
    """An mlx-lm LoRA adapter directory for `base_dir`'s model with random, non-zero weights."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model = load_model(base_dir)[0]
    params = {"rank": rank, "scale": 4.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, params)
    mx.random.seed(seed)
    adapters = {
        k: mx.random.normal(v.shape) * 0.2
        for k, v in tree_flatten(model.parameters())
        if k.endswith(("lora_a", "lora_b"))
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    config = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
