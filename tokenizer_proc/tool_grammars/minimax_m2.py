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
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import free_text, json_value, literal, spelled
from tokenizer_proc.tool_grammars.schemas import ANNOTATIONS, DEFS, finite, within_lengths
from tokenizer_proc.tool_grammars.tagged import Tags, build

CLOSE = "</parameter>"
SPELLED = ("<invoke", "</invoke>", "<parameter", CLOSE)
NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # NOTE: names and keys the parser reads back whole
# NOTE: the types the parser converts to, each from the JSON a schema of that type holds
_JSON_TYPES = frozenset({"integer", "number", "boolean", "object", "array"})
_LENGTHS = frozenset({"minLength", "maxLength"})


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The block of one call (or, `parallel`, one or more) to `tools`; None where a tool's
    name or parameters cannot be written so that the parser reads them back."""
    if not spelled(tokenizer, SPELLED):
        return None
    return build(tokenizer, tools, TAGS, _top, parallel)


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    return [f'start: {start} "\\n" call{many} {end}', f'call: ({calls}) "</invoke>\\n"']


@dataclass(frozen=True)
class RawValues:
    """Values as minimax_m2's parser converts them, each before its closing tag `close`; a raw
    text value holds none of `stops` (the tags after it) or `never`. MiniCPM5's parser converts
    as this one does (minicpm5.py)."""

    close: str
    stops: tuple[str, ...]
    never: tuple[str, ...] = ()

    def __call__(self, rule: str, schema: Any, end: str) -> list[str] | None:
        """The rules of `rule`: a value and the closing tag after it, as the parser converts
        it."""
        if not isinstance(schema, dict) or set(schema) & {"anyOf", "oneOf", "allOf", "$ref"}:
            return None
        kind = schema.get("type")
        if not isinstance(kind, (str, type(None))):
            return None  # NOTE: a list of types: the parser tries them in its own order
        if kind in _JSON_TYPES:
            if "enum" in schema or "const" in schema:
                return None  # NOTE: the parser reads an enum's values' types too
            return [
                f"{rule}: {rule}_json {literal(self.close)}",
                f"{rule}_json: {json_value(finite(schema))}",
            ]
        if kind not in ("string", None):
            return None
        text = self._text(schema, end)
        if text is None:
            return None
        return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {text}"]

    def _text(self, schema: dict[str, Any], end: str) -> str | None:
        """A string (or a parameter without a type, which the parser reads as one) as raw
        text: free, or one of its enum's string values (an enum holding others is another
        type)."""
        rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
        if rules & {"enum", "const"}:
            values = schema["enum"] if "enum" in schema else [schema.get("const")]
            if rules - {"enum", "const"} - _LENGTHS or not isinstance(values, list):
                return None
            if not all(isinstance(v, str) for v in values):
                return None
            texts = [v for v in values if self._fits(v, schema, end)]
            return " | ".join(literal(v + self.close) for v in texts) or None
        if rules - _LENGTHS:
            return None
        lengths = schema.get("minLength", 0), schema.get("maxLength")
        never = (*self.stops, end, *self.never)
        return free_text(self.close, None, never, True, True, *lengths)

    def _fits(self, text: str, schema: dict[str, Any], end: str) -> bool:
        """Whether `text`, written as a value, is read back as itself within the schema's
        lengths."""
        return (
            text == text.strip()
            and text.lower() != "null"
            and not any(tag in text for tag in (self.close, *self.stops, end, *self.never))
            and within_lengths(text, schema)
        )


TAGS = Tags(NAME, '<invoke name="{}">\n', '<parameter name="{}">', RawValues(CLOSE, ("</invoke>",)))
