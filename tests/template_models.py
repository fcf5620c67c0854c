"""Tiny scripted models with real chat templates (tests/templates/, sources in its README): each
family's template and special tokens over the default model's tokenizer, so mlx-lm infers the
think markers and tool parser it infers for the real model.

The default (SmolLM2) tokenizer has 17 added tokens; those a family does not use are renamed to
the family's (`Family.markers` become plain tokens, `Family.specials` stay special, as in the
real tokenizer: Qwen's `<think>` and `<tool_call>` are plain, Llama's and Mistral's control
tokens special). Token 2 is always the end of turn (the model's eos), token 1 the bos. The
weights are scripted (tests/ngram_model.py): greedy decoding after any chat writes `answer`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ngram_model import CONFIG, respell, write_weights
from tool_model import _rename_tokens

from engine.random_model import TOKENIZER_FILES, make_random_model
from engine.tokenizer_loader import load_tokenizer

TEMPLATES = Path(__file__).parent / "templates"
EOS = 2  # NOTE: the id every family's end-of-turn token takes (SmolLM2's <|im_end|>)

# NOTE: the default tokenizer's added tokens after its three roles, free to be renamed
SPARE = [
    "<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>",
    "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
    "<jupyter_output>", "<jupyter_script>", "<empty_output>",
]  # fmt: skip
QWEN = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEEPSEEK = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
LLAMA = ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>"]
MISTRAL = [
    "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]", "[ARGS]", "[CALL_ID]",
]  # fmt: skip
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"]


@dataclass(frozen=True)
class Family:
    template: str  # NOTE: a file in tests/templates
    plain: list[str] = field(default_factory=list)  # added tokens that are not special
    special: list[str] = field(default_factory=list)  # special ones, besides the three roles
    # NOTE: new names of SmolLM2's <|endoftext|>, <|im_start|> (bos), <|im_end|> (eos)
    roles: tuple[str, str, str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


FAMILIES: dict[str, Family] = {
    # NOTE: Qwen3-Coder shares Qwen3's vocabulary, <think> included (mlx-lm infers think
    # markers for the real Qwen3-Coder too, though it never thinks)
    "qwen3": Family("qwen3.jinja", plain=QWEN),
    "qwen3_coder": Family("qwen3_coder.jinja", plain=QWEN),
    # NOTE: DeepSeek-R1-Distill-Qwen's tokenizer: Qwen2.5's, with DeepSeek's role tokens plain
    "deepseek_r1": Family(
        "deepseek_r1.jinja",
        plain=DEEPSEEK,
        special=["<|EOT|>"],
        roles=("<|endoftext|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ),
    "llama3": Family(
        "llama3.jinja", special=LLAMA, roles=("<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>")
    ),
    "mistral": Family("mistral.jinja", special=MISTRAL, roles=("<unk>", "<s>", "</s>")),
    # NOTE: harmony's tokens; <|return|> ends a reply (<|call|> a tool call)
    "gpt_oss": Family(
        "gpt_oss.jinja",
        special=HARMONY,
        roles=("<|endoftext|>", "<|startoftext|>", "<|return|>"),
    ),
}
SAMPLE_CHAT = [{"role": "user", "content": "Hello there."}]


def template_text(family: str) -> str:
    return (TEMPLATES / FAMILIES[family].template).read_text()


def make_template_tokenizer(family: str, out: Path, tokenizer_from: Path) -> Path:
    """A model directory with `family`'s tokenizer (no weights: enough to render and tokenize)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    (out / "config.json").write_text(json.dumps({**CONFIG, "eos_token_id": EOS}))
    plain, special = _renames(FAMILIES[family])
    _rename_tokens(out, plain, template_text(family), special)
    return out


def make_template_model(
    family: str, out: Path, tokenizer_from: Path, answer: str, end: str | None = None
) -> Path:
    """A tiny model with `family`'s template and special tokens whose greedy reply to any chat
    is `answer` (respelled where a context would repeat: `ngram_model.respell`), then `end`: the
    end of turn (token 2), or another of the family's tokens that then ends replies too (gpt-oss
    ends a tool call with <|call|>)."""
    make_random_model(out, CONFIG, tokenizer_from=tokenizer_from)
    make_template_tokenizer(family, out, tokenizer_from)
    tok = load_tokenizer(out)
    stop = EOS if end is None else tok.convert_tokens_to_ids(end)
    prompt = tok.apply_chat_template(SAMPLE_CHAT, add_generation_prompt=True)
    answer_ids = respell(prompt, tok.encode(answer, add_special_tokens=False), stop, _pieces(tok))
    assert tok.decode(answer_ids) == answer, "the answer does not survive its tokenization"
    write_weights(out, prompt, answer_ids, stop)
    config = json.loads((out / "config.json").read_text())
    eos = sorted({EOS, stop})
    (out / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": eos}))
    return out


def _pieces(tok: Any) -> dict[str, int]:
    """The vocabulary an answer may be respelled with: all but the added tokens."""
    added = set(tok.added_tokens_decoder)
    return {name: i for name, i in tok.get_vocab().items() if i not in added}


def _renames(spec: Family) -> tuple[dict[str, str], dict[str, str]]:
    """old -> new for the plain and the special renames (roles first, then the spare tokens)."""
    if len(spec.plain) + len(spec.special) > len(SPARE):
        raise ValueError("more added tokens than the default tokenizer has spare")
    roles = dict(zip(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), spec.roles, strict=True))
    special = {old: new for old, new in roles.items() if old != new}
    spare = iter(SPARE)
    plain = {next(spare): new for new in spec.plain}
    special |= {next(spare): new for new in spec.special}
    return plain, special
