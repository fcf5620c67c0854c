"""Generated HTTP requests for fuzzing the OpenAI and Anthropic APIs: hostile values in every field (wrong types,
huge, negative and non-finite numbers, deep nesting), unknown fields, malformed and truncated JSON,
bad headers and content types, broken framing, wrong methods and paths, and a few valid requests.

Requests are raw bytes sent on a fresh connection each, so nothing a client library would refuse
to send is out of reach. Generated requests ask for few tokens unless the field under test is the
token count, so the fuzz is about parsing, not load.
"""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_PROBE_BYTES = 1 << 20
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"  # NOTE: Anthropic's Messages API
RESPONSES = "/v1/responses"
PATHS = [CHAT, COMPLETIONS, MESSAGES, RESPONSES, "/v1/messages/count_tokens", "/tokenize", "/detokenize",
         "/v1/models/x", "/v1/models/%00", "/v1/models", "/health", "/metrics", "/v1/nothing", "/",
         "/v1/completions/", "//v1/completions", "/v1/chat/completions?x=1&x=2", "/%ff%00",
         "/v1/../v1/models", "/" + "a" * 5000, "*"]  # fmt: skip
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "BREW", "post"]
FIELDS = ["messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
          "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
          "top_logprobs", "tools", "tool_choice", "n", "best_of", "echo", "logit_bias",
          "response_format", "model", "user", "parallel_tool_calls", "metadata", "system",
          "stop_sequences", "thinking", "cache_control", "output_config", "regex", "grammar"]  # fmt: skip
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 "multipart/form-data; boundary=zz", "application/json; charset=latin-1",
                 "application/json; charset=bogus", "", "\x7f", "a" * 300]  # fmt: skip


class Raw(str):
    """JSON text emitted as it is (NaN, 1e999, nesting deeper than `json` can write)."""


@dataclass
class Probe:
    """One generated request: its bytes, what it is, and how to end it."""

    data: bytes
    kind: str
    method: str = "POST"
    hang_up: bool = False  # NOTE: truncated: the server waits for bytes that never come
    half_close: bool = False  # NOTE: junk that may be an unfinished request line: say it ended
    abandon: bool = False  # NOTE: a stream the client leaves after its first event


def probes(seed: int, n: int) -> Iterator[Probe]:
    rng = random.Random(seed)
    makers = [_bad_field] * 6 + [_bad_messages] * 2 + [_bad_blocks] * 2 + [_bad_items] * 2 + [_bad_constraint] * 2 + [_choices, _bad_utility,
              _unknown_field,
              _bad_json, _bad_json,
              _deep, _bad_headers, _bad_headers, _truncated, _method_path, _method_path,
              _bad_framing, _valid, _abandoned]  # fmt: skip
    for i in range(n):
        yield _oversized(rng) if i % 500 == 499 else rng.choice(makers)(rng)


# --- bodies -------------------------------------------------------------------------------------


def _base(rng: random.Random) -> tuple[str, dict[str, Any]]:
    if rng.random() < 0.6:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        path = CHAT if rng.random() < 0.6 else MESSAGES
    else:
        body, path = {"prompt": rng.choice(["hi", [1, 2, 3]])}, COMPLETIONS
    body["max_tokens"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        body["stream"] = True
    return path, body


def _hostile(rng: random.Random, depth: int = 2) -> Any:
    kind = rng.randrange(9 if depth > 0 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 1, 2**31, -(2**31), 2**63, 2**64, 10**30, -(10**40)])
    if kind == 2:
        return rng.choice([0.5, -0.0, 1e308, -1e308, 5e-324, 1.5, -2.5])
    if kind == 3:
        return Raw(rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 400]))
    if kind == 4:
        return rng.choice(["", "x", "\x00", "\ud800", "\u202e\ufeff", "y" * rng.randrange(20_000)])
    if kind == 5:
        return rng.choice(["auto", "none", "required", "user", "function", "text"])
    if kind == 6:
        n = rng.choice([40, 1000, 100_000])
        return Raw("[" * n + "]" * n) if rng.random() < 0.5 else Raw('{"a":' * n + "1" + "}" * n)
    if kind == 7:
        if rng.random() < 0.2:  # NOTE: long, of small values: bodies stay well under a MiB
            return [rng.randrange(-5, 70_000) for _ in range(5000)]
        return [_hostile(rng, depth - 1) for _ in range(rng.choice([0, 1, 3]))]
    return {rng.choice(["type", "function", "name", "a"]): _hostile(rng, depth - 1)
            for _ in range(rng.randint(0, 3))}  # fmt: skip


def _bad_field(rng: random.Random) -> Probe:
    path, body = _base(rng)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        body[rng.choice(FIELDS)] = _hostile(rng)
    return _post(path, body, "hostile field")


def _choices(rng: random.Random) -> Probe:
    """Several choices (each a request of its own), best_of, echo, prompt logprobs: valid, or
    one field hostile."""
    path, body = _base(rng)
    body["n"] = rng.choice([2, 16])
    if path == COMPLETIONS:
        body.update(best_of=rng.choice([body["n"], 16]), echo=True, logprobs=rng.randrange(6))
    if rng.random() < 0.5:
        body[rng.choice(["n", "best_of", "echo", "logprobs", "seed"])] = _hostile(rng)
    return _post(path, body, "choices")


def _bad_messages(rng: random.Random) -> Probe:
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(["role", "content", "name", "tool_calls", "tool_call_id", "x"])
        message[key] = _hostile(rng)
    if rng.random() < 0.3:
        part = {"type": _hostile(rng, 0), "text": _hostile(rng, 0)}
        message["content"] = [part, {"type": "text", "text": "x"}]
    if rng.random() < 0.3:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        call[rng.choice(["id", "type", "function"])] = _hostile(rng)
        if rng.random() < 0.5:
            call["function"] = {"name": _hostile(rng, 0), "arguments": _hostile(rng, 1)}
        message["tool_calls"] = rng.choice([[call], call, [call] * 4])
    many = [{"role": "user", "content": "hi"}] * rng.randint(2, 2000) + [message]
    messages: Any = rng.choice([[message], many, message, []])
    body = {"messages": messages, "max_tokens": 2}
    if rng.random() < 0.3:
        body["tools"] = (
            _hostile(rng)
            if rng.random() < 0.5
            else [{"type": "function", "function": _hostile(rng)}]
        )
    return _post(CHAT, body, "hostile messages")


def _bad_blocks(rng: random.Random) -> Probe:
    """Anthropic content blocks with hostile fields: text, tool_use, tool_result, others."""
    kinds = ["text", "tool_use", "tool_result", "image", "document", "thinking", ""]
    blocks = []
    for _ in range(rng.randint(1, 4)):
        block: dict[str, Any] = {"type": rng.choice(kinds), "text": "x", "id": "t", "name": "f"}
        block.update({"input": {}, "tool_use_id": "t", "content": "ok"})
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(["type", "text", "id", "name", "input", "tool_use_id", "content"])
            block[key] = _hostile(rng)
        blocks.append(block)
    role = rng.choice(["user", "assistant", "system", _hostile(rng, 0)])
    body: dict[str, Any] = {"messages": [{"role": role, "content": blocks}], "max_tokens": 2}
    if rng.random() < 0.3:
        body["system"] = _hostile(rng) if rng.random() < 0.5 else blocks
    if rng.random() < 0.3:
        tool = {"name": "f", "input_schema": {"type": "object"}}
        tool[rng.choice(["name", "input_schema", "type", "description"])] = _hostile(rng)
        body["tools"] = rng.choice([[tool], tool, _hostile(rng)])
    path = MESSAGES if rng.random() < 0.8 else "/v1/messages/count_tokens"
    return _post(path, body, "hostile content blocks")


def _bad_items(rng: random.Random) -> Probe:
    """Responses input items with hostile fields: messages, function calls and their outputs."""
    kinds = ["message", "function_call", "function_call_output", "reasoning", ""]
    items = []
    for _ in range(rng.randint(1, 4)):
        item: dict[str, Any] = {"type": rng.choice(kinds), "role": "user", "content": "x"}
        item.update({"call_id": "c", "name": "f", "arguments": "{}", "output": "ok"})
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(["type", "role", "content", "call_id", "name", "arguments", "output"])
            item[key] = _hostile(rng)
        items.append(item)
    body: dict[str, Any] = {"input": rng.choice([items, _hostile(rng)]), "max_output_tokens": 2}
    for name in rng.sample(["instructions", "tools", "tool_choice", "text", "stream"], 2):
        if rng.random() < 0.3:
            body[name] = _hostile(rng)
    return _post(RESPONSES, body, "hostile input items")


