"""mlx-lm's `glm47` format (GLM-4.5 to 4.7; Poolside Laguna's parser is the same), one block per
call, as its template writes it:

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
(`lark.spelled`). LongCat's format is this one with other tags (longcat.py: `KeyValueTags`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import free_text, json_value, literal, spelled
from tokenizer_proc.tool_grammars.schemas import ANNOTATIONS, DEFS, finite, within_lengths
from tokenizer_proc.tool_grammars.tagged import Tags, build

# NOTE: names and keys the parser reads back whole: stripped, and a name alone (a call without
# parameters) goes through its plain-text and JSON fallbacks, which split on spaces and read
# brackets
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_LENGTHS = frozenset({"minLength", "maxLength"})


@dataclass(frozen=True)
class KeyValueTags:
    """A format that writes each parameter's key and value in tags of their own; `empty`: see
    `Tags.empty`."""

    key: tuple[str, str]
    value: tuple[str, str]
    empty: Callable[[str], str] | None = None

    def grammar(self, tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
        """The grammar of one call (or, `parallel`, several) to `tools`; None where a tool's
        name or parameters cannot be written in this format so that the parser reads them
        back."""
        if not spelled(tokenizer, (*self.key, *self.value)):
            return None
        return build(tokenizer, tools, self.tags, _top, parallel)

    @property
    def tags(self) -> Tags:
        param = f"{self.key[0]}{{}}{self.key[1]}\n{self.value[0]}"
        return Tags(_NAME, "{}\n", param, self._value, self.empty)

    def _value(self, rule: str, schema: Any, end: str) -> list[str] | None:
        """The rules of `rule`: a value and the closing tag after it, as the parser converts
        it."""
        close = self.value[1]
        if not isinstance(schema, dict):
            return None
        if schema.get("type") != "string":
            # NOTE: JSON, read back by `json.loads` before anything else
            return [
                f"{rule}: {rule}_json {literal(close)}",
                f"{rule}_json: {json_value(finite(schema))}",
            ]
        text = _text(schema, close, end)
        if text is None:
            return None
        # NOTE: free text is a lexeme (a terminal: intersection and negation are lexemes' own)
        return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {text}"]


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    return [f"start: call{many}", f"call: {start} ({calls}) {end}"]


def _text(schema: dict[str, Any], close: str, end: str) -> str | None:
    """A string written as raw text: free, or one of its enum's values."""
    rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
    if rules & {"enum", "const"}:
        values = schema["enum"] if "enum" in schema else [schema.get("const")]
        if rules - {"enum", "const"} - _LENGTHS or not isinstance(values, list):
            return None
        texts = [v for v in values if isinstance(v, str) and _fits(v, schema, close, end)]
        return " | ".join(literal(v + close) for v in texts) or None
    if rules - _LENGTHS:
        return None
    lengths = schema.get("minLength", 0), schema.get("maxLength")
    return free_text(close, never=(end,), trimmed=True, shortest=lengths[0], longest=lengths[1])


def _fits(text: str, schema: dict[str, Any], close: str, end: str) -> bool:
    """Whether `text`, written as a value, is read back as itself within the schema's lengths."""
    return (
        text == text.strip()
        and close not in text
        and end not in text
        and within_lengths(text, schema)
    )


GLM = KeyValueTags(("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>"))
grammar = GLM.grammar
