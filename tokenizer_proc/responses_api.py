"""OpenAI's Responses API shapes, free of I/O: a `/v1/responses` body becomes a `Generate` (or an
`InvalidRequest` naming the field), engine chunks become a `response` object or its stream events.

Stateless: nothing is stored, so `previous_response_id` and `conversation` are a 400 and `store`
is accepted and changes nothing (docs/http_api.md). Input items map onto the chat template as the
chat route's messages do: `instructions` is the system message, a `function_call` item an
assistant tool call, a `function_call_output` item a `tool` message.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.errors import InvalidRequest
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from tokenizer_proc import effort, openai_api, prepare, tool_choice

# accepted fields that change nothing here: identity, routing and cache hints, and `store`
# (nothing is kept: every request carries its whole input)
IGNORED = (
    "model",
    "metadata",
    "user",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
)
# accepted only at the value that asks for nothing the engine lacks
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",),
    "include": ([],),
    "background": (False,),
    "priority": (0,),  # NOTE: vLLM's; smg sends it to engines it takes for vLLM
}
# NOTE: top_k, min_p and repetition_penalty are vLLM's and SGLang's additions to this route: smg
# sends them (at values that change nothing; top_k -1 is vLLM's "no top-k", the engine's 0)
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FIELDS = {
    *IGNORED,
    *NEUTRAL,
    *SAMPLING,
    "input",
    "instructions",
    "max_output_tokens",
    "stream",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = {"input_text", "output_text", "text"}


@dataclass
class Request:
    """One parsed Responses request, and what its response echoes back."""

    generate: tt.Generate
    model: str
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)


def parse(body: Any, rid: str, model: str, max_context: int) -> Request:
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # NOTE: clients send explicit nulls
    for name, value in body.items():
        if name not in FIELDS:
            raise InvalidRequest(name, "is not supported by this server (stateless, text only)")
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise InvalidRequest(name, f"only {NEUTRAL[name][0]!r} is supported, got {value!r}")
    params: dict[str, Any] = {k: body[k] for k in SAMPLING if k in body}
    if params.get("top_k") == -1:
        params["top_k"] = 0
    # NOTE: as on the chat route: no limit given is "as much as fits"
    params["max_tokens"] = body.get("max_output_tokens", max_context)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", "must be a boolean")
    _text_format(body.get("text"), params)
    gen = tt.Generate(rid, params=params)
    gen.messages = _instructions(body.get("instructions")) + _input(body.get("input"))
    tools = _tools(body.get("tools"))
    choice = tool_choice.normalize(body.get("tool_choice"))
    gen.tools = tools if tools and choice != "none" else None
    gen.tool_choice = tool_choice.wire(choice)
    gen.parallel_tool_calls = openai_api.flag(body, "parallel_tool_calls", True)
    gen.reasoning_effort = _effort(body.get("reasoning"))
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "parallel_tool_calls": gen.parallel_tool_calls,
        "tools": body.get("tools", []),
        "metadata": body.get("metadata", {}),
        "text": {"format": {"type": "text"}, **body.get("text", {})},
        "reasoning": {"effort": gen.reasoning_effort, "summary": None},
    }
    return Request(gen, str(body.get("model") or model), stream, echo)


SUMMARIES = ("auto", "concise", "detailed")


def _effort(reasoning: Any) -> str | None:
    """`reasoning: {effort, summary}`: the effort as the chat route's `reasoning_effort`; a
    summary is accepted and the thought comes back whole (there is no summarizer)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary"}:
        raise InvalidRequest("reasoning", "must be {effort, summary}")
    summary = reasoning.get("summary")
    if summary is not None and summary not in SUMMARIES:
        raise InvalidRequest("reasoning.summary", f"must be one of {', '.join(SUMMARIES)}")
    return effort.check(reasoning.get("effort"), "reasoning.effort")


def _text_format(text: Any, params: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise InvalidRequest("text", "only {'format': {...}} is supported")
    if "format" in text:
        openai_api.response_format(text["format"], params, "text.format")


def _instructions(text: Any) -> list[dict[str, Any]]:
    if text is None:
        return []
    if not isinstance(text, str):
        raise InvalidRequest("instructions", "must be a string")
    return [{"role": "system", "content": text}] if text else []


def _input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("input", "must be a string or a non-empty list of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        _item(f"input[{i}]", item, out)
    return out


def _item(at: str, item: Any, out: list[dict[str, Any]]) -> None:
    """Append one input item as template messages (a function call joins the assistant turn
    before it, as a chat's tool_calls do)."""
    if not isinstance(item, dict):
        raise InvalidRequest(at, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        given = item.get("role")
        role = ROLES.get(given) if isinstance(given, str) else None  # NOTE: any JSON value
        if role is None:
            raise InvalidRequest(f"{at}.role", f"must be one of {sorted(ROLES)}")
        out.append({"role": role, "content": _content(f"{at}.content", item.get("content"))})
    elif kind == "function_call":
        name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
        if not all(isinstance(x, str) for x in (name, args, call_id)):
            raise InvalidRequest(at, "a function_call needs string name, arguments and call_id")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_call_id"):
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        _arguments(at, call)
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str):
            raise InvalidRequest(at, "a function_call_output needs string call_id and output")
        out.append({"role": "tool", "tool_call_id": call_id, "content": output})
    else:
        raise InvalidRequest(
            f"{at}.type", "this server takes message, function_call and function_call_output items"
        )


def _arguments(at: str, call: dict[str, Any]) -> None:
    """Templates take a call's arguments as an object (the chat route decodes them too)."""
    try:
        call["function"]["arguments"] = msgspec.json.decode(call["function"]["arguments"] or "{}")
    except (msgspec.DecodeError, RecursionError):
        raise InvalidRequest(f"{at}.arguments", "must be a JSON object text") from None


def _content(at: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(at, "must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type") in TEXT_PARTS
        if not ok or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{at}[{j}]", "only text parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as the template's chat-style ones."""
    return prepare.converted_tools(tools, _tool)


def _tool(j: int, t: Any) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        raise InvalidRequest(f"tools[{j}]", "only function tools are supported")
    keys = ("name", "description", "parameters")
    return {"type": "function", "function": {k: t[k] for k in keys if k in t}}


# --- responses ----------------------------------------------------------------------------------


def usage(final: tc.Chunk, reasoning_tokens: int = 0) -> dict[str, Any]:
    """`reasoning_tokens`: of the output's, those of the model's thought."""
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


class Formatter:
    """One request's `response` object and its output items."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.id = "resp_" + uuid.uuid4().hex
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.reasoning_tokens = 0  # NOTE: counted by the reply as its chunks are split

    def response(self, output: list[dict[str, Any]], final: tc.Chunk | None) -> dict[str, Any]:
        status, incomplete = "in_progress", None
        if final is not None:
            status = "incomplete" if final.finish_reason == "length" else "completed"
            incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "incomplete_details": incomplete,
            "error": None,
            "model": self.req.model,
            "output": output,
            "truncation": "disabled",
            "usage": usage(final, self.reasoning_tokens) if final is not None else None,
            **self.req.echo,
        }

    def message(self, text: str, done: bool = True) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": [part] if done else [],
        }

    def whole(
        self, text: str, final: tc.Chunk, calls: list[dict[str, Any]], reasoning: str = ""
    ) -> dict[str, Any]:
        output = [reasoning_item(reasoning)] if reasoning else []
        output += [self.message(text)] if text or not calls else []
        return self.response(output + [function_call(c) for c in calls], final)


def reasoning_item(text: str, done: bool = True) -> dict[str, Any]:
    """The model's thought as a `reasoning` output item (its text as `reasoning_text`)."""
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if done else [],
        "status": "completed" if done else "in_progress",
    }


def function_call(call: dict[str, Any], done: bool = True) -> dict[str, Any]:
    """A parsed chat-style tool call (tool_calls.py) as a `function_call` output item."""
    function = call["function"]
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if done else "",
        "status": "completed" if done else "in_progress",
    }


class Events:
    """A streamed response's events, each numbered (`sequence_number`): `response.created` and
    `response.in_progress`, the message item (`output_item.added`, `content_part.added`,
    `output_text.delta`s, then their `done`s), each function call as an item with its
    arguments in one delta, and `response.completed` (or `response.incomplete`)."""

    def __init__(self, fmt: Formatter) -> None:
        self.fmt = fmt
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.text: list[str] | None = None  # the open message's text so far
        self.thought: dict[str, Any] | None = None  # the open reasoning item
        self.thought_text: list[str] = []

    def start(self) -> bytes:
        snapshot = self.fmt.response([], None)
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def reasoning(self, text: str) -> bytes:
        """The thought's text as `reasoning_text` deltas of a `reasoning` item."""
        if not text:
            return b""
        out = b""
        if self.thought is None:
            self.thought, self.thought_text = reasoning_item("", done=False), []
            out += self._event(
                "response.output_item.added", output_index=self._index(), item=self.thought
            )
        self.thought_text.append(text)
        return out + self._event("response.reasoning_text.delta", **self._thought_at(), delta=text)

    def _close_thought(self) -> bytes:
        if self.thought is None:
            return b""
        text, at = "".join(self.thought_text), self._thought_at()
        item = {**reasoning_item(text), "id": self.thought["id"]}
        self.thought = None
        self.items.append(item)
        out = self._event("response.reasoning_text.done", **at, text=text)
        return out + self._event(
            "response.output_item.done", output_index=at["output_index"], item=item
        )

    def _thought_at(self) -> dict[str, Any]:
        assert self.thought is not None
        return {"item_id": self.thought["id"], "output_index": self._index(), "content_index": 0}

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        out = self._close_thought()
        if self.text is None:
            self.text = []
            item = self.fmt.message("", done=False)
            out += self._event("response.output_item.added", output_index=self._index(), item=item)
            part = {"type": "output_text", "text": "", "annotations": []}
            out += self._event("response.content_part.added", **self._at(), part=part)
        self.text.append(text)
        return out + self._event("response.output_text.delta", **self._at(), delta=text)

    def tool_call(self, call: dict[str, Any]) -> bytes:
        out = self._close_thought() + self._close_text()
        item = function_call(call)
        index = self._index()
        out += self._event(
            "response.output_item.added", output_index=index, item={**item, "arguments": ""}
        )
        at = {"item_id": item["id"], "output_index": index}
        args = item["arguments"]
        out += self._event("response.function_call_arguments.delta", **at, delta=args)
        out += self._event("response.function_call_arguments.done", **at, arguments=args)
        self.items.append(item)
        return out + self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, final: tc.Chunk) -> bytes:
        out = self._close_thought() + self._close_text()
        response = self.fmt.response(self.items, final)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=response)

    def error(self, message: str, code: str) -> bytes:
        return self._event("error", code=code, message=message, param=None)

    def _close_text(self) -> bytes:
        if self.text is None:
            return b""
        text, self.text = "".join(self.text), None
        at = self._at()
        part = {"type": "output_text", "text": text, "annotations": []}
        out = self._event("response.output_text.done", **at, text=text)
        out += self._event("response.content_part.done", **at, part=part)
        item = self.fmt.message(text)
        self.items.append(item)
        return out + self._event(
            "response.output_item.done", output_index=at["output_index"], item=item
        )

    def _index(self) -> int:
        return len(self.items)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.fmt.message_id, "output_index": self._index(), "content_index": 0}

    def _event(self, kind: str, **data: Any) -> bytes:
        body = msgspec.json.encode({"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"
