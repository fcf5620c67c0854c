"""mlx-lm's `glm47` format (GLM-4.5 to 4.7), one block per call, as its template writes it:

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    </tool_call>

mlx-lm's parser takes the name before the first `<arg_key>` and each key and value up to its
closing tag, all stripped of surrounding whitespace. A parameter whose schema's type is "string"
keeps its value's text; any other is read as JSON (then as a Python literal, then as text). So a
string is text without the closing tag (nor the end marker, where the stream parser ends the
call) and without whitespace at either end; a string enum is its values' texts; every other
value is JSON held to its schema. A call without parameters is the name alone, which the parser
reads through its plain-text fallback. Parameters are written in their schema's order, each
required one present. A tokenizer whose tags are added tokens takes the generic form
(`lark.spelled`).
"""

from __future__ import annotations

import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import free_text, json_value, literal, spelled
from tokenizer_proc.tool_grammars.schemas import ANNOTATIONS, DEFS, finite, within_lengths
from tokenizer_proc.tool_grammars.tagged import Tags, build

CLOSE = "</arg_value>"
SPELLED = ("<arg_key>", "</arg_key>", "<arg_value>", CLOSE)
# NOTE: names and keys the parser reads back whole: stripped, and a name alone (a call without
# parameters) goes through its plain-text and JSON fallbacks, which split on spaces and read
# brackets
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_LENGTHS = frozenset({"minLength", "maxLength"})


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The grammar of one call (or, `parallel`, several) to `tools`; None where a tool's name
    or parameters cannot be written in this format so that the parser reads them back."""
    if not spelled(tokenizer, SPELLED):
        return None
    return build(tokenizer, tools, TAGS, _top, parallel)


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    return [f"start: call{many}", f"call: {start} ({calls}) {end}"]


def _value(rule: str, schema: Any, end: str) -> list[str] | None:
    """The rules of `rule`: a value and the closing tag after it, as the parser converts it."""
    if not isinstance(schema, dict):
        return None
    if schema.get("type") != "string":
        # NOTE: JSON, read back by `json.loads` before anything else
        return [
            f"{rule}: {rule}_json {literal(CLOSE)}",
            f"{rule}_json: {json_value(finite(schema))}",
        ]
    text = _text(schema, end)
    if text is None:
        return None
    # NOTE: free text is a lexeme (a terminal: intersection and negation are lexemes' own)
    return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {text}"]


def _text(schema: dict[str, Any], end: str) -> str | None:
    """A string written as raw text: free, or one of its enum's values."""
    rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
    if rules & {"enum", "const"}:
        values = schema["enum"] if "enum" in schema else [schema.get("const")]
        if rules - {"enum", "const"} - _LENGTHS or not isinstance(values, list):
            return None
        texts = [v for v in values if isinstance(v, str) and _fits(v, schema, end)]
        return " | ".join(literal(v + CLOSE) for v in texts) or None
    if rules - _LENGTHS:
        return None
    lengths = schema.get("minLength", 0), schema.get("maxLength")
    return free_text(CLOSE, never=(end,), trimmed=True, shortest=lengths[0], longest=lengths[1])


def _fits(text: str, schema: dict[str, Any], end: str) -> bool:
    """Whether `text`, written as a value, is read back as itself within the schema's lengths."""
    return (
        text == text.strip()
        and CLOSE not in text
        and end not in text
        and within_lengths(text, schema)
    )


TAGS = Tags(_NAME, "{}\n", "<arg_key>{}</arg_key>\n<arg_value>", _value)
