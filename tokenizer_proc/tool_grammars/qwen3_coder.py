"""mlx-lm's `qwen3_coder` format (Qwen3-Coder), one block per call, as its template writes it:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

mlx-lm's parser takes a VALUE up to the first `</parameter>` (less the newline on each side), as
`None` when it reads "null" in any case, else converted by its parameter's schema type: a string
as it is, an integer or number through `float`, a boolean by whether it reads "true", an object
or array as JSON. So a string is any text without `</parameter>` (nor the end marker, where
the stream parser ends the call) that is not "null"; a string enum is its values' texts; the
other types are JSON literals held to their schema (an integer within a float's exact range).
Parameters are written in their schema's order, each required one present.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizer_proc.tool_grammars.lark import free_text, json_value, literal
from tokenizer_proc.tool_grammars.schemas import ANNOTATIONS, DEFS, types_of, within_lengths
from tokenizer_proc.tool_grammars.tagged import Tags, build

CLOSE = "\n</parameter>"
# NOTE: a name the parser reads back whole (`\s*([^\s<>]+)>?`)
_NAME = re.compile(r"[^\s<>]+")
# NOTE: the parser reads integers through float: past 2**53 they would change
EXACT_INT = 2**53 - 1
_JSON_TYPES = frozenset({"integer", "number", "boolean", "null", "object", "array"})
_LENGTHS = frozenset({"minLength", "maxLength"})


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The grammar of one call (or, `parallel`, several) to `tools`; None where a tool's name
    or parameters cannot be written in this format so that the parser reads them back."""
    return build(tokenizer, tools, TAGS, _top, parallel)


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    # NOTE: calls one after the other: a newline between them (the template's) would be text
    # beside the calls
    return [f"start: call{many}", f'call: {start} "\\n" ({calls}) "</function>\\n" {end}']


def _value(rule: str, schema: Any, end: str) -> list[str] | None:
    """The rules of `rule`: a value and the `\\n</parameter>` after it, as the parser converts
    it for `schema`."""
    if not isinstance(schema, dict):
        return None
    kinds = types_of(schema)
    if len(kinds) > 1:
        return None
    kind = next(iter(kinds), None)
    if kind in _JSON_TYPES:
        exact = _exact(schema) if kind == "integer" else schema
        return [f"{rule}: {rule}_json {literal(CLOSE)}", f"{rule}_json: {json_value(exact)}"]
    if kind not in ("string", None):
        return None
    text = _text(schema, kind == "string", end)
    if text is None:
        return None
    # NOTE: free text is a lexeme (a terminal: intersection and negation are lexemes' own)
    return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {text}"]


def _text(schema: dict[str, Any], typed: bool, end: str) -> str | None:
    """A string (`typed`) or a parameter without a type, written as raw text: free, or one of
    its enum's values. An untyped one converts a JSON object or array, so only texts that are
    not one (and no other rule) are held faithfully."""
    rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
    if rules & {"enum", "const"}:
        values = schema["enum"] if "enum" in schema else [schema.get("const")]
        if rules - {"enum", "const"} - _LENGTHS or not isinstance(values, list):
            return None
        texts = [v for v in values if isinstance(v, str) and within_lengths(v, schema)]
        if not texts or (not typed and len(texts) != len(values)):
            return None
        if not all(_read_back(v, end, typed) for v in texts):
            return None
        return " | ".join(literal(v + CLOSE) for v in texts)
    if rules - _LENGTHS or (rules and not typed):
        return None
    # NOTE: the parser ends a value at the first `</parameter>`, the stream parser a call at the
    # end marker
    lengths = schema.get("minLength", 0), schema.get("maxLength")
    return free_text(CLOSE, "</parameter>", (end,), False, True, *lengths)


def _read_back(text: str, end: str, typed: bool) -> bool:
    """Whether the parser reads `text`, written as a value, back as itself."""
    if "</parameter>" in text or end in text or text.lower() == "null":
        return False
    if typed:
        return True
    try:
        return not isinstance(json.loads(text), (dict, list))
    except ValueError:
        return True


def _exact(schema: dict[str, Any]) -> dict[str, Any]:
    """An integer schema within the range a float holds exactly."""
    low, high = schema.get("minimum", -EXACT_INT), schema.get("maximum", EXACT_INT)
    if not all(isinstance(b, (int, float)) for b in (low, high)):
        return schema
    return {**schema, "minimum": max(low, -EXACT_INT), "maximum": min(high, EXACT_INT)}


TAGS = Tags(_NAME, "<function={}>\n", "<parameter={}>\n", _value)
