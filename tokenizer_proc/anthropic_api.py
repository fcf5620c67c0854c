"""Anthropic's Messages API shapes, free of I/O: a `/v1/messages` body becomes a `Generate` (or an
`InvalidRequest` naming the field), engine chunks become a message object or its stream events.

Coding agents (Claude Code and others) speak this API to local models. Messages map onto the chat
template as OpenAI's do: `system` is the first message, a `tool_use` block is an assistant tool
call, a `tool_result` block a `tool` message after its turn. Every field a request may carry is
listed here; any other field, or a value the engine cannot honour, is a 400 naming it
(docs/http_api.md).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from tokenizer_proc import prepare, tool_choice

# accepted fields that change nothing here: identity, routing and tiering hints, and cache
# breakpoints (the prefix cache keeps every prefix it can without being asked)
IGNORED = (
    "model",
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "diagnostics",
    "user_profile_id",
    "workspace_id",
)
FIELDS = {
    *IGNORED,
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "ignore_eos",  # NOTE: the engine's own, as on the OpenAI routes (fixed-length benchmarks)
    "stream",
    "tools",
    "tool_choice",
    "thinking",
}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
MAX_STOP_SEQUENCES = 16
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


@dataclass
class Request:
    """One parsed Messages request."""

    generate: tt.Generate
    model: str
    stream: bool = False


def parse(body: Any, rid: str, model: str) -> Request:
    """A `POST /v1/messages` body."""
    body = _object(body)
    _check_fields(body, FIELDS)
    sampling = ("temperature", "top_p", "top_k", "ignore_eos")
    params: dict[str, Any] = {k: body[k] for k in sampling if k in body}
    if "max_tokens" not in body:
        raise InvalidRequest("max_tokens", "is required")
    params["max_tokens"] = body["max_tokens"]
    params["stop"] = _stop_sequences(body.get("stop_sequences", []))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", "must be a boolean")
    budget = _budget(body.get("thinking"), params["max_tokens"])
    if budget is not None:
        params["think_budget"] = budget
    gen = tt.Generate(rid, params=params)
    gen.messages, gen.tools = conversation(body)
    gen.chat_template_kwargs = thinking_kwargs(body)
    choice = body.get("tool_choice")
    gen.tool_choice = tool_choice.wire(tool_choice.normalize(choice))
    # NOTE: Anthropic says it the other way round, inside tool_choice
    gen.parallel_tool_calls = not (
        isinstance(choice, dict) and choice.get("disable_parallel_tool_use")
    )
    return Request(gen, str(body.get("model") or model), stream)


def parse_count(body: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A `POST /v1/messages/count_tokens` body: (template messages, tools)."""
    body = _object(body)
    _check_fields(body, COUNT_FIELDS)
    return conversation(body)


def conversation(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The chat template's messages and tools from `system`, `messages`, `tools`, `tool_choice`."""
    _thinking(body.get("thinking"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list")
    out = _system(body.get("system"))
    for i, m in enumerate(messages):
        out += _message(i, m)
    tools = _tools(body.get("tools"))
    offered = tool_choice.normalize(body.get("tool_choice")) != "none"
    return out, tools if tools and offered else None


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}  # NOTE: clients send explicit nulls


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise InvalidRequest(name, "is not supported by this server")


def _stop_sequences(stop: Any) -> list[str]:
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("stop_sequences", "must be a list of non-empty strings")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(
            "stop_sequences", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stop)}"
        )
    return stop


def _thinking(thinking: Any) -> None:
    """`{type: disabled}` or `{type: enabled, budget_tokens}` (a thinking model's thought comes
    back as `thinking` blocks either way unless disabled; the budget is kept: `_budget`)."""
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled"):
        raise InvalidRequest(
            "thinking", "must be {type: enabled, budget_tokens} or {type: disabled}"
        )


def _budget(thinking: Any, max_tokens: Any) -> int | None:
    """`thinking.budget_tokens` of an enabled thought: at most that many tokens of thought, then
    the engine ends it (the end marker forced) and the answer follows; below max_tokens."""
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if type(budget) is not int or budget < 1:
        raise InvalidRequest("thinking.budget_tokens", "must be a positive integer")
    if type(max_tokens) is int and budget >= max_tokens:
        raise InvalidRequest("thinking.budget_tokens", "must be less than max_tokens")
    return budget


def thinking_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """`thinking: {type: disabled}` as the chat template's `enable_thinking: false` (a
    template that has the switch renders an empty thought; others ignore it)."""
    thinking = body.get("thinking")
    disabled = isinstance(thinking, dict) and thinking.get("type") == "disabled"
    return {"enable_thinking": False} if disabled else None


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if isinstance(system, list):
        return [{"role": "system", "content": _text_blocks("system", system)}]
    raise InvalidRequest("system", "must be a string or a list of text blocks")


def _text_blocks(where: str, blocks: list[Any]) -> str:
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise InvalidRequest(f"{where}[{j}]", "must be a text block")
        parts.append(b["text"])
    return "".join(parts)


