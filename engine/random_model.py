"""Random-weight models built from a config: fast test fixtures and GPU benchmark stand-ins.

Throughput does not depend on weight values, and scheduler correctness is checked token for token
against mlx-lm on the same weights, so a random model is as good as a trained one for both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, save_model

# NOTE: the shapes follow SmolLM2-135M (GQA, head_dim 64, vocab 49152) so the default model's
# tokenizer fits, only much smaller: two layers, narrow hidden size.
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 8192,
    # NOTE: a tied head on a random model reads back the last token's own embedding, so greedy
    # output ignores the context (it repeats the last prompt token) and KV bugs go unseen.
    # Untied, every earlier token changes the output (tests/test_context_sensitive.py).
    "tie_word_embeddings": False,
}

TINY_QWEN3: dict[str, Any] = {**TINY_LLAMA, "model_type": "qwen3"}

# NOTE: the shape of Llama-3.2-1B, for GPU benchmarks with random bf16 weights (no download).
LLAMA_3_2_1B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}

# NOTE: the shape of Llama-3.1-8B (~16 GB in bf16), for tensor-parallel GPU benchmarks.
LLAMA_3_1_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


RANDOM_SHAPES = {"llama-1b": LLAMA_3_2_1B, "llama-8b": LLAMA_3_1_8B}


def random_model_dir(name: str) -> Path:
    """A random-weight bf16 model of a named shape in a temporary directory."""
    import tempfile

    return make_random_model(Path(tempfile.mkdtemp()), RANDOM_SHAPES[name], dtype=mx.bfloat16)


def make_random_model(
    out_dir: Path,
    config: dict[str, Any] | None = None,
    *,
    tokenizer_from: Path | None = None,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
) -> Path:
    """Write an mlx-lm model directory with random weights; copy tokenizer files if given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_LLAMA if config is None else config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    model, _ = load_model(out_dir, lazy=True, strict=False)
    # NOTE: nn.Linear's default init is scaled for training; widen the embedding so logits of a
    # random model are not nearly uniform (argmax ties would make greedy parity tests flaky).
    params = dict(tree_flatten(model.parameters()))
    params = {k: _randomize(k, v, dtype) for k, v in params.items()}
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    save_model(out_dir, model)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.exists():
                shutil.copy(src, out_dir / name)
    return out_dir


def _randomize(name: str, value: mx.array, dtype: mx.Dtype) -> mx.array:
    if name.endswith("norm.weight"):
        return mx.ones(value.shape, dtype=dtype)
    scale = 1.0 if "embed_tokens" in name else value.shape[-1] ** -0.5
    return (mx.random.normal(value.shape) * scale).astype(dtype)
