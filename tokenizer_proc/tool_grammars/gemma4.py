"""mlx-lm's `gemma4` format (Gemma 4), one block per call:

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1,nested:{a:1,list:[<|"|>x<|"|>,2]}}<tool_call|>

mlx-lm's parser finds `call:NAME{..}`, its braces balanced (those in a `<|"|>..<|"|>` string not
counted), and makes JSON of the arguments: each string, up to the next `<|"|>`, is set aside; a
key (`\\w+`) right after a `{` or `,` and before a `:` is quoted; the strings come back as JSON
strings; `json.loads` reads the whole. So the arguments are written in that syntax, from their
schema:

- a string is `<|"|>`-quoted text within its lengths, without `<|"|>`, the end marker (where the
  stream parser ends the call) or the think start (where the engine cuts a thought out of the
  reply: `reply_split`); an enum's strings the same;
- a number, integer, boolean or null is JSON, the same text in both;
- an object is `{k:v,..}` with bare keys, of ASCII word characters (the ones the parser quotes),
  and no space after a `,` (a key after one would stay bare): its properties in their schema's
  order, each required one present, no others; an array is `[v,..]` within its item counts;
- a value of several types is any one of them; an untyped one any value (an object's keys word
  characters).

A schema that says more (`$ref`, `anyOf`, `pattern`, `format`, `uniqueItems`,
`minProperties`, ..) cannot be written: an optional property held to one is left out of the
call, a required one sends the tools to the generic form, as does a name the parser would not
read back whole (its `[\\w-]+`, ASCII). Parallel calls are consecutive blocks.

Where `<|"|>` is an added token (Gemma 4's own tokenizer), a string opens and closes with that
token alone and its text is a lexeme without `<|"|>` in it: llguidance lets an added token
through the mask for its text and then fails to consume it (`lark.marker`), and a lexeme that
ended with the quote's text would run on past a quote of ordinary tokens.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenizer_proc.tool_grammars.lark import (
    bare_text,
    free_text,
    json_value,
    literal,
    marker,
    optional_list,
    spelled,
    think_start,
)
from tokenizer_proc.tool_grammars.schemas import (
    ANNOTATIONS,
    DEFS,
    finite,
    parameters,
    types_of,
    within_lengths,
)

QUOTE = '<|"|>'
_NAME = re.compile(r"[A-Za-z0-9_-]+")  # NOTE: the parser's `[\w-]+`, ASCII
_KEY = re.compile(r"[A-Za-z0-9_]+")  # NOTE: the key quoting's `\w+`, ASCII
_SCALARS = frozenset({"integer", "number", "boolean", "null"})
_TYPES = _SCALARS | {"string", "object", "array"}
# NOTE: the keywords that hold a value of each kind (JSON schema applies each to its own)
_HOLDS = {
    "string": frozenset({"minLength", "maxLength"}),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
    "scalar": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
    | {"multipleOf"},
}
_KNOWN = frozenset().union(*_HOLDS.values()) | {"type", "enum", "const"}
ANY = "g_any"  # NOTE: the rule of an untyped value, written once where used


@dataclass(frozen=True)
class Quote:
    """How strings are quoted: `token`, the id of `<|"|>` where it is one added token (None: it
    is text of ordinary tokens); `never`: texts no string holds besides the quote."""

    token: int | None
    never: tuple[str, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> Quote:
        never = (tokenizer.tool_call_end, *think_start(tokenizer))
        if spelled(tokenizer, (QUOTE,)):
            return cls(None, never)
        return cls(tokenizer.encode(QUOTE, add_special_tokens=False)[0], never)

    def quoted(self, text: str) -> str:
        """`text` between quotes, as Lark."""
        if self.token is None:
            return literal(QUOTE + text + QUOTE)
        return f"<[{self.token}]> {literal(text)} <[{self.token}]>"

    def free(self, rule: str, shortest: int, longest: int | None) -> list[str]:
        """The rules of `rule`, free text between quotes."""
        name = rule.upper()
        if self.token is None:
            # NOTE: the text and its closing quote are one lexeme (a terminal: intersection and
            # negation are lexemes' own), which ends at the first quote
            text = free_text(QUOTE, never=self.never, shortest=shortest, longest=longest)
            return [f"{rule}: {literal(QUOTE)} {name}", f"{name}: {text}"]
        tag = f"<[{self.token}]>"
        text = bare_text((QUOTE, *self.never), shortest, longest)
        return [f"{rule}: {tag} {name} {tag}", f"{name}: {text}"]

    def fits(self, text: str) -> bool:
        """Whether `text`, quoted, is read back as itself."""
        return not any(t in text for t in (QUOTE, *self.never))


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The grammar of one call (or, `parallel`, one or more) to `tools`; None where a tool's
    name or a required parameter cannot be written so that the parser reads it back."""
    writer = Writer(Quote.of(tokenizer))
    names = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        params = parameters(function)
        if not _NAME.fullmatch(function["name"]) or types_of(params) != {"object"}:
            return None
        args = writer.value(f"c{i}_args", params)
        if args is None:
            return None
        writer.rules.append(f"c{i}: {literal('call:' + function['name'])} {args}")
        names.append(f"c{i}")
    start = marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    return "\n".join(
        [
            f"start: call{'+' if parallel else ''}",
            f"call: {start} ({' | '.join(names)}) {end}",
            *writer.rules,
        ]
    )