def _message(i: int, m: Any) -> list[dict[str, Any]]:
    """One Anthropic message as template messages (a user turn's tool results come first, each
    its own `tool` message, as OpenAI-style templates expect them)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(where, "must be an object")
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise InvalidRequest(f"{where}.role", "must be 'user' or 'assistant'")
    if set(m) - {"role", "content"}:
        raise InvalidRequest(where, f"unknown fields {sorted(set(m) - {'role', 'content'})}")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content", "must be a string or a list of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(at, block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(at, block))
        else:
            what = "text, tool_use" if role == "assistant" else "text, tool_result"
            raise InvalidRequest(at, f"unsupported content block (this server takes {what})")
    out: list[dict[str, Any]] = results
    if text or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        out = out + [turn]
    return out


def _tool_use(at: str, block: dict[str, Any]) -> dict[str, Any]:
    ident, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(ident, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise InvalidRequest(at, "a tool_use block needs a string id and name and an object input")
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_result(at: str, block: dict[str, Any]) -> dict[str, Any]:
    ident, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(ident, str):
        raise InvalidRequest(f"{at}.tool_use_id", "must be a string")
    if isinstance(content, list):
        content = _text_blocks(f"{at}.content", content)
    elif not isinstance(content, str):
        raise InvalidRequest(f"{at}.content", "must be a string or a list of text blocks")
    if block.get("is_error"):
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": ident, "content": content}


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools as the template's OpenAI-style function tools."""
    return prepare.converted_tools(tools, _tool)


def _tool(j: int, t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise InvalidRequest(f"tools[{j}]", "must be an object with a string name")
    if t.get("type") not in (None, "custom"):
        raise InvalidRequest(f"tools[{j}].type", "only custom (client) tools are supported")
    schema = t.get("input_schema", {"type": "object"})
    function = {"name": t["name"], "description": t.get("description", ""), "parameters": schema}
    return {"type": "function", "function": function}


# --- responses ----------------------------------------------------------------------------------


def stop_reason(final: tc.Chunk, made_tool_calls: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended the text or None)."""
    if final.finish_reason == "stop" and made_tool_calls:
        return "tool_use", None
    if final.finish_reason == "stop" and final.stop is not None:
        return "stop_sequence", final.stop
    return STOP_REASONS.get(final.finish_reason or "stop", "end_turn"), None


def usage(final: tc.Chunk) -> dict[str, Any]:
    """Input tokens read from the prefix cache are `cache_read_input_tokens`, the rest
    `input_tokens` (Anthropic counts them apart); nothing is written to a cache on request."""
    return {
        "input_tokens": final.prompt_tokens - final.cached_tokens,
        "output_tokens": final.completion_tokens,
        "cache_read_input_tokens": final.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style parsed tool call (tool_calls.py) as a `tool_use` content block."""
    function = call["function"]
    args = function.get("arguments") or "{}"
    try:
        data = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        data = {"arguments": args}  # NOTE: the model's own text, not JSON: kept, not lost
    if not isinstance(data, dict):
        data = {"value": data}
    ident = str(call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}")
    return {"type": "tool_use", "id": ident, "name": function["name"], "input": data}


class Formatter:
    """One request's message object and stream events."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.id = "msg_" + uuid.uuid4().hex

    def message(self, content: list[dict[str, Any]], final: tc.Chunk | None) -> dict[str, Any]:
        reason, seq = (None, None)
        if final is not None:
            reason, seq = stop_reason(final, any(b["type"] == "tool_use" for b in content))
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": usage(final) if final is not None else None,
        }

    def whole(
        self, text: str, final: tc.Chunk, calls: list[dict[str, Any]], reasoning: str = ""
    ) -> dict[str, Any]:
        content = [thinking_block(reasoning)] if reasoning else []
        content += [{"type": "text", "text": text}] if text else []
        content += [tool_use_block(c) for c in calls]
        return self.message(content, final)


def thinking_block(text: str) -> dict[str, Any]:
    """The model's thought as a `thinking` block; its signature is empty: the engine signs
    nothing, and a client sends the block back as it got it."""
    return {"type": "thinking", "thinking": text, "signature": ""}


class Events:
    """A streamed message's events: `message_start`, a `ping`, each content block's
    `content_block_start`, deltas and `content_block_stop` (text as `text_delta`s, a tool call
    as one `input_json_delta`), then `message_delta` (stop reason, output tokens) and
    `message_stop`."""

    def __init__(self, fmt: Formatter) -> None:
        self.fmt = fmt
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the open block's type: "thinking", "text" or None
        self.calls = 0

    def start(self, first: tc.Chunk) -> bytes:
        message = self.fmt.message([], None)
        message["usage"] = {**usage(first), "output_tokens": 0}
        return event("message_start", {"message": message}) + event("ping", {})

    def reasoning(self, text: str) -> bytes:
        """The thought's text as `thinking_delta`s of a `thinking` block."""
        if not text:
            return b""
        out = self._open("thinking", thinking_block(""))
        delta = {"type": "thinking_delta", "thinking": text}
        return out + event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._open("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta", {"index": self.blocks - 1, "delta": delta})

    def tool_call(self, call: dict[str, Any]) -> bytes:
        block = tool_use_block(call)
        self.calls += 1
        out = self._close_text() + self._start_block({**block, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        out += event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
        return out + event("content_block_stop", {"index": self.blocks - 1})

    def finish(self, final: tc.Chunk) -> bytes:
        reason, seq = stop_reason(final, self.calls > 0)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        out = self._close_text()
        out += event("message_delta", {"delta": delta, "usage": usage(final)})
        return out + event("message_stop", {})

    def _start_block(self, block: dict[str, Any]) -> bytes:
        self.blocks += 1
        return event("content_block_start", {"index": self.blocks - 1, "content_block": block})

    def _open(self, kind: str, block: dict[str, Any]) -> bytes:
        """The block of this kind open, the one before closed (a thought ends before the text)."""
        if self.open == kind:
            return b""
        out = self._close_text() + self._start_block(block)
        self.open = kind
        return out

    def _close_text(self) -> bytes:
        """Close the open thinking or text block, if any."""
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            delta = {"type": "signature_delta", "signature": ""}
            out += event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
        self.open = None
        return out + event("content_block_stop", {"index": self.blocks - 1})


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event in Anthropic's shape: its type named twice (event: and "type")."""
    body = msgspec.json.encode({"type": kind, **data})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"
