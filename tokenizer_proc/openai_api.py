"""OpenAI's request and response shapes, free of I/O: a request body becomes a `Generate` (or an
`InvalidRequest` naming the field), engine chunks become completion objects and stream chunks.

Every field a request may carry is listed here; any other field, or a value we cannot honour
(a `logit_bias`), is a 400 naming it, never silently ignored. `n` choices and `best_of`
candidates are each a request of their own (tokenizer_proc/choices.py).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.sampling_params import MAX_TOP_LOGPROBS
from tokenizer_proc import effort, prepare, tool_choice

# the sampling fields passed to SamplingParams under the same name
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    # NOTE: structured output beyond response_format (SGLang's names; grammar: Lark)
    "regex",
    "grammar",
)
# accepted fields that change nothing: identity strings, and neutral values of what we lack
IGNORED = ("model", "user", "store", "metadata", "service_tier")
NEUTRAL: dict[str, tuple[Any, ...]] = {"logit_bias": ({},)}
COMMON = {*SAMPLING, *IGNORED, *NEUTRAL, "stream", "stream_options", "max_tokens", "stop"}
COMMON |= {"response_format", "n"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools"}
CHAT |= {"tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort"}
COMPLETION = COMMON | {"prompt", "logprobs", "best_of", "echo"}
# NOTE: each choice (or best_of candidate) is a request: admission counts them all
MAX_CHOICES = 16
OPENAI_FINISH = {"stop": "stop", "length": "length"}


@dataclass
class Request:
    """One parsed OpenAI request."""

    kind: str  # "chat" or "completion"
    generate: tt.Generate
    model: str
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs asked
    renamed: dict[str, str] = field(default_factory=dict)  # engine field -> the request's name
    n: int = 1  # choices returned
    best_of: int = 1  # candidates generated (completions), the n most likely per token kept
    echo: bool = False  # completions: the prompt before the text (and its logprobs, if asked)


def parse(kind: str, body: Any, rid: str, max_context: int, model: str) -> Request:
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # NOTE: clients send explicit nulls
    _check_fields(body, CHAT if kind == "chat" else COMPLETION)
    params: dict[str, Any] = {k: body[k] for k in SAMPLING if k in body}
    req = Request(kind, tt.Generate(rid, params=params), str(body.get("model") or model))
    _stream_options(req, body)
    _max_tokens(req, body, params, max_context)
    _stop(body, params)
    _logprobs(req, body, params)
    _choices(req, body, params)
    if "response_format" in body:
        response_format(body["response_format"], params, "response_format")
        req.renamed["json_schema"] = "response_format"
    if kind == "chat":
        _chat_input(req.generate, body)
    else:
        _completion_input(req.generate, body)
        req.renamed["input_ids"] = "prompt"
    return req


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name not in allowed:
            raise InvalidRequest(name, "is not supported by this server")
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise InvalidRequest(name, f"only {NEUTRAL[name][0]!r} is supported, got {value!r}")


def response_format(value: Any, params: dict[str, Any], name: str) -> None:
    """OpenAI's `response_format` (the Responses API's `text.format`: `name` says which) as the
    engine's `json_schema`: `text` asks for nothing, `json_object` for any JSON object,
    `json_schema` for its `schema` (enforced whatever `strict` says)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        # NOTE: Chat Completions nests the schema under "json_schema"; Responses does not.
        spec = value.get("json_schema", value) if name == "response_format" else value
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest(name, "a json_schema format needs its schema, a JSON object")
    else:
        raise InvalidRequest(name, f"type must be text, json_object or json_schema, got {kind!r}")
    if "regex" in params or "grammar" in params:
        raise InvalidRequest(name, "only one of response_format, regex and grammar per request")
    params["json_schema"] = schema


def _stream_options(req: Request, body: dict[str, Any]) -> None:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream", "must be a boolean")
    req.stream = stream
    options = body.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("stream_options", "only {'include_usage': bool} is supported")
    req.include_usage = bool(options.get("include_usage", False))


def _max_tokens(req: Request, body: dict[str, Any], params: dict[str, Any], limit: int) -> None:
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    # NOTE: OpenAI's default is "as much as fits"; the scheduler caps it at the context left.
    params["max_tokens"] = body.get(name, limit)
    req.renamed["max_tokens"] = name


def _stop(body: dict[str, Any], params: dict[str, Any]) -> None:
    stop = body.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop", "must be a string or a list of strings")
    if len(stop) > 4:
        raise InvalidRequest("stop", f"at most 4 stop sequences, got {len(stop)}")
    params["stop"] = stop


