"""Write small llama GGUF files the way llama.cpp's converter does, for converter tests.

This is an independent statement of llama.cpp's layout (tensor names, q/k row permutation, metadata
keys), so the converter is checked against the format, not against itself.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_vocab() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: 256 one-character tokens."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def vocab_and_merges() -> tuple[list[str], list[str]]:
    tokens = SPECIALS + _byte_vocab()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe"]
    return tokens, merges


def hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face / mlx-lm llama layout and names."""
    rng = np.random.default_rng(seed)
    vocab = len(vocab_and_merges()[0])

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32)}
    w["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, FFN)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[p + norm + ".weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    return w


def hf_config(tied: bool = True) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": len(vocab_and_merges()[0]),
        "tie_word_embeddings": tied,
    }


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (HF rotate-half to interleaved RoPE)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    base = hf_name.removesuffix(".weight")
    if base == "model.embed_tokens":
        return "token_embd.weight"
    if base == "model.norm":
        return "output_norm.weight"
    if base == "lm_head":
        return "output.weight"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.weight"


def write_llama_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    qtype: QType = QType.F32,
    *,
    arch: str = "llama",
    pre: str = "smollm",
    tokenizer_model: str = "gpt2",
) -> Path:
    """Write `weights` (HF layout) as llama.cpp would: permuted q/k, 2-D tensors in `qtype`."""
    writer = gguf.GGUFWriter(str(path), arch)
    tokens, merges = vocab_and_merges()
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, value in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            value = llama_cpp_permute(value, HEADS if "q_proj" in name else KV_HEADS)
        _add(writer, gguf_name(name), value, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, name: str, value: np.ndarray, qtype: QType) -> None:
    if value.ndim == 1 or qtype == QType.F32:
        writer.add_tensor(name, value.astype(np.float32))
    elif qtype == QType.F16:
        writer.add_tensor(name, value.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


def gguf_roundtrip(value: np.ndarray, qtype: QType) -> np.ndarray:
    """What a reader gets back for `value` stored as `qtype` (gguf's own numpy dequantizer)."""
    if value.ndim == 1 or qtype == QType.F32:
        return value
    if qtype == QType.F16:
        return value.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype).reshape(value.shape)
