"""`tool_choice` `required` and a named function: a forced call, each call's arguments held to
its tool's JSON schema, as one Lark grammar for the scheduler's token masks.

A model whose tool-call format has a grammar in `tool_grammars` (every format mlx-lm parses:
`tool_grammars.BUILDERS`) is forced into its own syntax, parsed back by its own parser; a chat with a model that speaks gpt-oss's harmony format is forced into harmony's call
(`harmony_calls`), parsed back by channel (`harmony.HarmonyStream`). Any other model, with
another format or none, or tools its format cannot carry (a name or schema it would not read
back), is forced into a generic form the engine parses itself, as vLLM does: a JSON array of
`{"name", "parameters"}` (`tool_calls.JsonCalls`); a model whose template cannot render tools is
told of them in a system message (`prepare.tools_told`). `auto` and `none` keep the model's own
format.
"""

from __future__ import annotations

import json
from typing import Any

from engine.constraints import FIELDS, JSON_STYLE
from engine.errors import InvalidRequest
from tokenizer_proc import harmony, harmony_calls, tool_grammars
from tokenizer_proc.tool_grammars.schemas import call_schema


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
    chat = msg.messages is not None
    lark = grammar(tokenizer, msg.tools, choice, msg.parallel_tool_calls, chat)
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
    chat: bool = True,
) -> str | None:
    """The Lark grammar forcing a tool call (None for `auto` / `none`): in the model's own
    syntax where it can be (`_native`), else the generic form; `chat`: the request is a chat
    (messages, not a prompt or token ids)."""
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice", f"{_says(choice)} needs tools")
    chosen = _chosen(tools, choice)
    if not chosen:
        raise InvalidRequest("tool_choice", f"no tool named {choice[1]!r} in tools")
    return _native(tokenizer, chosen, parallel, chat) or _generic(chosen, parallel)


def _native(tokenizer: Any, tools: list[dict[str, Any]], parallel: bool, chat: bool) -> str | None:
    """A forced call in the model's own syntax (None: there is none for it or these tools):
    harmony's for a chat with a model that speaks it, else its format's (`tool_grammars`).

    NOTE: a chat only: only a chat's reply is parsed by channel (`reply_split.for_sdk` splits
    no prompt's), and the grammar starts after the template's generation prompt."""
    if chat and harmony.speaks(tokenizer):
        return harmony_calls.grammar(tokenizer, tools)
    return tool_grammars.native(tokenizer, tools, parallel)


def _chosen(tools: list[dict[str, Any]], choice: str | tuple[str, str]) -> list[dict[str, Any]]:
    """The tools a call may be to: all, or the named one (none: no tool has its name)."""
    if isinstance(choice, tuple):
        return [t for t in tools if t["function"]["name"] == choice[1]]
    return tools


def forced(msg: Any) -> bool:
    """Whether a request forces a tool call (`required` or a named function)."""
    return msg.tool_choice is not None and normalize(msg.tool_choice) not in ("auto", "none")


def generic_form(msg: Any, tokenizer: Any) -> bool:
    """Whether a request's forced call takes the generic JSON form (`_generic`): the same
    choice as `grammar`'s, so its replies are parsed by the parser of the form it was held to."""
    if not (msg.tools and forced(msg)):
        return False
    chosen = _chosen(msg.tools, normalize(msg.tool_choice))
    chat = msg.messages is not None
    return _native(tokenizer, chosen, msg.parallel_tool_calls, chat) is None


def _generic(tools: list[dict[str, Any]], parallel: bool) -> str:
    """The generic form: a JSON array of calls `{"name", "parameters"}`, one at least (exactly
    one without parallel calls), each held to its tool's schema."""
    calls = [call_schema(t["function"], "parameters") for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": item, "minItems": 1, "x-guidance": JSON_STYLE}
    if not parallel:
        array["maxItems"] = 1
    return f"start: calls\ncalls: %json {json.dumps(array)}"


def _says(choice: str | tuple[str, str]) -> str:
    return f"a named function ({choice[1]})" if isinstance(choice, tuple) else repr(choice)