def _logprobs(req: Request, body: dict[str, Any], params: dict[str, Any]) -> None:
    if req.kind == "chat":
        wanted, name = body.get("logprobs", False), "logprobs"
        if not isinstance(wanted, bool):
            raise InvalidRequest("logprobs", "must be a boolean")
        top = body.get("top_logprobs", 0)
        if "top_logprobs" in body:
            name = "top_logprobs"
            if not wanted:
                raise InvalidRequest("top_logprobs", "needs logprobs: true")
        if not wanted:
            return
    else:
        if "logprobs" not in body:
            return
        top, name = body["logprobs"], "logprobs"
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    req.top_logprobs = top
    params["logprobs"] = max(top, 1)  # NOTE: the engine sends the chosen token's with the top n
    req.renamed["logprobs"] = name


def _choices(req: Request, body: dict[str, Any], params: dict[str, Any]) -> None:
    """`n`, `best_of` and `echo` (the last two on completions only, as OpenAI has them)."""
    req.n = _count(body, "n", 1)
    req.best_of = _count(body, "best_of", req.n)
    if req.best_of < req.n:
        raise InvalidRequest("best_of", f"must be at least n ({req.n}), got {req.best_of}")
    if req.best_of > req.n:
        if req.stream:
            raise InvalidRequest("best_of", "more candidates than n cannot be streamed")
        params["logprobs"] = max(params.get("logprobs", 0), 1)  # NOTE: the ranking's
    req.echo = flag(body, "echo", False)
    if req.echo and req.top_logprobs is not None:
        params["prompt_logprobs"] = req.top_logprobs


