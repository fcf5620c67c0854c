"""mlx-lm's `kimi_k2` format (Kimi K2), a turn's calls in one section, as its template writes it:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>{..}<|tool_call_end|>..<|tool_calls_section_end|>

mlx-lm's parser splits the section at each `<|tool_call_begin|>..<|tool_call_end|>`, takes the
name between an optional `functions.` and the last `:I` before the argument marker, and reads
the arguments as JSON. So the arguments are JSON of the tool's schema, and the names those the
parser reads back whole (`[A-Za-z0-9_.-]`: no `:` to split at); I is the call's index, a number.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import json_value, literal, marker, marker_of
from tokenizer_proc.tool_grammars.schemas import finite, parameters

BEGIN, ARGS, END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The section of one call (or, `parallel`, one or more) to `tools`; None where a name
    would not be read back."""
    if not all(_NAME.fullmatch(t["function"]["name"]) for t in tools):
        return None
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    begin, args, close = (marker_of(tokenizer, m) for m in (BEGIN, ARGS, END))
    names = [f"c{i}" for i in range(len(tools))]
    rules = []
    for name, tool in zip(names, tools, strict=True):
        function = tool["function"]
        head = literal(f"functions.{function['name']}:")
        rules.append(f"{name}: {head} INDEX {args} {name}_args")
        rules.append(f"{name}_args: {json_value(finite(parameters(function)))}")
    return "\n".join(
        [
            f"start: {start} call{'+' if parallel else ''} {end}",
            f"call: {begin} ({' | '.join(names)}) {close}",
            "INDEX: /[0-9]{1,3}/",
            *rules,
        ]
    )