def _bad_constraint(rng: random.Random) -> Probe:
    """Structured output: schemas invalid, huge, deep or unsatisfiable; regexes and grammars that
    do not compile, explode or never accept; forced tool calls without tools or the format."""
    deep = 400
    schemas: list[Any] = [
        {"type": "nope"},
        {"type": "string", "minLength": 5, "maxLength": 2},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(3000)},
            "required": [f"p{i}" for i in range(3000)],
        },
        Raw('{"anyOf":[' * deep + '{"type":"string"}' + "]}" * deep),
        {"$ref": "#/definitions/x"},
        {"type": "array", "items": {"$ref": "#"}},
        _hostile(rng),
    ]
    texts = [
        "a(b",
        "(a|b){1,100000}",
        "((a+)+)+$",
        "[",
        "",
        "x" * 200_000,
        "\\p{Zzzz}",
        "start: start",
        'start: "a" start',
        "start: undefined",
        "%import x",
        _hostile(rng, 0),
    ]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    kind = rng.randrange(5)
    if kind == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": rng.choice(schemas)}}
        body["response_format"] = rng.choice([fmt, {"type": "json_object"}, _hostile(rng)])
    elif kind in (1, 2):
        body[rng.choice(["regex", "grammar"])] = rng.choice(texts)
    elif kind == 3:
        body["tool_choice"] = rng.choice(
            [
                "required",
                {"type": "function", "function": {"name": "f"}},
                {"type": "function"},
                _hostile(rng),
            ]
        )
        if rng.random() < 0.5:
            body["tools"] = [
                {"type": "function", "function": {"name": "f", "parameters": rng.choice(schemas)}}
            ]
    else:
        fmt = {"type": "json_schema", "name": "x", "schema": rng.choice(schemas)}
        return _post(
            RESPONSES,
            {"input": "hi", "max_output_tokens": 4, "text": {"format": fmt}},
            "hostile text format",
        )
    if rng.random() < 0.3:
        body.update({"regex": "[0-9]+", "response_format": {"type": "json_object"}})
    if "tools" not in body and rng.random() < 0.4:
        del body["messages"]
        return _post(COMPLETIONS, {**body, "prompt": "hi"}, "hostile constraint")
    return _post(CHAT, body, "hostile constraint")


def _bad_utility(rng: random.Random) -> Probe:
    """/tokenize and /detokenize with hostile fields."""
    if rng.random() < 0.5:
        body: dict[str, Any] = {rng.choice(["prompt", "messages"]): _hostile(rng)}
        if rng.random() < 0.3:
            body["add_generation_prompt"] = _hostile(rng, 0)
        return _post("/tokenize", body, "hostile tokenize")
    return _post("/detokenize", {"tokens": _hostile(rng)}, "hostile detokenize")


def _unknown_field(rng: random.Random) -> Probe:
    path, body = _base(rng)
    name = rng.choice(["frobnicate", "", "\x00", "Messages", "max_tokens ", "a" * 2000])
    body[name] = _hostile(rng, 1)
    return _post(path, body, "unknown field")


def _bad_json(rng: random.Random) -> Probe:
    path, body = _base(rng)
    text = bytearray(_dumps(body).encode())
    op = rng.randrange(5)
    if op == 0:
        text = text[: rng.randrange(len(text))]
    elif op == 1:
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
    elif op == 2:
        text = bytearray(rng.randbytes(rng.choice([0, 1, 7, 300])))
    elif op == 3:
        text = bytearray(rng.choice([b"null", b"[]", b"1", b'"x"', b"{}", b"\xef\xbb\xbf{}"]))
    else:
        text += rng.choice([b"}", b" x", b"\x00", b",{}"])
    return _post(path, bytes(text), "malformed JSON")


def _deep(rng: random.Random) -> Probe:
    path, body = _base(rng)
    n = rng.choice([33, 200, 5000, 300_000])
    field = rng.choice(["messages", "prompt", "stop", "tools", "metadata", "seed"])
    body[field] = Raw("[" * n + "]" * n) if rng.random() < 0.6 else Raw('{"a":' * n + "0" + "}" * n)
    if rng.random() < 0.3:
        return _post(path, Raw("[" * n + "]" * n), "deep nesting")
    return _post(path, body, "deep nesting")


def _oversized(rng: random.Random) -> Probe:
    path, body = _base(rng)
    body["prompt" if path == COMPLETIONS else "user"] = "x" * rng.choice([9 << 20, 12 << 20])
    return _post(path, body, "over the body limit")


def _abandoned(rng: random.Random) -> Probe:
    path, body = _base(rng)
    body.update(stream=True, max_tokens=rng.randint(50, 400), ignore_eos=True)
    probe = _post(path, body, "abandoned stream")
    probe.abandon = True
    return probe


def _valid(rng: random.Random) -> Probe:
    path, body = _base(rng)
    return _post(path, body, "valid")


# --- headers and framing ------------------------------------------------------------------------


def _bad_headers(rng: random.Random) -> Probe:
    path, body = _base(rng)
    data = _dumps(body).encode()
    headers = {"Host": "x", "Content-Type": "application/json"}
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(8)
        if op == 0:
            headers["Content-Type"] = rng.choice(CONTENT_TYPES)
        elif op == 1:
            headers.pop(rng.choice(["Host", "Content-Type"]), None)
        elif op == 2:
            headers["Authorization"] = rng.choice(["Bearer", "Bearer " + "k" * 10_000, "Basic x"])
        elif op == 3:
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "zstd", "x"])
            data = gzip.compress(data) if rng.random() < 0.4 else data
        elif op == 4:
            headers["X-Big"] = "h" * rng.choice([100, 9000, 70_000])
        elif op == 5:
            headers["Expect"] = rng.choice(["100-continue", "nope"])
        elif op == 6:
            headers.update({"Connection": "Upgrade", "Upgrade": rng.choice(["websocket", "h2c"])})
        else:
            headers[rng.choice(["X-\x01", "Bad Name", "", "X:Y"])] = "v"
    return Probe(_message("POST", path, headers, data), "bad headers")


