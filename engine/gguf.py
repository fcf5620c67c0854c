"""GGUF (llama family) to an mlx-lm model directory.

MLX reads GGUF itself (`mx.load(path, return_metadata=True)`), returning Q4_0/Q4_1/Q8_0 tensors as
MLX-quantized weight/scales/biases with group size 32. What is left to do here: map llama.cpp tensor
names to mlx-lm's, undo llama.cpp's q/k row permutation, write config.json from the metadata (with
per-layer quantization inferred from shapes) and rebuild the tokenizer (see `engine.gguf_tokenizer`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from engine.errors import ModelError
from engine.gguf_check import check_gguf
from engine.gguf_tokenizer import write_tokenizer
from engine.progress import Progress
from engine.safetensors_out import write_safetensors

log = logging.getLogger("gguf")
LOG_EVERY_S = 5.0

GGUF_MAGIC = b"GGUF"
GGUF_GROUP_SIZE = 32  # every GGUF quant type MLX loads (Q4_0, Q4_1, Q8_0) uses blocks of 32
SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|scales|biases|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|scales|biases|bias)$")


@dataclass(frozen=True)
class LlamaParams:
    """The hyper-parameters a llama-family GGUF carries in its metadata."""

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    context_length: int
    vocab_size: int

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> LlamaParams:
        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"llama.{key}", default)
            if value is None:
                raise ModelError(f"GGUF metadata lacks llama.{key}")
            return _scalar(value)

        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        return cls(
            n_layers=int(get("block_count")),
            hidden=hidden,
            intermediate=int(get("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=int(get("attention.key_length", hidden // n_heads)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            context_length=int(get("context_length", 4096)),
            vocab_size=int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))),
        )


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Load a GGUF file's tensors and metadata; every failure is a `ModelError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    # NOTE: MLX trusts the header; a corrupt one crashes the process inside mx.load (SIGSEGV).
    check_gguf(path)
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as e:
        raise ModelError(f"{path}: cannot read GGUF: {e}") from e
    return cast("tuple[dict[str, mx.array], dict[str, Any]]", loaded)


def convert_gguf(src: Path, out: Path) -> Path:
    """Convert `src` into the mlx-lm directory `out`; nothing is left in `out` on failure."""
    out = Path(out)
    # NOTE: checked before the (slow, memory-hungry) read, which a refusal makes wasted work.
    _check_output_dir(out)
    tensors, meta = read_gguf(src)
    arch = _scalar(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{src}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    params = LlamaParams.from_metadata(meta)
    weights = {_mlx_name(name): value for name, value in tensors.items()}
    weights = _unpermute_qk(weights, params)
    config = _model_config(params, meta, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_tokenizer(meta, staging)
        _write_weights(staging / "model.safetensors", weights, src.name)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_weights(path: Path, weights: dict[str, mx.array], name: str) -> None:
    """model.safetensors, a progress step per tensor (each converted as it is written)."""
    total = sum(w.nbytes for w in weights.values())
    with Progress(log, f"converting {name}", total, "B", LOG_EVERY_S) as progress:
        write_safetensors(path, weights, {"format": "mlx"}, progress.step)


def _check_output_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"{out}: output directory exists and is not empty")


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) and value.ndim == 0 else value


def _f32(value: float) -> float:
    """A float32 metadata value in its shortest decimal form (1e-05, not 9.99999974e-06)."""
    return float(f"{value:.7g}")


def _mlx_name(name: str) -> str:
    if m := _BLOCK_RE.match(name):
        layer, part, kind = m.groups()
        if part not in _BLOCK_NAMES:
            raise ModelError(f"unsupported GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    if (m := _GLOBAL_RE.match(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ModelError(f"unsupported GGUF tensor {name!r}")


def _unpermute_qk(weights: dict[str, mx.array], params: LlamaParams) -> dict[str, mx.array]:
    """Undo llama.cpp's q/k row permutation (its RoPE pairs rows (i, i + d/2) as (2i, 2i + 1)).

    NOTE: quantization groups run along columns, so the same row shuffle applies to packed
    weights, scales and biases alike.
    """
    heads = {"q_proj": params.n_heads, "k_proj": params.n_kv_heads}
    result = {}
    for name, value in weights.items():
        proj = name.rsplit(".", 2)[-2]
        result[name] = _unpermute(value, heads[proj]) if proj in heads else value
    return result


def _unpermute(w: mx.array, n_heads: int) -> mx.array:
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _model_config(params: LlamaParams, meta: dict[str, Any], weights: dict[str, mx.array]) -> dict:
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": params.hidden,
        "num_hidden_layers": params.n_layers,
        "intermediate_size": params.intermediate,
        "num_attention_heads": params.n_heads,
        "num_key_value_heads": params.n_kv_heads,
        "head_dim": params.head_dim,
        "rms_norm_eps": _f32(params.rms_eps),
        "rope_theta": _f32(params.rope_theta),
        "max_position_embeddings": params.context_length,
        "vocab_size": params.vocab_size,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            config[key] = int(_scalar(meta[f"tokenizer.ggml.{name}_token_id"]))
    rope_scaling = _rope_scaling(meta)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    return config


def _rope_scaling(meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = _scalar(meta.get("llama.rope.scaling.type", "none"))
    if kind in ("none", ""):
        return None
    if kind != "linear":
        raise ModelError(f"unsupported RoPE scaling {kind!r}")
    return {"type": "linear", "factor": float(_scalar(meta["llama.rope.scaling.factor"]))}


def _quantization(weights: dict[str, mx.array]) -> dict[str, Any]:
    """Infer bits per quantized layer from packed shapes; the most common width is the default.

    A uint32 row of a b-bit layer packs 32 / b values: in_features = 32 * packed / b, and
    in_features = group_size * n_groups, so b = 32 * packed / (group_size * n_groups).
    """
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            layer = name[: -len(".scales")]
            packed = weights[f"{layer}.weight"].shape[-1]
            bits[layer] = 32 * packed // (GGUF_GROUP_SIZE * scales.shape[-1])
    if not bits:
        return {}
    common = max(set(bits.values()), key=list(bits.values()).count)
    quant: dict[str, Any] = {"group_size": GGUF_GROUP_SIZE, "bits": common}
    for layer, b in sorted(bits.items()):
        if b != common:
            quant[layer] = {"group_size": GGUF_GROUP_SIZE, "bits": b}
    return quant
