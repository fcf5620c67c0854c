"""`tool_choice` `required` and a named function: the model's tool-call syntax, with each call's
arguments held to its tool's JSON schema, as one Lark grammar for the scheduler's token masks.

Only tool-call formats written here can be forced: mlx-lm's `json_tools` (`<tool_call>` JSON
`</tool_call>`, the Hermes / Qwen 2.5 family and the test models). Any other format is a 400 that
names it; `auto` and `none` work with every format.
"""

from __future__ import annotations

import json
from typing import Any

from engine.constraints import FIELDS, JSON_STYLE
from engine.errors import InvalidRequest
from tokenizer_proc import prepare


def normalize(choice: Any, field: str = "tool_choice") -> str | tuple[str, str]:
    """OpenAI's forms (`auto`, `none`, `required`, `{"type": "function", "function": {"name"}}`),
    the Responses API's (`{"type": "function", "name"}`) and Anthropic's (`{"type": "auto" |
    "any" | "none" | "tool", "name"}`) as "auto", "none", "required" or ("function", name)."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("auto", "none"):
            return str(kind)
        if kind == "any":
            return "required"
        name = choice.get("name")
        if kind == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
        if kind in ("function", "tool") and isinstance(name, str) and name:
            return ("function", name)
    raise InvalidRequest(field, f"must be auto, none, required or a named function, got {choice!r}")


def force(msg: Any, tokenizer: Any) -> None:
    """A request whose tool_choice forces a call gets the grammar of that call (as `grammar`)."""
    choice = normalize(msg.tool_choice)
    if msg.tools is not None:
        prepare.check_tools(msg.tools)
    lark = grammar(tokenizer, msg.tools, choice, msg.parallel_tool_calls)
    if lark is None:
        return
    if any(name in msg.params for name in FIELDS):
        raise InvalidRequest(
            "tool_choice",
            "a forced tool call cannot be combined with json_schema, regex or grammar",
        )
    msg.params = {**msg.params, "grammar": lark}


def wire(choice: str | tuple[str, str]) -> str | dict[str, Any] | None:
    """A normalized choice as the wire's `Generate.tool_choice` (None: nothing forced)."""
    if isinstance(choice, tuple):
        return {"type": "function", "function": {"name": choice[1]}}
    return choice if choice == "required" else None


def grammar(
    tokenizer: Any,
    tools: list[dict[str, Any]] | None,
    choice: str | tuple[str, str],
    parallel: bool,
) -> str | None:
    """The Lark grammar forcing a tool call (None for `auto` / `none`)."""
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice", f"{_says(choice)} needs tools")
    _check_format(tokenizer, choice)
    if isinstance(choice, tuple):
        tools = [t for t in tools if t["function"]["name"] == choice[1]]
        if not tools:
            raise InvalidRequest("tool_choice", f"no tool named {choice[1]!r} in tools")
    calls = [_call_schema(t["function"]) for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    call = {**call, "x-guidance": JSON_STYLE}
    start = _marker(tokenizer.tool_call_start, tokenizer.tool_call_start_tokens)
    end = _marker(tokenizer.tool_call_end, tokenizer.tool_call_end_tokens)
    # NOTE: the template's own layout may put a newline on either side of the JSON
    return "\n".join(
        [
            f"start: call{'+' if parallel else ''}",
            f'call: {start} "\\n"? arguments "\\n"? {end} "\\n"?',
            f"arguments: %json {json.dumps(call)}",
        ]
    )


def _marker(text: str, ids: tuple[int, ...] | None) -> str:
    """A tool-call marker: its text, or its one token by id.

    NOTE: llguidance takes an added token as special: its mask lets the token through for the
    marker's text, but consuming it then fails ("forced bytes: got '<'"), so the token is also
    named by id (`<[id]>`)."""
    literal = json.dumps(text)
    return f"({literal} | <[{ids[0]}]>)" if ids and len(ids) == 1 else literal


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters") or {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidRequest("tools", f"{function['name']}: parameters must be a JSON schema")
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _check_format(tokenizer: Any, choice: str | tuple[str, str]) -> None:
    parser = getattr(tokenizer, "tool_parser", None)
    kind = getattr(parser, "__module__", "").rsplit(".", 1)[-1] if parser else None
    if kind != "json_tools":
        found = f"its tool-call format is {kind}" if kind else "it has no tool-call format"
        raise InvalidRequest(
            "tool_choice",
            f"{_says(choice)} is supported for models with mlx-lm's json_tools format; {found}",
        )


def _says(choice: str | tuple[str, str]) -> str:
    return f"a named function ({choice[1]})" if isinstance(choice, tuple) else repr(choice)