def _truncated(rng: random.Random) -> Probe:
    path, body = _base(rng)
    data = _dumps(body).encode()
    headers = {"Host": "x", "Content-Type": "application/json"}
    headers["Content-Length"] = str(len(data) + rng.choice([1, 100, 1 << 20]))
    cut = data[: rng.randrange(len(data) + 1)]
    return Probe(_message("POST", path, headers, cut, length=False), "truncated", hang_up=True)


def _method_path(rng: random.Random) -> Probe:
    method, path = rng.choice(METHODS), rng.choice(PATHS)
    data = _dumps(_base(rng)[1]).encode() if rng.random() < 0.5 else b""
    return Probe(_message(method, path, {"Host": "x"}, data), "method/path", method=method)


def _bad_framing(rng: random.Random) -> Probe:
    path, body = _base(rng)
    data = _dumps(body).encode()
    op = rng.randrange(7)
    if op == 0:
        return Probe(rng.randbytes(rng.choice([1, 10, 200])), "bad framing", half_close=True)
    elif op == 1:
        raw = f"POST {path} HTTP/{rng.choice(['0.9', '1.0', '2.0', '9.9', 'x'])}\r\n\r\n".encode()
    elif op == 2:  # NOTE: a Content-Length that is not a size
        length = rng.choice(["-1", "abc", "1e3", "99999999999999999999", "5, 6"])
        raw = _message("POST", path, {"Host": "x", "Content-Length": length}, data, length=False)
    elif op == 3:  # NOTE: both framings at once (request smuggling)
        headers = {"Host": "x", "Transfer-Encoding": "chunked", "Content-Length": str(len(data))}
        raw = _message("POST", path, headers, data, length=False)
    elif op == 4:
        chunk = rng.choice([b"zz\r\n", b"5\r\nabc\r\n", b"-1\r\n", b"ffffffffffff\r\n", b"0\r\n"])
        raw = _message("POST", path, {"Host": "x", "Transfer-Encoding": "chunked"}, b"", False)
        # NOTE: a chunk with bytes still to come is a truncated body: the server waits for them
        waits = chunk in (b"5\r\nabc\r\n", b"ffffffffffff\r\n")
        return Probe(raw + chunk + b"\r\n", "truncated" if waits else "bad framing", hang_up=waits)
    elif op == 5:  # NOTE: a second request after the body: pipelined, or garbage
        raw = _message("POST", path, {"Host": "x"}, data) + rng.choice([b"GET / HTTP/1.1\r\n\r\n",
                                                                        b"\x00\xff garbage"])  # fmt: skip
    else:
        raw = _message("POST", path, {"Host": "x"}, data).replace(b"\r\n", b"\n")
    return Probe(raw, "bad framing")


# --- encoding -----------------------------------------------------------------------------------


def _post(path: str, body: Any, kind: str) -> Probe:
    data = body if isinstance(body, bytes) else _dumps(body).encode("utf-8", "surrogatepass")
    if kind != "over the body limit":
        data = data[:MAX_PROBE_BYTES]  # NOTE: a guard; generated bodies are far smaller
    headers = {"Host": "x", "Content-Type": "application/json"}
    return Probe(_message("POST", path, headers, data), kind)


def _message(
    method: str, path: str, headers: dict[str, str], data: bytes, length: bool = True
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers.items()]
    if length:
        lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace") + data


def _dumps(value: Any) -> str:
    """JSON text, with `Raw` pieces as they are (no recursion limit: nesting is iterative)."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    return json.dumps(value)


# --- sending ------------------------------------------------------------------------------------


def send(port: int, probe: Probe, timeout: float) -> str:
    """Send one probe on a new connection; the response's status code, or what happened instead
    ("closed": the server hung up without a response; "hung up": we did, as planned; "timeout")."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            try:
                sock.sendall(probe.data)
            except OSError:
                pass  # NOTE: the server may answer (413, 400) and close before all is sent
            if probe.hang_up:
                return "hung up"
            if probe.half_close:
                sock.shutdown(socket.SHUT_WR)
            resp = http.client.HTTPResponse(sock, method=probe.method)
            resp.begin()
            if probe.abandon:
                resp.readline()
                return f"{resp.status} abandoned"
            try:
                resp.read()
            except (http.client.HTTPException, ConnectionError):
                return f"{resp.status} cut short"
            return str(resp.status)
    except TimeoutError:
        return "timeout"
    except (http.client.HTTPException, ConnectionError):
        return "closed"
