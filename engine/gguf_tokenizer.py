"""Rebuild a Hugging Face `tokenizer.json` from a GGUF file's vocabulary and merges.

Only gpt2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported; the pre-tokenizer
follows `tokenizer.ggml.pre`, because it decides how text splits before BPE (SmolLM's splits digits
one by one, llama-3's groups up to three).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import ModelError

# llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = (2, 3, 4)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in ("gpt2", "default", ""):
        return byte_level
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise ModelError(
        f"unsupported GGUF pre-tokenizer {kind!r} (supported: gpt2, smollm, llama-bpe)"
    )


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    model = _str(meta, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelError(
            f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE)"
        )
    tokens = _tokens(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(_str(meta, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _specials(meta)])
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    tok = build_tokenizer(meta)
    tok.save(str(out / "tokenizer.json"))
    tokens = _tokens(meta)
    special = {
        f"{name}_token": tokens[_int(meta, f"tokenizer.ggml.{key}_token_id")]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
        if f"tokenizer.ggml.{key}_token_id" in meta
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": _bool(meta, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": _bool(meta, "tokenizer.ggml.add_eos_token"),
        "model_max_length": _int(meta, "llama.context_length", 4096),
        **special,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def _specials(meta: dict[str, Any]) -> list[str]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return []
    tokens = _tokens(meta)
    return [tokens[i] for i, t in enumerate(types.tolist()) if t in _SPECIAL_TYPES]


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    if not _bool(meta, "tokenizer.ggml.add_bos_token"):
        return processors.ByteLevel(trim_offsets=False)
    bos_id = _int(meta, "tokenizer.ggml.bos_token_id")
    bos = tokens[bos_id]
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _tokens(meta: dict[str, Any]) -> list[str]:
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelError("GGUF metadata lacks tokenizer.ggml.tokens")
    return list(meta["tokenizer.ggml.tokens"])


def _str(meta: dict[str, Any], key: str, default: str | None = None) -> str:
    value = meta.get(key, default)
    if value is None:
        raise ModelError(f"GGUF metadata lacks {key}")
    return str(value)


def _int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ModelError(f"GGUF metadata lacks {key}")
    return int(value.item() if hasattr(value, "item") else value)


def _bool(meta: dict[str, Any], key: str) -> bool:
    value = meta.get(key, False)
    return bool(value.item() if hasattr(value, "item") else value)
