"""`tool_choice` `required` and a named function: a forced call, each call's arguments held to
its tool's JSON schema, as one Lark grammar for the scheduler's token masks.

A model with mlx-lm's `json_tools` format (`<tool_call>` JSON `</tool_call>`, the Hermes / Qwen
2.5 family and the test models) is forced into its own syntax. Any other model, with another
format or none, is forced into a generic form the engine parses itself, as vLLM does: a JSON
array of `{"name", "parameters"}` (`tool_calls.JsonCalls`); a model whose template cannot render
tools is told of them in a system message (`prepare.tools_told`). `auto` and `none` keep the
model's own format.
"""

from __future__ import annotations

import json
from typing import Any

from engine.constraints import FIELDS, JSON_STYLE
from engine.errors import InvalidRequest


def check_tools(tools: Any) -> None:
    """OpenAI-style tool specs, as the HTTP API and the SDK take them."""
    if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
        raise InvalidRequest("tools", "must be a list of {type: function, function: {name, ...}}")


def _is_tool(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


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
        check_tools(msg.tools)
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
    if isinstance(choice, tuple):
        tools = [t for t in tools if t["function"]["name"] == choice[1]]
        if not tools:
            raise InvalidRequest("tool_choice", f"no tool named {choice[1]!r} in tools")
    if not own_format(tokenizer):
        return _generic(tools, parallel)
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
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def own_format(tokenizer: Any) -> bool:
    """Whether a forced call takes the model's own syntax (mlx-lm's `json_tools`, written
    here), not the generic JSON form."""
    parser = getattr(tokenizer, "tool_parser", None) if _has_tools(tokenizer) else None
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] == "json_tools"


def _has_tools(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


def forced(msg: Any) -> bool:
    """Whether a request forces a tool call (`required` or a named function)."""
    return msg.tool_choice is not None and normalize(msg.tool_choice) not in ("auto", "none")


def generic_form(msg: Any, tokenizer: Any) -> bool:
    """Whether a request's forced call takes the generic JSON form (`_generic`)."""
    return bool(msg.tools) and forced(msg) and not own_format(tokenizer)


def _generic(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The generic form: a JSON array of calls `{"name", "parameters"}`, one at least (exactly
    one without parallel calls), each held to its tool's schema."""
    calls = [_generic_call(t["function"]) for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": item, "minItems": 1, "x-guidance": JSON_STYLE}
    if not parallel:
        array["maxItems"] = 1
    return f"start: calls\ncalls: %json {json.dumps(array)}"


def _generic_call(function: dict[str, Any]) -> dict[str, Any]:
    call = _call_schema(function)
    properties = {"name": call["properties"]["name"], "parameters": _parameters(function)}
    return {**call, "properties": properties, "required": ["name", "parameters"]}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters") or {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidRequest("tools", f"{function['name']}: parameters must be a JSON schema")
    return params


def _says(choice: str | tuple[str, str]) -> str:
    return f"a named function ({choice[1]})" if isinstance(choice, tuple) else repr(choice)