@dataclass
class Writer:
    """Values in Gemma 4's syntax, each a rule (named after its place) added to `rules`."""

    quote: Quote
    rules: list[str] = field(default_factory=list)
    _any: bool = False  # NOTE: whether the untyped value's rules are written

    def value(self, rule: str, schema: Any) -> str | None:
        """The rule of a value held to `schema` (`rule`, or the untyped value's); None where
        none can be written."""
        if schema is True:
            return self.any()
        if not isinstance(schema, dict):
            return None
        keys = set(schema) - ANNOTATIONS - set(DEFS)
        if keys - _KNOWN:
            return None
        if not keys:
            return self.any()
        if keys & {"enum", "const"}:
            return self._enum(rule, schema, keys)
        kinds = types_of(schema) if "type" in schema else _TYPES
        if not kinds or kinds - _TYPES:
            return None
        writers: dict[str, Callable[[str, dict[str, Any]], str | None]] = {
            "string": self._string,
            "object": self._object,
            "array": self._array,
        }
        alts: list[str | None] = []
        if kinds & _SCALARS:
            alts.append(self._scalar(f"{rule}_n", schema, kinds & _SCALARS))
        alts += [w(f"{rule}_{k[0]}", schema) for k, w in writers.items() if k in kinds]
        written = [alt for alt in alts if alt is not None]
        if len(written) < 2:
            return written[0] if written else None
        self.rules.append(f"{rule}: {' | '.join(written)}")
        return rule

    def any(self) -> str:
        """Any value: a string, a JSON scalar, an array or an object of them."""
        if not self._any:
            self._any = True
            item, pair = f'{ANY} ("," {ANY})*', f'{ANY}_k ("," {ANY}_k)*'
            self.rules += [
                f'{ANY}: {ANY}_s | {ANY}_n | "[" ({item})? "]" | "{{" ({pair})? "}}"',
                f'{ANY}_k: {ANY.upper()}_KEY ":" {ANY}',
                f"{ANY.upper()}_KEY: /[A-Za-z0-9_]+/",
                f"{ANY}_n: {json_value(finite({'type': ['number', 'boolean', 'null']}))}",
                *self.quote.free(f"{ANY}_s", 0, None),
            ]
        return ANY

    def _scalar(self, rule: str, schema: dict[str, Any], kinds: frozenset[str] | set[str]) -> str:
        kind: Any = next(iter(kinds)) if len(kinds) == 1 else sorted(kinds)
        held = {k: v for k, v in schema.items() if k in _HOLDS["scalar"]}
        self.rules.append(f"{rule}: {json_value(finite({'type': kind, **held}))}")
        return rule

    def _string(self, rule: str, schema: dict[str, Any]) -> str:
        self.rules += self.quote.free(rule, schema.get("minLength", 0), schema.get("maxLength"))
        return rule

    def _object(self, rule: str, schema: dict[str, Any]) -> str | None:
        """`{k:v,..}`: the properties in order, an optional one that cannot be written left
        out; None where a required one cannot be."""
        props, required = schema.get("properties", {}), schema.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list):
            return None
        if not set(required) <= set(props):
            return None
        items = []
        for j, (key, sub) in enumerate(props.items()):
            value = self.value(f"{rule}_p{j}", sub) if _KEY.fullmatch(key) else None
            if value is None and key in required:
                return None
            if value is not None:
                items.append((f"{literal(key + ':')} {value}", key in required))
        args, arg_rules = optional_list(f"{rule}_l", items, ",")
        self.rules += [f'{rule}: "{{" {args} "}}"', *arg_rules]
        return rule

    def _array(self, rule: str, schema: dict[str, Any]) -> str | None:
        """`[v,..]` within minItems..maxItems; only `[]` where an item cannot be written."""
        least, most = schema.get("minItems", 0), schema.get("maxItems")
        item = self.value(f"{rule}_i", schema.get("items", True))
        if item is None or most == 0:
            return None if least else self._empty(rule)
        # NOTE: the items after the first: least - 1 .. most - 1 of them
        low, high = max(least - 1, 0), None if most is None else most - 1
        if high == 0:
            items = item
        elif low == 0 and high is None:
            items = f'{item} ("," {item})*'
        else:
            items = f'{item} ("," {item}){{{low},{"" if high is None else high}}}'
        self.rules.append(f'{rule}: "[" {items if least else f"({items})?"} "]"')
        return rule

    def _empty(self, rule: str) -> str:
        self.rules.append(f'{rule}: "[]"')
        return rule

    def _enum(self, rule: str, schema: dict[str, Any], keys: set[str]) -> str | None:
        """One of the enum's values the syntax holds: strings quoted, scalars as JSON."""
        if keys - {"enum", "const", "type"} - _HOLDS["string"]:
            return None
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list):
            return None
        kinds = types_of(schema) if "type" in schema else _TYPES
        alts = []
        for v in values:
            if not _of_kind(v, kinds):
                continue
            if isinstance(v, str):
                if self.quote.fits(v) and within_lengths(v, schema):
                    alts.append(f"({self.quote.quoted(v)})")
            elif v is None or isinstance(v, (bool, int)) or _finite(v):
                alts.append(literal(json.dumps(v)))
        if not alts:
            return None
        self.rules.append(f"{rule}: {' | '.join(alts)}")
        return rule


def _of_kind(value: Any, kinds: frozenset[str] | set[str]) -> bool:
    """Whether an enum's value is of one of the schema's types (JSON's, not Python's)."""
    if isinstance(value, bool):
        return "boolean" in kinds
    if value is None:
        return "null" in kinds
    if isinstance(value, int):
        return bool(kinds & {"integer", "number"})
    if isinstance(value, float):
        return "number" in kinds or ("integer" in kinds and value.is_integer())
    return isinstance(value, str) and "string" in kinds


def _finite(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)
