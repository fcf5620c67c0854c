"""mlx-lm's `pythonic` format (LFM2 and others): `<|tool_call_start|>[name(a="x", b=2),
..]<|tool_call_end|>`, a Python list of calls with keyword arguments.

The parser reads the list with Python's `ast` and each argument with `literal_eval`, JSON's
`true` / `false` / `null` taken for Python's. So each value is written as JSON held to its
parameter's schema: llguidance's JSON is Python too (its strings take no `\\/` or `\\u` escape,
which Python would read otherwise; its bounded numbers no exponent). Names must be Python's:
an ASCII identifier that is no keyword for each argument, and dotted ones for the function
(what `ast` reads back as the same name); any other takes the generic form.
"""

from __future__ import annotations

import keyword
import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import json_value, literal, marker, optional_list
from tokenizer_proc.tool_grammars.schemas import named_params

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    rules, names = [], []
    for i, tool in enumerate(tools):
        call = _call(f"c{i}", tool["function"])
        if call is None:
            return None
        rules += call
        names.append(f"c{i}")
    more = ' (", " call)*' if parallel else ""
    return "\n".join(
        [f'start: {start} "[" call{more} "]" {end}', f"call: {' | '.join(names)}", *rules]
    )


def _call(rule: str, function: dict[str, Any]) -> list[str] | None:
    """`name(key=value, ..)`: the rules of one tool's call."""
    params = named_params(function)
    name = function["name"]
    if params is None or not all(_identifier(part) for part in name.split(".")):
        return None
    if not all(_identifier(p.name) and isinstance(p.schema, dict) for p in params):
        return None
    items = [(f"{literal(p.name + '=')} {rule}_v{j}", p.required) for j, p in enumerate(params)]
    args, arg_rules = optional_list(f"{rule}_args", items, ", ")
    values = [f"{rule}_v{j}: {json_value(p.schema)}" for j, p in enumerate(params)]
    return [f'{rule}: {literal(name + "(")} {args} ")"', *arg_rules, *values]


def _identifier(name: str) -> bool:
    return bool(_IDENT.fullmatch(name)) and not keyword.iskeyword(name)
