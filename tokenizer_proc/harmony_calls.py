"""Forced tool calls in gpt-oss's harmony format, read back by `harmony.HarmonyStream`. After the
generation prompt `<|start|>assistant`, an optional thought, then one call (one text, broken
into lines here for reading):

    <|channel|>analysis<|message|>THOUGHT<|end|><|start|>assistant
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>

The parser reads a message on the analysis channel as reasoning, its body up to the first marker
that ends a body (`harmony.BODY_ENDS`), and a message whose header names the recipient
`functions.NAME` (NAME: the text up to whitespace or `<`) as a call to NAME, its body stripped
as the arguments. So the grammar allows an optional analysis message whose thought holds none of
those markers, then exactly one call: NAME one of the chosen tools', ARGS a JSON object held to
that tool's parameters. `<|call|>` is a stop token: a reply holds one call, parallel calls or
not.

The recipient follows the channel, as gpt-oss writes a call (OpenAI's harmony guide); its chat
template writes a past call with the recipient after the role (`<|start|>assistant
to=functions.NAME<|channel|>commentary json<|message|>`), which the parser reads too. NOTE: so a
reply starts with `<|channel|>`, which the parser reads the same whether the prompt stopped after
the role (gpt-oss's template) or opened the analysis message itself (tests/harmony_model.py's):
written after the role, ` to=functions.NAME` would there be text of the thought.

The markers are special added tokens, each matched by its one token's id too (`lark.marker`:
llguidance takes a special token by id only); the thought is one lexeme closed by `<|end|>`'s
token alone (`lark.bare_text`). llguidance's mask lets no special token into a text lexeme or a
JSON string, so the thought holds no marker's token, and the lexeme none of the body's end
markers spelled in ordinary tokens either. A JSON string that
spelled one would end the arguments early; the grammar leaves that to the model, as every JSON
format here does (JSON strings are llguidance's own lexemes). A tokenizer whose markers are not
one token each, a name the parser would not read back whole, or a header longer than the
parser reads (`harmony.HEADER_LIMIT`) takes the generic form.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizer_proc.harmony import (
    BODY_ENDS,
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FUNCTIONS,
    HEADER_LIMIT,
    MESSAGE,
    START,
)
from tokenizer_proc.tool_grammars.lark import bare_text, json_value, literal, marker
from tokenizer_proc.tool_grammars.schemas import finite, parameters

MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL)
# NOTE: the recipient the parser reads is `to=` and then no whitespace or `<`
NAME = re.compile(r"[^\s<]+")


def call_header(name: str) -> str:
    """A call's header, from its channel to `<|message|>` (after the role)."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def grammar(tokenizer: Any, tools: list[dict[str, Any]]) -> str | None:
    """An optional thought, then one call to one of `tools`; None where a marker is not one
    token or a tool's name would not be read back."""
    ids = _marker_ids(tokenizer)
    if ids is None or not all(_readable(t["function"]["name"]) for t in tools):
        return None
    mark = {text: marker(text, [i]) for text, i in ids.items()}
    names, rules = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = literal(f"commentary to={FUNCTIONS}{function['name']} ")
        rules.append(f"c{i}: {head} {mark[CONSTRAIN]} {literal('json')} {mark[MESSAGE]} c{i}_args")
        rules.append(f"c{i}_args: {json_value(finite(parameters(function)))}")
        names.append(f"c{i}")
    think = f"{mark[CHANNEL]} {literal('analysis')} {mark[MESSAGE]}"
    return "\n".join(
        [
            "start: thought? call",
            # NOTE: the thought's lexeme ends at `<|end|>`'s token alone: its text would be
            # more of the lexeme (`lark.bare_text`)
            f"thought: {think} THOUGHT <[{ids[END]}]> {mark[START]} {literal('assistant')}",
            f"THOUGHT: {bare_text(BODY_ENDS)}",
            f"call: {mark[CHANNEL]} ({' | '.join(names)}) {mark[CALL]}",
            *rules,
        ]
    )


def _marker_ids(tokenizer: Any) -> dict[str, int] | None:
    """Each marker's one token (None: a marker is not one token of this tokenizer)."""
    ids = {}
    for text in MARKERS:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids[text] = encoded[0]
    return ids


def _readable(name: str) -> bool:
    """Whether the parser reads `name` back whole from a call's header, after the role's
    `<|start|>assistant` (a header past `HEADER_LIMIT` is text)."""
    header = START + "assistant" + call_header(name).removesuffix(MESSAGE)
    return bool(NAME.fullmatch(name)) and len(header) <= HEADER_LIMIT
