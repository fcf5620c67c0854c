"""Turn a client's `Generate` into prompt token ids, or an `InvalidRequest` naming the field
(its sampling keywords: `SamplingParams.parse`). Pure functions of the request and the tokenizer:
no sockets, no state."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from engine.errors import InvalidRequest
from engine.messages.to_tokenizer import Generate
from engine.prompt_check import check_prompt
from tokenizer_proc.tool_choice import check_tools, generic_form

SOURCES = ("prompt", "messages", "input_ids")


def source_of(req: Generate) -> str:
    """Which of prompt / messages / input_ids the request uses (exactly one is allowed)."""
    given = [name for name in SOURCES if getattr(req, name) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "prompt", f"give exactly one of prompt, messages, input_ids (got {given})"
        )
    return given[0]


def converted_tools(
    tools: Any, convert: Callable[[int, Any], dict[str, Any]]
) -> list[dict[str, Any]] | None:
    """An API's `tools` as the template's function tools, `convert(j, tool)` each (raising
    `InvalidRequest` for `tools[j]`); None when absent."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools", "must be a list")
    out = [convert(j, t) for j, t in enumerate(tools)]
    check_tools(out)
    return out


# NOTE: `shared_prefix`'s signature: (messages, tokenizer, tools, template kwargs, ids) -> count
SharedCount = Callable[[list[dict[str, Any]], Any, Any, dict[str, Any], list[int]], int]


class Prompt(NamedTuple):
    ids: list[int]
    shared: int = 0  # NOTE: its first tokens other conversations share (`shared_prefix`)


def token_ids(
    req: Generate, tokenizer: Any, vocab_size: int, max_context: int, generation_prompt: bool = True
) -> list[int]:
    """`generation_prompt`: a chat's template ends with the assistant's turn opened (for
    `/tokenize`, optional)."""
    return prompt(req, tokenizer, vocab_size, max_context, generation_prompt).ids


def prompt(
    req: Generate,
    tokenizer: Any,
    vocab_size: int,
    max_context: int,
    generation_prompt: bool = True,
    shared: SharedCount | None = None,
) -> Prompt:
    """The request's prompt tokens; with `shared` (`shared_prefix`, or one that keeps its
    answers: `shared_heads.SharedHeads`), how many of them a chat shares with other
    conversations."""
    source = source_of(req)
    if req.tools is not None:
        check_tools(req.tools)
        if source != "messages":
            raise InvalidRequest("tools", "tools need messages (a chat)")
    # NOTE: source_of() made sure exactly one of the three is given.
    if req.chat_template_kwargs is not None and source != "messages":
        raise InvalidRequest("chat_template_kwargs", "needs messages (a chat)")
    if req.messages is not None:
        extra = template_kwargs(req.chat_template_kwargs)
        messages, tools = req.messages, req.tools
        if tools and _told(req, tokenizer):
            messages, tools = tools_told(messages, tools), None
        ids = _from_messages(messages, tokenizer, tools, generation_prompt, extra)
        if shared is not None:
            head = shared(messages, tokenizer, tools, extra, ids)
            return Prompt(check_prompt(ids, vocab_size, max_context, source), head)
    elif req.prompt is not None:
        ids = _from_prompt(req.prompt, tokenizer)
    else:
        ids = list(req.input_ids or [])
        # NOTE: a bool is an int to Python, not to the scheduler's typed decoder.
        if any(type(t) is not int for t in ids):
            raise InvalidRequest("input_ids", "must be a list of integer token ids")
    return Prompt(check_prompt(ids, vocab_size, max_context, source))


# NOTE: the roles whose messages lead a chat and stay the same across its conversations
LEADING_ROLES = frozenset({"system", "developer"})


def shared_prefix(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    tools: list[dict[str, Any]] | None,
    template: dict[str, Any],
    ids: list[int],
) -> int:
    """How many of a chat's prompt tokens `ids` its leading system messages (and the tools)
    are, as the template writes them alone: what other conversations under the same system
    prompt share. 0 when no such message leads other messages, or the template writes them
    otherwise alone (a date, the last message's role): then nothing is known.

    NOTE: a model that hits only at slot snapshots (window rings, recurrent state) snapshots
    there, so the next conversation hits there (`KVManager._snap_point`)."""
    lead = leading(messages)
    if lead == 0 or lead == len(messages):
        return 0
    try:
        head = _from_messages(messages[:lead], tokenizer, tools, False, template)
    except InvalidRequest:
        return 0  # NOTE: a template that will not write system messages alone
    n = len(head)
    return n if 0 < n < len(ids) - 1 and ids[:n] == head else 0


def leading(messages: list[dict[str, Any]]) -> int:
    """How many system (or developer) messages lead the chat."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in LEADING_ROLES:
        lead += 1
    return lead


def _renders_tools(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "has_tool_calling", False))


def _told(req: Generate, tokenizer: Any) -> bool:
    """Whether the tools go into the system message (`tools_told`) rather than the template: a
    model without a tool-call format (mlx-lm's parser) whose call is forced in the generic form
    (the form must be told), or whose template has no `tools` at all."""
    if _renders_tools(tokenizer):
        return False
    return generic_form(req, tokenizer) or not takes_tools(tokenizer)


def takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the request's `tools` (Llama 3.x's does, with no format
    mlx-lm parses: its calls are read as bare JSON, `tool_calls.BareJsonCalls`)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


# NOTE: the engine's words to a model whose template cannot show tools (under `auto`, and when
# a call is forced: the grammar then holds the reply to this form whatever the model makes of it)
TOOLS_TOLD = (
    "You can call these tools (JSON specs):\n{specs}\n"
    'To call tools, reply with only a JSON array of calls, each {{"name": ..., "parameters": '
    "{{...}}}}."
)


def tools_told(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat with the tools described in its system message (one is added first when it
    has none), for a model whose template has no tools or no tool-call format (`_told`)."""
    specs = "\n".join(json.dumps(t["function"]) for t in tools)
    note = TOOLS_TOLD.format(specs=specs)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _from_prompt(prompt: str, tokenizer: Any) -> list[int]:
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    # NOTE: as mlx-lm's generate does: no second BOS when the text already starts with one.
    bos = getattr(tokenizer, "bos_token", None)
    special = bos is None or not prompt.startswith(bos)
    return list(tokenizer.encode(prompt, add_special_tokens=special))


# NOTE: what the template call itself sets; a client's kwargs may not replace them
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict"}
)


def template_kwargs(kwargs: Any) -> dict[str, Any]:
    """A request's `chat_template_kwargs`: a JSON object of the template's own variables."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequest("chat_template_kwargs", "must be an object of template variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequest("chat_template_kwargs", f"may not set {', '.join(reserved)}")
    return dict(kwargs)


def _from_messages(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    tools: list[dict[str, Any]] | None,
    generation_prompt: bool = True,
    template: dict[str, Any] | None = None,
) -> list[int]:
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise InvalidRequest(f"messages[{i}].{key}", "must be a string")
    # NOTE: a template may write tools with no format mlx-lm parses (harmony's, Llama 3.x's):
    # the engine parses those calls itself (tokenizer_proc/harmony.py, tool_calls.BareJsonCalls)
    if tools and not (_renders_tools(tokenizer) or takes_tools(tokenizer)):
        raise InvalidRequest("tools", "this model's chat template has no tool calling")
    extra = {**(template or {}), **({"tools": tools} if tools else {})}
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, **extra
        )
    except Exception as e:  # NOTE: a template raises anything (jinja errors included)
        raise InvalidRequest("messages", f"chat template failed: {e}") from None
    return list(ids)
