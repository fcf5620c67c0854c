"""The calls of formats that write each parameter apart, between tags (qwen3_coder, glm47,
minimax_m2): a call is its head (the tool's name in the format's tags), then its parameters in
their schema's order, each required one present, each its head (the key in tags), its value and
a newline. What differs by format is in `Tags`; the value, as its parser converts it, is the
format's own (`Tags.value`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import literal, marker
from tokenizer_proc.tool_grammars.schemas import named_params

# NOTE: (rule, schema, end marker) -> the rules of a value and its closing tag, or None
Value = Callable[[str, Any, str], "list[str] | None"]
# NOTE: (start marker, the calls' alternatives, end marker, "+" or "") -> the top rules
Top = Callable[[str, str, str, str], list[str]]


@dataclass(frozen=True)
class Tags:
    name: re.Pattern[str]  # NOTE: names and keys the parser reads back whole
    call: str  # NOTE: a call's head, `{}` for the tool's name
    param: str  # NOTE: a parameter's head, `{}` for its key
    value: Value
    # NOTE: where the parser reads no call of a head alone: the text of a call without
    # parameters (the tool's name in), and a call in tags then has at least one
    empty: Callable[[str], str] | None = None


def build(
    tokenizer: Any, tools: list[dict[str, Any]], tags: Tags, top: Top, parallel: bool
) -> str | None:
    """The grammar of one call (or, `parallel`, several) to `tools`, its top rules `top`'s;
    None where a tool's name or parameters cannot be written so that the parser reads them
    back."""
    built = calls(tags, tools, tokenizer.tool_call_end)
    if built is None:
        return None
    names, rules = built
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    return "\n".join([*top(start, " | ".join(names), end, "+" if parallel else ""), *rules])


def calls(tags: Tags, tools: list[dict[str, Any]], end: str) -> tuple[list[str], list[str]] | None:
    """Each tool's call rule (`c0`, `c1`, ..) and all their rules; None where a tool's name or
    parameters cannot be written so that the parser reads them back."""
    rules, names = [], []
    for i, tool in enumerate(tools):
        call = _call(tags, f"c{i}", tool["function"], end)
        if call is None:
            return None
        rules += call
        names.append(f"c{i}")
    return names, rules


def _call(tags: Tags, rule: str, function: dict[str, Any], end: str) -> list[str] | None:
    params = named_params(function)
    if params is None or not tags.name.fullmatch(function["name"]):
        return None
    items, rules = [], []
    for j, param in enumerate(params):
        name = f"{rule}_p{j}"
        value = tags.value(f"{name}_v", param.schema, end)
        if value is None or not tags.name.fullmatch(param.name):
            return None
        head = literal(tags.param.format(param.name))
        rules += [f'{name}: {head} {name}_v "\\n"', *value]
        items.append(name + ("" if param.required else "?"))
    head = literal(tags.call.format(function["name"]))
    if tags.empty is None or any(p.required for p in params):
        return [f"{rule}: {head} {' '.join(items)}".rstrip(), *rules]
    # NOTE: every parameter optional: the first one present starts each alternative
    alts = [" ".join([items[i].rstrip("?"), *items[i + 1 :]]) for i in range(len(items))]
    alts = [f"{head} {alt}" for alt in alts] + [literal(tags.empty(function["name"]))]
    return [f"{rule}: {' | '.join(alts)}", *rules]
