"""mlx-lm's `minimax_m2` format (MiniMax M2), a turn's calls in one block, as its template writes
it:

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="K">V</parameter>
    </invoke>
    </minimax:tool_call>

mlx-lm's parser takes each `<invoke name=..>` up to the first `</invoke>`, each parameter's value
up to the first `</parameter>`, stripped, and converts it by the types it reads from the
parameter's schema (its `type`, its enum's values, `anyOf` / `oneOf` / `allOf`; none: a string):
"null" in any case is None; an integer through `int`, a number through `float` (whole values
as integers), a boolean by its word, an object or array as JSON, a string as it is. So a
parameter of one type the parser sees as its schema's own is written so: a string as raw text
without `</parameter>`, `</invoke>` or the end marker, no whitespace at either end and not
"null" (or one of its enum's texts); the others as JSON of their schemas. Parameters are written
in their schema's order, each required one present. A tokenizer whose tags are added tokens
takes the generic form (`lark.spelled`).
"""

from __future__ import annotations

import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import free_text, json_value, literal, marker, spelled
from tokenizer_proc.tool_grammars.schemas import ANNOTATIONS, DEFS, Param, finite, named_params

CLOSE = "</parameter>"
TAGS = ("<invoke", "</invoke>", "<parameter", CLOSE)
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
# NOTE: the types the parser converts to, each from the JSON a schema of that type holds
_JSON_TYPES = frozenset({"integer", "number", "boolean", "object", "array"})
_LENGTHS = frozenset({"minLength", "maxLength"})


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The block of one call (or, `parallel`, one or more) to `tools`; None where a tool's
    name or parameters cannot be written so that the parser reads them back."""
    if not spelled(tokenizer, TAGS):
        return None
    end = tokenizer.tool_call_end
    start_m = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end_m = marker(end, tokenizer.tool_call_end_tokens)
    rules, names = [], []
    for i, tool in enumerate(tools):
        call = _call(f"c{i}", tool["function"], end)
        if call is None:
            return None
        rules += call
        names.append(f"c{i}")
    return "\n".join(
        [
            f'start: {start_m} "\\n" call{"+" if parallel else ""} {end_m}',
            f'call: ({" | ".join(names)}) "</invoke>\\n"',
            *rules,
        ]
    )


def _call(rule: str, function: dict[str, Any], end: str) -> list[str] | None:
    """The rules of one tool's `<invoke>` (its name, then its parameters)."""
    params = named_params(function)
    if params is None or not _NAME.fullmatch(function["name"]):
        return None
    items, rules = [], []
    for j, param in enumerate(params):
        value = _param(f"{rule}_p{j}", param, end)
        if value is None:
            return None
        rules += value
        items.append(f"{rule}_p{j}" + ("" if param.required else "?"))
    head = literal(f'<invoke name="{function["name"]}">\n')
    return [f"{rule}: {head} {' '.join(items)}".rstrip(), *rules]


def _param(rule: str, param: Param, end: str) -> list[str] | None:
    """`<parameter name="K">`, its value, `</parameter>`."""
    if not _NAME.fullmatch(param.name):
        return None
    value = _value(f"{rule}_v", param.schema, end)
    if value is None:
        return None
    head = literal(f'<parameter name="{param.name}">')
    return [f'{rule}: {head} {rule}_v "\\n"', *value]


def _value(rule: str, schema: Any, end: str) -> list[str] | None:
    """The rules of `rule`: a value and the closing tag after it, as the parser converts it."""
    if not isinstance(schema, dict) or set(schema) & {"anyOf", "oneOf", "allOf", "$ref"}:
        return None
    kind = schema.get("type")
    if not isinstance(kind, (str, type(None))):
        return None  # NOTE: a list of types: the parser tries them in its own order
    if kind in _JSON_TYPES:
        if "enum" in schema or "const" in schema:
            return None  # NOTE: the parser reads an enum's values' types too
        return [
            f"{rule}: {rule}_json {literal(CLOSE)}",
            f"{rule}_json: {json_value(finite(schema))}",
        ]
    if kind not in ("string", None):
        return None
    text = _text(schema, end)
    if text is None:
        return None
    return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {text}"]


def _text(schema: dict[str, Any], end: str) -> str | None:
    """A string (or a parameter without a type, which the parser reads as one) as raw text:
    free, or one of its enum's string values (an enum holding others is another type)."""
    rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
    if rules & {"enum", "const"}:
        values = schema["enum"] if "enum" in schema else [schema.get("const")]
        if rules - {"enum", "const"} - _LENGTHS or not isinstance(values, list):
            return None
        if not all(isinstance(v, str) for v in values):
            return None
        texts = [v for v in values if _fits(v, schema, end)]
        return " | ".join(literal(v + CLOSE) for v in texts) or None
    if rules - _LENGTHS:
        return None
    lengths = schema.get("minLength", 0), schema.get("maxLength")
    return free_text(CLOSE, None, ("</invoke>", end), True, True, *lengths)


def _fits(text: str, schema: dict[str, Any], end: str) -> bool:
    """Whether `text`, written as a value, is read back as itself within the schema's lengths."""
    longest = schema.get("maxLength")
    return (
        text == text.strip()
        and text.lower() != "null"
        and not any(tag in text for tag in (CLOSE, "</invoke>", end))
        and schema.get("minLength", 0) <= len(text)
        and (longest is None or len(text) <= longest)
    )
