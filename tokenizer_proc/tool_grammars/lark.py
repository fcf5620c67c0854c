"""Pieces of llguidance's Lark shared by the forced-call grammars: literals, markers, regex
text, JSON values and a list of parameters where some may be left out."""

from __future__ import annotations

import json
import re
from typing import Any

from engine.constraints import JSON_STYLE


def literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes, which llguidance reads)."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, ids: tuple[int, ...] | list[int] | None) -> str:
    """A marker: its text, or its one token by id.

    NOTE: llguidance takes an added token as special: its mask lets the token through for the
    marker's text, but consuming it then fails ("forced bytes: got '<'"), so the token is also
    named by id (`<[id]>`)."""
    return f"({literal(text)} | <[{ids[0]}]>)" if ids and len(ids) == 1 else literal(text)


def marker_of(tokenizer: Any, text: str) -> str:
    """A marker of the tokenizer's other than its tool-call start and end (whose ids it keeps)."""
    encode = getattr(tokenizer, "encode", None)
    ids = encode(text, add_special_tokens=False) if encode is not None else None
    return marker(text, ids)


def spelled(tokenizer: Any, texts: tuple[str, ...]) -> bool:
    """Whether each text is ordinary text to the tokenizer (more than one token).

    NOTE: a format's tags inside a raw value's lexeme (its closing tag) or between them must be:
    llguidance's mask lets an added token through for its text, and consuming it then fails
    (`marker`), which would end a forced call in an error. A model whose tags are added tokens
    takes the generic form until that path is written and tested."""
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        return False
    return all(len(encode(text, add_special_tokens=False)) > 1 for text in texts)


def think_start(tokenizer: Any) -> tuple[str, ...]:
    """The model's think start, where it has one: the engine cuts the text after it out of the
    reply as a thought (`reasoning.ReasoningStream`), so no raw value may spell it."""
    if not getattr(tokenizer, "has_thinking", False):
        return ()
    start = getattr(tokenizer, "think_start", None)
    return (start,) if isinstance(start, str) and start else ()


