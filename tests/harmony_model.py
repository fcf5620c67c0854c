"""Tiny models that speak gpt-oss's harmony format, for the harmony tests.

The default model's tokenizer with seven unused added tokens renamed to harmony's markers (and
marked special, as gpt-oss's tokenizer marks them) and a template written for these tests in the
shape of gpt-oss's: messages as `<|start|>ROLE<|message|>TEXT<|end|>`, tools listed in a developer
message, an assistant's tool call as `<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>ARGS<|call|>`. The weights are scripted as in tool_model.py: greedy decoding after
the generation prompt spells a fixed reply.

NOTE: a scripted reply holds each token once (the next token is a function of the current one),
so it can hold only one header: the generation prompt opens the analysis message itself (then
the newline the script starts from), and the reply ends the thought and writes one more message,
the final answer (`make_answer_model`) or a tool call (`make_call_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tool_model import make_scripted_model

HARMONY_TOKENS = {
    "<repo_name>": "<|start|>",
    "<reponame>": "<|end|>",
    "<file_sep>": "<|message|>",
    "<filename>": "<|channel|>",
    "<gh_stars>": "<|constrain|>",
    "<issue_start>": "<|return|>",
    "<issue_comment>": "<|call|>",
}
THOUGHT = "Count apples then add"
FINAL = "Four."
CALL_THOUGHT = "Need the weather tool"
CALL_ARGS = '{"city":"Paris"}'
ANSWER = f"{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}"
CALL = (
    f"{CALL_THOUGHT}<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
    f"<|constrain|>json<|message|>{CALL_ARGS}<|call|>"
)
TEMPLATE = (
    "<|start|>system<|message|>You are a test model.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{%- for tool in tools %}\ntype {{ tool.function.name }} = () => any;{%- endfor %}\n"
    "} // namespace functions<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "<|start|>assistant to=functions.{{ tool_call.function.name }}<|channel|>commentary json"
    "<|message|>{{ tool_call.function.arguments }}<|call|>{%- endfor %}"
    "{%- elif message.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>"
    "commentary<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant<|channel|>analysis<|message|>\n{% endif %}"
)


def make_answer_model(out: Path, tokenizer_from: Path) -> Path:
    """Every chat's reply: a thought, then the final answer."""
    return _make(out, tokenizer_from, ANSWER)


def make_call_model(out: Path, tokenizer_from: Path) -> Path:
    """Every chat's reply: a thought, then a call of `get_weather`."""
    return _make(out, tokenizer_from, CALL)


def _make(out: Path, tokenizer_from: Path, reply: str) -> Path:
    make_scripted_model(out, tokenizer_from, HARMONY_TOKENS, TEMPLATE, reply)
    _mark_special(out, set(HARMONY_TOKENS.values()))
    return out


def _mark_special(out: Path, names: set[str]) -> None:
    """The markers special, as in gpt-oss's tokenizer (the renaming made them plain)."""
    tok = json.loads((out / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        added["special"] = added["special"] or added["content"] in names
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    for entry in config.get("added_tokens_decoder", {}).values():
        entry["special"] = entry["special"] or entry["content"] in names
    (out / "tokenizer_config.json").write_text(json.dumps(config))
