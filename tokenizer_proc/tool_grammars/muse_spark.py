"""mlx-lm's `muse_spark` format (Muse Spark's XML_ATEM), a turn's calls in one block:

    <atem:function_calls>
    <atem:invoke name="NAME">
    <atem:parameter name="K">V</atem:parameter>
    </atem:invoke>
    </atem:function_calls>

mlx-lm's parser takes each `<atem:invoke name="..">` up to its `</atem:invoke>` (a whole
parameter element counts as one piece, so a `</atem:invoke>` inside a value does not end it),
each parameter's value up to the first `</atem:parameter>`, and reads a value with `json.loads`
first, else as its text stripped. So every value but a string is JSON of its schema, read back
as written (as in every tagged format here, a string inside a JSON value may spell out the
closing tag, which llguidance's JSON cannot rule out). A string (a "string" schema, or an enum
of strings) is written in one of two ways that read back as itself:

- raw text, the template's own way: no whitespace at either end (Python's `strip`, which takes
  `\\x1c`-`\\x1f` too), no `</atem:parameter>`, end marker or think start inside, and nothing
  `json.loads` reads: not `true`, `false`, `null`, `NaN`, `Infinity`, `-Infinity` or a JSON
  number, and not opening with `"`, `{` or `[` (whether JSON reads such a text depends on its
  nesting or escapes; a lexeme telling them apart, where regular at all, was more than
  llguidance's lexer would build);
- a JSON string literal without escapes (no `"`, `\\` or control character: so the text
  between the quotes is the string, its lengths the schema's), for what the raw form leaves out
  ("42", "true", "[x]"), with the same tags kept out.

A string held to more than its lengths (a pattern, a format) is JSON like the rest. An enum's
string is written raw where that reads back, else as JSON.

The name and keys are those the parser reads back whole. Parameters are written in their
schema's order, each required one present. A tokenizer whose tags are added tokens takes the
generic form (`lark.spelled`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import (
    json_value,
    literal,
    regex_text,
    spelled,
    think_start,
    trimmed_regex,
)
from tokenizer_proc.tool_grammars.minimax_m2 import NAME
from tokenizer_proc.tool_grammars.schemas import finite, is_text, within_lengths
from tokenizer_proc.tool_grammars.tagged import Tags, build

CLOSE = "</atem:parameter>"
SPELLED = ("<atem:invoke", "</atem:invoke>", "<atem:parameter", CLOSE)
_ANY = "(?s:.*)"
# NOTE: the whole texts `json.loads` reads that open otherwise than with `"`, `{` or `[`: its
# literals and numbers, as a Lark regex
_JSON_TEXT = "|".join(
    [
        *(regex_text(word) for word in ("true", "false", "null", "NaN", "Infinity", "-Infinity")),
        f"{regex_text('-')}?(?:0|[1-9][0-9]*)(?:{regex_text('.')}[0-9]+)?"
        + "(?:[eE][\\x{2b}\\x{2d}]?[0-9]+)?",
    ]
)
# NOTE: a character Python's `strip` keeps (it takes `\x1c`-`\x1f` too, which `\s` does not);
# the first is no `"`, `{` or `[`, which may open JSON that `json.loads` reads
_EDGE = "[^\\s\\x{1c}-\\x{1f}]"
_FIRST = "[^\\s\\x{1c}-\\x{1f}\\x{22}\\x{7b}\\x{5b}]"


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The block of one call (or, `parallel`, one or more) to `tools`; None where a tool's
    name or parameters cannot be written so that the parser reads them back."""
    if not spelled(tokenizer, SPELLED):
        return None
    tags = Tags(
        NAME,
        '<atem:invoke name="{}">\n',
        '<atem:parameter name="{}">',
        Values(think_start(tokenizer)),
    )
    return build(tokenizer, tools, tags, _top, parallel)


def _top(start: str, calls: str, end: str, many: str) -> list[str]:
    return [f'start: {start} "\\n" call{many} {end}', f'call: ({calls}) "</atem:invoke>\\n"']


@dataclass(frozen=True)
class Values:
    """Values as muse_spark's parser reads them, each before `</atem:parameter>`; `never`:
    texts besides the tags that no string holds (the think start)."""

    never: tuple[str, ...]

    def __call__(self, rule: str, schema: Any, end: str) -> list[str] | None:
        """The rules of `rule`: a value and the closing tag after it."""
        if not isinstance(schema, dict):
            return None
        if not is_text(schema):
            return [
                f"{rule}: {rule}_json {literal(CLOSE)}",
                f"{rule}_json: {json_value(finite(schema))}",
            ]
        never = (end, *self.never)
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            texts = [_written(v) for v in values if _fits(v, schema, never)]
            return [f"{rule}: {' | '.join(literal(t + CLOSE) for t in texts)}"] if texts else None
        lengths = schema.get("minLength", 0), schema.get("maxLength")
        # NOTE: each a lexeme (a terminal: intersection and negation are lexemes' own), the two
        # disjoint (raw text opens with no `"`)
        raw, name = _raw(never, *lengths), rule.upper()
        if raw is None:
            return None
        return [
            f"{rule}: {name}_RAW | {name}_JSON",
            f"{name}_RAW: {raw}",
            f"{name}_JSON: {_quoted(never, *lengths)}",
        ]


def _raw(never: tuple[str, ...], shortest: int, longest: int | None) -> str | None:
    """Raw text the parser reads back as itself, and the closing tag; None where the lengths
    leave none."""
    body = trimmed_regex(_FIRST, _EDGE, shortest, longest)
    if body is None:
        return None
    tag = regex_text(CLOSE)
    absent = [f"~/{_ANY}{regex_text(t)}{_ANY}/" for t in never]
    cut, unread = f"~/{_ANY}{tag}(?s:.+)/", f"~/(?:{_JSON_TEXT}){tag}/"
    return " & ".join([f"/{body}{tag}/", cut, unread, *absent])


def _quoted(never: tuple[str, ...], shortest: int, longest: int | None) -> str:
    """A JSON string literal without escapes, and the closing tag."""
    tag = regex_text(CLOSE)
    most = "" if longest is None else int(longest)
    body = f"/\\x{{22}}[^\\x{{22}}\\x{{5c}}\\x{{0}}-\\x{{1f}}]{{{int(shortest)},{most}}}\\x{{22}}{tag}/"
    absent = [f"~/{_ANY}{regex_text(t)}{_ANY}/" for t in never]
    return " & ".join([body, f"~/{_ANY}{tag}(?s:.+)/", *absent])


def _fits(value: Any, schema: dict[str, Any], never: tuple[str, ...]) -> bool:
    """Whether an enum's `value` can be written: a string within the schema's lengths without
    the tags."""
    return (
        isinstance(value, str)
        and not any(t in value for t in (CLOSE, *never))
        and within_lengths(value, schema)
    )


def _written(text: str) -> str:
    """An enum's string as written: raw where the parser reads that back as itself, else JSON."""
    try:
        json.loads(text)
    except ValueError:
        if text == text.strip():
            return text
    return json.dumps(text, ensure_ascii=False)