def regex_text(text: str) -> str:
    """`text` matched literally inside a Lark `/regex/`.

    NOTE: every ASCII character but letters and digits as `\\x{..}`: no escape rule of the
    regex dialect (or the `/` that ends the literal) to get wrong."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):x}}}" for c in text)


def free_text(
    close: str,
    cut: str | None = None,
    never: tuple[str, ...] = (),
    trimmed: bool = False,
    not_null: bool = False,
    shortest: int = 0,
    longest: int | None = None,
) -> str:
    """A raw text value and the `close` tag after it, as one lexeme: the text its parser cuts
    the value at (`cut`, the tag itself by default) only at its end, no `never` text inside,
    `trimmed`: no whitespace at either end (a parser that strips it would change it),
    `not_null`: not "null" in any case (a parser's None), within `shortest`..`longest`.

    NOTE: one lexeme, the closing tag included: a lexeme is matched as long as it can be, so
    text followed by a literal closing tag would run on past it; ending at the first closing
    tag it stops there. Intersection and negation (llguidance's `&` and `~`) are lexemes' own.
    Trimmed, the lengths are inside the one regex: intersected with another, a `maxLength` of
    100 made llguidance's lexer give up ("too many expressions constructed") at the value's
    first mask, which ended the forced call there."""
    tag = regex_text(close)
    lengths = _lengths(shortest, longest, tag)
    body: str | None = _ANYTHING
    if trimmed:
        body, lengths = trimmed_regex(_EDGE, _EDGE, shortest, longest), []
    if body is None:
        body = "(?!)"  # NOTE: the lengths leave no text: a value never taken
    parts = [f"/{body}{tag}/", f"~/{_ANYTHING}{regex_text(cut or close)}(?s:.+)/", *_absent(never)]
    if not_null:
        parts.append(f"~/(?i:null){tag}/")
    return " & ".join([*parts, *lengths])


# NOTE: a character a parser's strip() keeps: Python strips the ASCII separators \x1c-\x1f too,
# which the regex `\S` keeps
_EDGE = "[^\\s\\x{1c}-\\x{1f}]"


def trimmed_regex(first: str, edge: str, shortest: int, longest: int | None) -> str | None:
    """A regex of text opening with a `first` character and ending with an `edge` one (one
    character: both the same), within `shortest`..`longest` characters; None where the lengths
    leave none (nothing: the empty text only)."""
    low, high = int(shortest), None if longest is None else int(longest)
    alts = []
    if low <= 1 and (high is None or high >= 1):
        alts.append(first)
    if high is None or high >= 2:
        most = "" if high is None else high - 2
        inner = "*" if high is None and low <= 2 else f"{{{max(low - 2, 0)},{most}}}"
        alts.append(f"{first}(?s:.{inner}){edge}")
    if not alts:
        return None if low else ""
    return f"(?:{'|'.join(alts)}){'?' if low == 0 else ''}"


def bare_text(never: tuple[str, ...] = (), shortest: int = 0, longest: int | None = None) -> str:
    """Text with none of `never` inside, within `shortest`..`longest`, as one lexeme with no
    closing tag: for a value closed by an added token, which is no text the lexeme could run
    on into (`free_text` otherwise)."""
    return " & ".join([f"/{_ANYTHING}/", *_absent(never), *_lengths(shortest, longest, "")])


_ANYTHING = "(?s:.*)"


def _absent(texts: tuple[str, ...]) -> list[str]:
    return [f"~/{_ANYTHING}{regex_text(text)}{_ANYTHING}/" for text in texts]


def _lengths(shortest: int, longest: int | None, tag: str) -> list[str]:
    if not shortest and longest is None:
        return []
    return [f"/(?s:.{{{int(shortest)},{'' if longest is None else int(longest)}}}){tag}/"]


def json_value(schema: dict[str, Any]) -> str:
    """A JSON value held to `schema`, in the engine's JSON style (`constraints.JSON_STYLE`)."""
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"


def optional_list(name: str, items: list[tuple[str, bool]], sep: str) -> tuple[str, list[str]]:
    """The expression (and its rules, named `name_*`) of `items` in order, `(expression,
    required)` each, a required one always written, an optional one maybe left out, `sep`
    between two written ones ("" and no rules for no items). Two rules per item: where nothing
    is written yet, and after one.

    NOTE: rules, not one inline expression: each optional item forks the rest in two, so an
    inline one doubles with each optional item."""
    if not items:
        return "", []
    n = len(items)
    sep_lit = literal(sep)

    def first(i: int) -> str:
        return f"{name}_f{i}" if i < n else ""

    def after(i: int) -> str:
        return f"{name}_a{i}" if i < n else ""

    bodies: dict[str, str] = {}
    for i, (item, required) in enumerate(items):
        head, tail = f"{item} {after(i + 1)}".strip(), f"{sep_lit} {item} {after(i + 1)}".strip()
        if required:
            bodies[first(i)], bodies[after(i)] = head, tail
        else:
            bodies[first(i)] = _or_skip(head, first(i + 1))
            bodies[after(i)] = _or_skip(tail, after(i + 1))
    return first(0), [f"{rule}: {bodies[rule]}" for rule in _reachable(first(0), bodies)]


def _reachable(root: str, bodies: dict[str, str]) -> list[str]:
    """The rules `root` uses, itself included (a required item leaves some unused)."""
    seen, todo = [root], [root]
    while todo:
        for word in re.findall(r"\w+", bodies[todo.pop()]):
            if word in bodies and word not in seen:
                seen.append(word)
                todo.append(word)
    return seen


def _or_skip(written: str, skipped: str) -> str:
    return f"({written}) | {skipped}" if skipped else f"({written})?"