def _count(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if type(value) is not int or not 1 <= value <= MAX_CHOICES:
        raise InvalidRequest(name, f"must be an integer in [1, {MAX_CHOICES}], got {value!r}")
    return value


def _chat_input(gen: tt.Generate, body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list")
    gen.messages = [_message(i, m) for i, m in enumerate(messages)]
    if "chat_template_kwargs" in body:
        gen.chat_template_kwargs = prepare.template_kwargs(body["chat_template_kwargs"])
    gen.reasoning_effort = effort.check(body.get("reasoning_effort"))
    tools = body.get("tools")
    choice = tool_choice.normalize(body.get("tool_choice"))
    gen.parallel_tool_calls = flag(body, "parallel_tool_calls", True)
    if tools is not None:
        tool_choice.check_tools(tools)
        gen.tools = tools if tools and choice != "none" else None
    gen.tool_choice = tool_choice.wire(choice)


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(name, "must be a boolean")
    return value


def _message(i: int, m: Any) -> dict[str, Any]:
    """One chat message as templates expect it: text content, tool call arguments as objects."""
    if not isinstance(m, dict):
        raise InvalidRequest(f"messages[{i}]", "must be an object")
    m = dict(m)
    content = m.get("content")
    if content is None:
        m["content"] = ""
    elif isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise InvalidRequest(f"messages[{i}].content", "only text parts are supported")
        m["content"] = "".join(str(p.get("text", "")) for p in content)
    if "tool_calls" in m:
        calls = [] if m["tool_calls"] is None else m["tool_calls"]
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls", "must be a list")
        m["tool_calls"] = [_tool_call_in(i, c) for c in calls]
    return m


def _tool_call_in(i: int, call: Any) -> dict[str, Any]:
    try:
        function = dict(call["function"])
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"] or "{}")
    # NOTE: json.loads raises RecursionError for arguments nested ~1000 deep
    except (TypeError, KeyError, ValueError, RecursionError) as e:
        raise InvalidRequest(f"messages[{i}].tool_calls", f"malformed tool call: {e}") from None
    return {**call, "function": function}


def _completion_input(gen: tt.Generate, body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # NOTE: a batch of one
    if isinstance(prompt, str):
        gen.prompt = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        gen.input_ids = prompt
    else:
        raise InvalidRequest("prompt", "must be a string or a list of token ids (one prompt)")


# --- /tokenize and /detokenize (vLLM's shapes) ----------------------------------------------------

TOKENIZE = {"model", "prompt", "messages", "tools", "add_generation_prompt", "chat_template_kwargs"}


def parse_tokenize(body: Any) -> tuple[tt.Generate, bool]:
    """(the prompt or chat to tokenize, whether a chat ends with the assistant's turn opened)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    _check_fields(body, TOKENIZE)
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("prompt", "give exactly one of prompt and messages")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        raise InvalidRequest("add_generation_prompt", "must be a boolean")
    gen = tt.Generate("tokenize")
    if "prompt" in body:
        _completion_input(gen, body)
    else:
        _chat_input(gen, body)
    return gen, generation_prompt


def parse_detokenize(body: Any, vocab: int) -> list[int]:
    if not isinstance(body, dict):
        raise InvalidRequest("body", "must be a JSON object")
    _check_fields(body, {"model", "tokens"})
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise InvalidRequest("tokens", f"must be a list of token ids in [0, {vocab})")
    return list(ids)


# --- responses ----------------------------------------------------------------------------------


def finish_reason(engine_reason: str, made_tool_calls: bool) -> str:
    if made_tool_calls and engine_reason == "stop":
        return "tool_calls"
    return OPENAI_FINISH.get(engine_reason, engine_reason)


def usage(final: tc.Chunk, reasoning_tokens: int = 0) -> dict[str, Any]:
    """`reasoning_tokens`: of the completion's, those of the model's thought."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


class Formatter:
    """Builds one request's response objects (whole or streamed) in its API's shape."""

    def __init__(self, req: Request, tokenizer: Any, index: int = 0, ident: str = "") -> None:
        """`index`: the choice it writes; `ident`: the response's id (shared by its choices)."""
        self.req = req
        self.tokenizer = tokenizer
        self.index = index
        self.id = ident or ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if req.kind == "chat" else "text_completion"

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.req.kind == "chat" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def logprobs(self, chunk: tc.Chunk) -> dict[str, Any] | None:
        if self.req.top_logprobs is None:
            return None
        n = self.req.top_logprobs
        pairs = list(zip(chunk.token_ids, chunk.logprobs, strict=False))
        if self.req.kind == "chat":
            return {"content": [self._chat_logprob(t, lp, n) for t, lp in pairs]}
        return {
            "tokens": [self._text(t) for t, _ in pairs],
            "token_logprobs": [lp.logprob for _, lp in pairs],
            "top_logprobs": [{self._text(i): v for i, v in lp.top[:n]} for _, lp in pairs],
        }

    def prompt_logprobs(self, chunk: tc.Chunk) -> dict[str, Any] | None:
        """An echoed prompt's logprobs (completions), from the request's first chunk: the first
        token's are null, as OpenAI's."""
        if self.req.top_logprobs is None or not chunk.prompt_ids:
            return None
        n, pairs = self.req.top_logprobs, zip(chunk.prompt_ids, chunk.prompt_logprobs, strict=True)
        entries = [(self._text(t), lp) for t, lp in pairs]
        return {
            "tokens": [text for text, _ in entries],
            "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
            "top_logprobs": [
                None if lp is None else {self._text(i): v for i, v in lp.top[:n]}
                for _, lp in entries
            ],
        }

    def _chat_logprob(self, token: int, lp: Any, n: int) -> dict[str, Any]:
        top = [self._entry(i, v) for i, v in lp.top[:n]]
        return {**self._entry(token, lp.logprob), "top_logprobs": top}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # --- streaming ------------------------------------------------------------------------------

    def stream_chunk(
        self,
        text: str = "",
        logprobs: dict[str, Any] | None = None,
        finish: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        role: bool = False,
        reasoning: str = "",
    ) -> dict[str, Any]:
        if self.req.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if reasoning:
                # NOTE: both names: vLLM's and SGLang's clients read one, newer ones the other
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if text or role:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": self.index, "delta": delta}
        else:
            choice = {"index": self.index, "text": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish
        out = {**self._envelope(True), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, final: tc.Chunk, reasoning_tokens: int = 0) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": usage(final, reasoning_tokens)}

    # --- whole ----------------------------------------------------------------------------------

    def whole(
        self,
        text: str,
        final: tc.Chunk,
        logprobs: list[dict[str, Any]],
        tool_calls: list[dict[str, Any]],
        reasoning: str = "",
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if tool_calls:
                message["tool_calls"] = [_without_index(c) for c in tool_calls]
                message["content"] = text or None
            choice["message"] = message
        else:
            choice["text"] = text
        choice["logprobs"] = (
            _merge_logprobs(logprobs) if self.req.top_logprobs is not None else None
        )
        choice["finish_reason"] = finish_reason(final.finish_reason or "stop", bool(tool_calls))
        out = {**self._envelope(False), "choices": [choice]}
        return {**out, "usage": usage(final, reasoning_tokens)}


def _without_index(call: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in call.items() if k != "index"}


def _merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged
