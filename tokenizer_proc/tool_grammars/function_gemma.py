"""mlx-lm's `function_gemma` format (FunctionGemma), one block per call:

    <start_function_call>call:NAME{key:<escape>text<escape>,count:3}<end_function_call>

mlx-lm's parser takes the first `call:NAME{..}` of a block, the arguments up to the first `}`.
Each key runs up to its `:`; a value that starts with `<escape>` is the text up to the next
`<escape>` (the one character after it, the comma, skipped), any other the text up to the next
`,`, read as JSON (else kept as text). So a string is `<escape>`-quoted text with neither
`<escape>` nor `}` in it (nor the end marker, where the stream parser ends the call); a number,
integer, boolean or null is JSON, which holds no `,` or `}` for such a value. An array or object
holds both and cannot be written: an optional parameter of that kind is left out of the call, a
required one sends the call to the generic form, as do names the parser would not read back
whole. Where `<escape>` is an added token (FunctionGemma's own tokenizer), a string closes with
that token alone and its text is a lexeme without `<escape>` in it: llguidance lets an added token
through the mask for its text and then fails to consume it (`lark.marker`), and a lexeme that
ended with the tag's text would run on past a tag made of ordinary tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import (
    bare_text,
    free_text,
    json_value,
    literal,
    marker,
    optional_list,
    spelled,
)
from tokenizer_proc.tool_grammars.schemas import (
    ANNOTATIONS,
    DEFS,
    finite,
    named_params,
    types_of,
    within_lengths,
)

ESCAPE = "<escape>"
_NAME = re.compile(r"[A-Za-z0-9_]+")  # NOTE: the parser's `\w+`, ASCII
_KEY = re.compile(r"[A-Za-z0-9_.-]+")  # NOTE: no `:` to split at, no `,` `{` `}`
_SCALARS = frozenset({"integer", "number", "boolean", "null"})
_LENGTHS = frozenset({"minLength", "maxLength"})


@dataclass(frozen=True)
class Escape:
    """How a string's escapes are written: `token`, the id of `<escape>` where it is one added
    token (None: it is text of ordinary tokens)."""

    token: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> Escape:
        if spelled(tokenizer, (ESCAPE,)):
            return cls(None)
        return cls(tokenizer.encode(ESCAPE, add_special_tokens=False)[0])

    def quoted(self, text: str) -> str:
        """`text` between escapes, as Lark."""
        if self.token is None:
            return literal(ESCAPE + text + ESCAPE)
        tag = f"<[{self.token}]>"
        return f"{tag} {literal(text)} {tag}" if text else f"{tag} {tag}"

    def free(
        self, rule: str, never: tuple[str, ...], shortest: int, longest: int | None
    ) -> list[str]:
        """The rules of `rule`, free text between escapes."""
        name = rule.upper()
        if self.token is None:
            # NOTE: the text and its closing escape are one lexeme (a terminal: intersection and
            # negation are lexemes' own), which ends at the first escape
            text = free_text(ESCAPE, never=never, shortest=shortest, longest=longest)
            return [f"{rule}: {literal(ESCAPE)} {name}", f"{name}: {text}"]
        tag = f"<[{self.token}]>"
        text = bare_text((ESCAPE, *never), shortest, longest)
        return [f"{rule}: {tag} {name} {tag}", f"{name}: {text}"]


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The grammar of one call (or, `parallel`, one or more) to `tools`; None where a tool's
    name or a required parameter cannot be written so that the parser reads it back."""
    escape = Escape.of(tokenizer)
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    rules, names = [], []
    for i, tool in enumerate(tools):
        call = _call(f"c{i}", tool["function"], tokenizer.tool_call_end, escape)
        if call is None:
            return None
        rules += call
        names.append(f"c{i}")
    return "\n".join(
        [
            f"start: call{'+' if parallel else ''}",
            f"call: {start} ({' | '.join(names)}) {end}",
            *rules,
        ]
    )


def _call(rule: str, function: dict[str, Any], end: str, escape: Escape) -> list[str] | None:
    """`call:NAME{key:value,..}`: the rules of one tool's call."""
    params = named_params(function)
    if params is None or not _NAME.fullmatch(function["name"]):
        return None
    items, values = [], []
    for j, param in enumerate(params):
        key = _KEY.fullmatch(param.name)
        value = _value(f"{rule}_v{j}", param.schema, end, escape) if key else None
        if value is None and param.required:
            return None
        if value is not None:
            items.append((f"{literal(param.name + ':')} {rule}_v{j}", param.required))
            values += value
    args, arg_rules = optional_list(f"{rule}_args", items, ",")
    head = literal(f"call:{function['name']}{{")
    return [f"{rule}: {' '.join(filter(None, [head, args, literal('}')]))}", *arg_rules, *values]


def _value(rule: str, schema: Any, end: str, escape: Escape) -> list[str] | None:
    """The rules of `rule`, a value as the parser reads it back; None where it cannot be."""
    if not isinstance(schema, dict):
        return None
    kinds = types_of(schema)
    enum = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if kinds == {"string"} or (not kinds and enum and all(isinstance(v, str) for v in enum)):
        return _text(rule, schema, enum, end, escape)
    if kinds and kinds <= _SCALARS:
        return [f"{rule}: {json_value(finite(schema))}"]
    return None


def _text(
    rule: str, schema: dict[str, Any], enum: Any, end: str, escape: Escape
) -> list[str] | None:
    """A string between escapes: one of its enum's values, or free text."""
    rules = set(schema) - ANNOTATIONS - set(DEFS) - {"type"}
    if enum is not None:
        if rules - {"enum", "const"} - _LENGTHS or not isinstance(enum, list):
            return None
        texts = [v for v in enum if isinstance(v, str) and _fits(v, schema, end)]
        alts = " | ".join(f"({escape.quoted(v)})" for v in texts)
        return [f"{rule}: {alts}"] if alts else None
    if rules - _LENGTHS:
        return None
    shortest, longest = schema.get("minLength", 0), schema.get("maxLength")
    return escape.free(rule, ("}", end), shortest, longest)


def _fits(text: str, schema: dict[str, Any], end: str) -> bool:
    """Whether `text`, between escapes, is read back as itself within the schema's lengths."""
    return (
        ESCAPE not in text and "}" not in text and end not in text and within_lengths(text, schema)
    )
