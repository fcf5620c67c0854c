"""A tiny thinking model: every chat's greedy reply is a thought, then an answer.

The default model's tokenizer with two unused added tokens renamed to `<think>` and `</think>`
(mlx-lm then infers the think markers from the vocabulary, as for Qwen3 or DeepSeek-R1) and a
template written for these tests in the shape of DeepSeek-R1's and Qwen3's thinking models: the
generation prompt opens the thought (`<think>` then a newline), and `enable_thinking: false`
renders an empty thought instead, Qwen3's switch. The weights are scripted as in tool_model.py.
"""

from __future__ import annotations

from pathlib import Path

from tool_model import make_scripted_model

THINK_TOKENS = {"<issue_closed>": "<think>", "<jupyter_start>": "</think>"}
REASONING = "Count apples then add"
FINAL = "Four."
# NOTE: what the model writes after the generation prompt (which opened the thought)
ANSWER = f"{REASONING}</think>{FINAL}"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def make_think_model(out: Path, tokenizer_from: Path) -> Path:
    return make_scripted_model(out, tokenizer_from, THINK_TOKENS, TEMPLATE, ANSWER)
