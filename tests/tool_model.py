"""A tiny model that answers every chat with one tool call, for the tool-calling tests.

The tokenizer is the default model's, with two unused added tokens renamed to `<tool_call>` and
`</tool_call>` and a chat template that renders tools the way mlx-lm recognises (its `json_tools`
parser). The weights are random except that every layer's output projections are zero, so the
last hidden state is the current token's embedding alone, and the untied head maps each token of
a fixed answer to the next one: greedy decoding after the generation prompt spells the answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, save_model

from engine.random_model import TINY_LLAMA, make_random_model

TOOL_START, TOOL_END = 8, 9  # ids of <issue_start>, <issue_comment>: renamed below
# NOTE: compact JSON whose tokens are all distinct, so "next token" is a function of the token
ANSWER = '<tool_call>{"name":"f","arguments":{}}</tool_call>'
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n"
    "{%- for tool in tools %}\n{{ tool.function.name }}: {{ tool.function.description }}"
    "{%- endfor %}\nCall one as <tool_call>{json}</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- set tool_call = tool_call.function %}"
    '<tool_call>{"name":"{{ tool_call.name }}","arguments":{{ tool_call.arguments | tojson }}}'
    "</tool_call>{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOL_TOKENS = {"<issue_start>": "<tool_call>", "<issue_comment>": "</tool_call>"}


def make_tool_model(out: Path, tokenizer_from: Path) -> Path:
    return make_scripted_model(out, tokenizer_from, TOOL_TOKENS, TEMPLATE, ANSWER)


def make_scripted_model(
    out: Path, tokenizer_from: Path, names: dict[str, str], template: str, answer: str
) -> Path:
    """A tiny model whose greedy reply to any chat is `answer` (its tokens distinct), with
    added tokens renamed (`names`: old -> new, not special) and its own chat `template`."""
    make_random_model(
        out, {**TINY_LLAMA, "tie_word_embeddings": False}, tokenizer_from=tokenizer_from
    )
    _rename_tokens(out, names, template)
    _chain_weights(out, answer)
    return out


def _rename_tokens(
    out: Path, names: dict[str, str], template: str, special: dict[str, str] | None = None
) -> None:
    """Rename added tokens (old -> new): `names` become plain tokens, `special` stay special;
    the tokenizer's bos / eos / pad / unk follow their tokens' new names."""
    renames = {**names, **(special or {})}
    specials = set((special or {}).values())
    tok = json.loads((out / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] in renames:
            added["content"] = renames[added["content"]]
            added["special"] = added["content"] in specials
    vocab = tok["model"]["vocab"]
    for old, new in renames.items():
        assert new not in vocab, f"{new!r} is already a token"
        vocab[new] = vocab.pop(old)
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for entry in config.get("added_tokens_decoder", {}).values():
        if entry["content"] in renames:
            entry["content"] = renames[entry["content"]]
            entry["special"] = entry["content"] in specials
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(_renamed_roles(config, renames)))
    roles = out / "special_tokens_map.json"
    if roles.exists():
        roles.write_text(json.dumps(_renamed_roles(json.loads(roles.read_text()), renames)))


ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _renamed_roles(config: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """bos / eos / pad / unk renamed with their tokens (a plain string or an AddedToken dict)."""
    out = dict(config)
    for role in ROLES:
        value = out.get(role)
        if isinstance(value, str) and value in renames:
            out[role] = renames[value]
        elif isinstance(value, dict) and value.get("content") in renames:
            out[role] = {**value, "content": renames[value["content"]]}
    return out


def answer_ids(out: Path, answer: str = ANSWER) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out).encode(answer, add_special_tokens=False)


def _chain_weights(out: Path, answer: str) -> None:
    chain = [198, *answer_ids(out, answer), 2]  # "\n" ends the generation prompt; 2 is <|im_end|>
    assert len(set(chain)) == len(chain), "the answer's tokens must be distinct"
    model, config = load_model(out)
    params = dict(tree_flatten(model.parameters()))
    embed = params["model.embed_tokens.weight"]
    head = mx.zeros(params["lm_head.weight"].shape)
    for cur, nxt in zip(chain, chain[1:], strict=False):
        h = embed[cur] / mx.sqrt(mx.mean(embed[cur] ** 2) + 1e-5)  # the final RMSNorm's output
        head[nxt] = head[nxt] + 10.0 * h / mx.sum(h * h)  # NOTE: logit 10 for the successor
    params["lm_head.weight"] = head
    for name in params:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = mx.zeros(params[name].shape)
    model.load_weights(list(params.items()))
    mx.eval(model.parameters())
    save_model(out, model)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 2}))
