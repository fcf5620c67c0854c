"""mlx-lm's `mistral` format. Its start marker is `[TOOL_CALLS]` and it has no end marker: the
calls run to the end of the output. The parser reads two syntaxes, and a forced call takes the
one its template writes:

- `[TOOL_CALLS]NAME[ARGS]{..}` for each call (the templates of Mistral Small 3.2, Magistral,
  Devstral, whose history writes `[ARGS]`; the parser finds each `NAME[ARGS]` with
  `[\\w-]+`, so other names take the generic form);
- `[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]`, one JSON array (the older templates).
"""

from __future__ import annotations

import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import json_value, literal, marker, marker_of
from tokenizer_proc.tool_grammars.schemas import call_schema, finite, parameters

ARGS = "[ARGS]"
# NOTE: what the parser's `([\w-]+)\s*\[ARGS\]` reads as a whole name (ASCII: `\w` is wider)
_NAME = re.compile(r"[A-Za-z0-9_-]+")


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    if ARGS in (getattr(tokenizer, "chat_template", None) or ""):
        return _headers(tokenizer, start, tools, parallel)
    return _array(start, tools, parallel)


def _headers(tokenizer: Any, start: str, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """`[TOOL_CALLS]NAME[ARGS]{..}`, once or (`parallel`) repeated."""
    if not all(_NAME.fullmatch(t["function"]["name"]) for t in tools):
        return None
    args = marker_of(tokenizer, ARGS)
    names = [f"c{i}" for i in range(len(tools))]
    rules = []
    for name, tool in zip(names, tools, strict=True):
        function = tool["function"]
        rules.append(f"{name}: {literal(function['name'])} {args} {name}_args")
        rules.append(f"{name}_args: {json_value(finite(parameters(function)))}")
    return "\n".join(
        [f"start: call{'+' if parallel else ''}", f"call: {start} ({' | '.join(names)})", *rules]
    )


def _array(start: str, tools: list[dict[str, Any]], parallel: bool) -> str:
    """`[TOOL_CALLS] [{"name": .., "arguments": {..}}, ..]`, one call at least (exactly one
    without `parallel`)."""
    calls = [call_schema(t["function"], "arguments") for t in tools]
    array: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        array["maxItems"] = 1
    return f'start: {start} " "? calls\ncalls: {json_value(array)}'
