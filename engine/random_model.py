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
from mlx_lm.utils import _get_classes, save_model

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

# NOTE: every sliding-window config below uses a window of 16 tokens, so test prompts and decodes
# cross it; every hybrid one mixes state layers with attention layers.
TINY_WINDOW = 16
_TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# NOTE: one tiny config per architecture family the engine is tested on (docs/models.md); each
# keeps TINY_LLAMA's widths and vocabulary, so the same prompts and tokenizer fit all of them.
TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": TINY_LLAMA,
    "qwen3": TINY_QWEN3,
    "qwen3_moe": {
        **TINY_QWEN3,
        **_TINY_MOE,
        "model_type": "qwen3_moe",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "phi3": {**TINY_LLAMA, "model_type": "phi3"},
    "gemma3_text": {
        **TINY_LLAMA,
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 16,
        "sliding_window": TINY_WINDOW,
        "sliding_window_pattern": 2,  # NOTE: layer 0 slides, layer 1 attends to everything
    },
    "gpt_oss": {
        **TINY_LLAMA,
        "model_type": "gpt_oss",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "gemma4_text": {
        **TINY_LLAMA,
        "model_type": "gemma4_text",
        "num_hidden_layers": 4,  # NOTE: sliding, full, then two layers sharing their K/V
        "num_kv_shared_layers": 2,
        "sliding_window_pattern": 2,
        "sliding_window": TINY_WINDOW,
        "global_head_dim": 32,  # NOTE: per-layer head dims: 16 sliding, 32 full
        "num_global_key_value_heads": 1,
        "vocab_size_per_layer_input": 49152,
        "hidden_size_per_layer_input": 16,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": False,
    },
    "ministral3": {
        **TINY_LLAMA,
        "model_type": "ministral3",
        "sliding_window": TINY_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3_next": {
        **TINY_QWEN3,
        **_TINY_MOE,
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,  # NOTE: linear, full, linear, full
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 32,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.5,
    },
    "qwen3_5": {
        **TINY_LLAMA,
        "model_type": "qwen3_5",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
    "granitemoehybrid": {
        **TINY_LLAMA,
        "model_type": "granitemoehybrid",
        "layer_types": ["mamba", "attention", "mamba"],
        "num_hidden_layers": 3,
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "attention_multiplier": 0.25,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 2,
        "mamba_conv_bias": True,
    },
    "nemotron_h": {
        **TINY_LLAMA,
        "model_type": "nemotron_h",
        "hybrid_override_pattern": ["M", "*", "M", "-"],
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
    },
    "lfm2": {
        **TINY_LLAMA,
        "model_type": "lfm2",
        "num_hidden_layers": 3,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv"],
    },
}

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


# NOTE: small models of two kinds the row KV pool holds besides full attention, for CPU benchmarks
# against mlx-lm's BatchGenerator: gemma3_text (5 sliding-window layers of 128 tokens to 1 full)
# and qwen3_next (gated delta net recurrent layers, 1 full-attention layer in 4, MoE).
GEMMA3_SMALL: dict[str, Any] = {
    **TINY_FAMILIES["gemma3_text"],
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 128,
    "sliding_window_pattern": 6,
}
QWEN3_NEXT_SMALL: dict[str, Any] = {
    **TINY_FAMILIES["qwen3_next"],
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "num_experts": 8,
    "moe_intermediate_size": 384,
    "shared_expert_intermediate_size": 384,
}

# NOTE: name -> (config, dtype): bf16 for the GPU shape, float32 for the CPU ones (the CPU's
# bf16 matmuls are slow and not what a CPU user runs).
RANDOM_SHAPES: dict[str, tuple[dict[str, Any], mx.Dtype]] = {
    "llama-1b": (LLAMA_3_2_1B, mx.bfloat16),
    "llama-8b": (LLAMA_3_1_8B, mx.bfloat16),
    "gemma3-small": (GEMMA3_SMALL, mx.float32),
    "qwen3next-small": (QWEN3_NEXT_SMALL, mx.float32),
}


def random_model_dir(name: str) -> Path:
    """A random-weight model of a named shape (`RANDOM_SHAPES`) in a temporary directory."""
    import tempfile

    config, dtype = RANDOM_SHAPES[name]
    return make_random_model(Path(tempfile.mkdtemp()), config, dtype=dtype)


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
    # NOTE: built from its class, not with `load_model`: loading runs the model's `sanitize` on
    # no weights at all, and some (gemma3_text) then drop their untied LM head.
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    # NOTE: nn.Linear's default init is scaled for training; widen the embedding so logits of a
    # random model are not nearly uniform (argmax ties would make greedy parity tests flaky).
    params = dict(tree_flatten(model.parameters()))
    tied = not any(k.endswith("lm_head.weight") for k in params)
    params = {k: _randomize(k, v, dtype, tied) for k, v in params.items()}
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    save_model(out_dir, model)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_from) / name
            if src.exists():
                shutil.copy(src, out_dir / name)
    return out_dir


def _randomize(name: str, value: mx.array, dtype: mx.Dtype, tied: bool) -> mx.array:
    if name.endswith("norm.weight"):
        return mx.ones(value.shape, dtype=dtype)
    # NOTE: with a tied head, a full-scale embedding dominates the residual stream and the output
    # reads back the last token (context blind); a smaller one lets the layers be heard.
    embed = 0.25 if tied else 1.0
    scale = embed if "embed_tokens" in name else value.shape[-1] ** -0.5
    return (mx.random.normal(value.shape) * scale).astype(dtype)
