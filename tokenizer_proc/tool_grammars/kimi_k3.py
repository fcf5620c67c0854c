"""mlx-lm's `kimi_k3` format (Kimi K3's XTML), a turn's calls in one tools section:

    <|open|>tools<|sep|><|open|>call tool="NAME" index="I"<|sep|>
    <|open|>argument key="K" type="string"<|sep|>V<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|>

(here on lines; written without them). mlx-lm infers it from the vocabulary, not the template
(`tokenizer_utils._is_xtml_vocab`: `<|open|>`, `<|sep|>`, `<|close|>` and `<|end_of_msg|>` are
tokens), and the same vocabulary gives the think markers `<|open|>think<|sep|>` ..
`<|close|>think<|sep|>`. Its parser takes each call's body up to the first `<|close|>call<|sep|>`,
the name from its `tool` attribute (attributes are `\\w+="[^"]*"`, `&quot;` and `&amp;`
unescaped) and each argument's value up to the first `<|close|>argument<|sep|>`: a value typed
"string" is kept as it is, any other read as JSON (else kept as text); a body holding a
`<|open|>json ..<|sep|>..<|close|>json<|sep|>` block is read from that block instead.

So a string (a "string" schema held to its lengths at most, or an enum of strings) is raw text
typed "string": any text within its lengths, whitespace kept, without the tags that would end
it, its call or the section early, an `<|open|>json` opening, or the think start (the engine
cuts a thought out of the reply before the calls are read: `reply_split`); an enum's strings
that hold none of those. Every other value (a string with a pattern or format too) is JSON of
its schema, typed by its schema's type ("json" where that is not one type other than "string":
the parser reads any type but "string" as JSON). As in every tagged format here, a string inside a JSON
value may spell out a closing tag, which llguidance's JSON cannot rule out. Names and keys are
attribute values the parser reads back whole; the call's index is a number it ignores.
Parameters are written in their schema's order, each required one present.

The delimiters are the model's added tokens, each named by its id (`<[id]>`: llguidance lets an
added token through the mask for its text, then fails to consume it: `lark.marker`), and a raw
value is a lexeme of text closed by the `<|close|>` token (as `function_gemma.Escape` closes a
string). A tokenizer where a delimiter is not one token takes the generic form: its tags would
be text, a path not written here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.tool_grammars.lark import bare_text, json_value, literal, think_start
from tokenizer_proc.tool_grammars.schemas import (
    finite,
    is_text,
    named_params,
    types_of,
    within_lengths,
)

DELIMITERS = ("<|open|>", "<|sep|>", "<|close|>")
_SPLIT = re.compile("(" + "|".join(re.escape(d) for d in DELIMITERS) + ")")
# NOTE: an attribute's value the parser reads back whole: no `"` to end it, no `&` to unescape
NAME = re.compile(r"[A-Za-z0-9_.:-]+")
# NOTE: where a raw value's text would end something early: its argument, its call, a JSON block
# the parser would read instead (the section's end and the think start come from the tokenizer)
STOPS = ("<|close|>argument<|sep|>", "<|close|>call<|sep|>", "<|open|>json")


def grammar(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """The section of one call (or, `parallel`, one or more) to `tools`; None where a delimiter
    is not one token, or a name or parameter would not be read back."""
    ids = {d: tokenizer.encode(d, add_special_tokens=False) for d in DELIMITERS}
    if not all(len(i) == 1 for i in ids.values()):
        return None
    never = (*STOPS, tokenizer.tool_call_end, *think_start(tokenizer))
    xtml = Xtml({d: i[0] for d, i in ids.items()}, never)
    rules, names = [], []
    for i, tool in enumerate(tools):
        call = xtml.call(f"c{i}", tool["function"])
        if call is None:
            return None
        rules += call
        names.append(f"c{i}")
    start, end = xtml.tags(tokenizer.tool_call_start), xtml.tags(tokenizer.tool_call_end)
    return "\n".join(
        [
            f"start: {start} call{'+' if parallel else ''} {end}",
            f"call: {' | '.join(names)}",
            "INDEX: /[0-9]{1,3}/",
            *rules,
        ]
    )


@dataclass(frozen=True)
class Xtml:
    """XTML tags over the delimiters' token ids; `never`: texts no raw value holds."""

    ids: dict[str, int]
    never: tuple[str, ...]

    def tags(self, text: str) -> str:
        """`text` as Lark, each delimiter in it by its token's id."""
        pieces = [p for p in _SPLIT.split(text) if p]
        return " ".join(f"<[{self.ids[p]}]>" if p in self.ids else literal(p) for p in pieces)

    def call(self, rule: str, function: dict[str, Any]) -> list[str] | None:
        """The rules of one tool's call; None where its name or a parameter cannot be written."""
        params = named_params(function)
        if params is None or not NAME.fullmatch(function["name"]):
            return None
        items, rules = [], []
        close = self.tags("<|close|>argument<|sep|>")
        for j, param in enumerate(params):
            name = f"{rule}_p{j}"
            value = self.value(f"{name}_v", param.schema)
            if value is None or not NAME.fullmatch(param.name):
                return None
            kind, value_rules = value
            head = self.tags(f'<|open|>argument key="{param.name}" type="{kind}"<|sep|>')
            rules += [f"{name}: {head} {name}_v {close}", *value_rules]
            items.append(name + ("" if param.required else "?"))
        head = self.tags(f'<|open|>call tool="{function["name"]}" index="')
        body = " ".join([head, "INDEX", self.tags('"<|sep|>'), *items])
        return [f"{rule}: {body} {self.tags('<|close|>call<|sep|>')}", *rules]

    def value(self, rule: str, schema: Any) -> tuple[str, list[str]] | None:
        """A value's type attribute and the rules of `rule`, the value as the parser reads it
        back for `schema`."""
        if not isinstance(schema, dict):
            return None
        if is_text(schema):
            text = self._text(rule, schema)
            return None if text is None else ("string", text)
        return _json_type(schema), [f"{rule}: {json_value(finite(schema))}"]

    def _text(self, rule: str, schema: dict[str, Any]) -> list[str] | None:
        """Raw text: one of its enum's strings, or free text within its lengths."""
        if "enum" in schema or "const" in schema:
            values = schema["enum"] if "enum" in schema else [schema["const"]]
            texts = [v for v in values if isinstance(v, str) and self._fits(v, schema)]
            return [f"{rule}: {' | '.join(literal(v) for v in texts)}"] if texts else None
        lengths = schema.get("minLength", 0), schema.get("maxLength")
        # NOTE: a lexeme (a terminal: negation is a lexeme's own) closed by the `<|close|>`
        # token, which is no text it could run on into
        return [f"{rule}: {rule.upper()}", f"{rule.upper()}: {bare_text(self.never, *lengths)}"]

    def _fits(self, text: str, schema: dict[str, Any]) -> bool:
        """Whether `text`, written raw, is read back as itself within the schema's lengths."""
        return not any(t in text for t in self.never) and within_lengths(text, schema)


def _json_type(schema: dict[str, Any]) -> str:
    """The type attribute of a JSON value: its schema's one type, "json" where it has none or
    several, or "string" (which the parser would keep as text)."""
    kinds = types_of(schema)
    return next(iter(kinds)) if len(kinds) == 1 and kinds != {"string"} else "json"
