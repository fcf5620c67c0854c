"""Tool calls out of generated text, as it streams: text between the tokenizer's tool-call
markers (mlx-lm's `TokenizerWrapper.tool_call_start` / `tool_call_end`) is parsed by the model's
tool parser (`tool_parser`) into OpenAI `tool_calls`; everything else stays content.

Pure and incremental: `feed()` each text delta, `finish()` at the end. Text that could still be
the start of a marker is held back, as the detokenizer holds back stop strings. A format without
an end marker (mlx-lm's mistral: `tool_call_end` is "") has its calls run to the end of the
output, parsed at `finish()`. A call the parser refuses comes back as the model's text.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from collections.abc import Callable
from typing import Any

from engine.messages.to_tokenizer import Generate
from tokenizer_proc import tool_choice
from tokenizer_proc.call_text import call_id, openai_call, partial_suffix

log = logging.getLogger("tokenizer")

Parser = Callable[[str, Any], Any]


class ToolCallStream:
    def __init__(self, start: str, end: str, parser: Parser, tools: list[dict[str, Any]]) -> None:
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.calls = 0  # tool calls emitted so far (their stream indexes)
        self._buf = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Content text that is final now, and the tool calls completed by `text`."""
        self._buf += text
        content, calls = "", list[dict[str, Any]]()
        while True:
            if self._inside:
                # NOTE: an empty end would match at once; such a call runs to the output's end
                at = self._buf.find(self.end) if self.end else -1
                if at < 0:
                    return content, calls
                body, self._buf = self._buf[:at], self._buf[at + len(self.end) :]
                parsed = self._parse(body)
                calls += parsed
                content += "" if parsed else self.start + body + self.end
                self._inside = False
                continue
            at = self._buf.find(self.start)
            if at < 0:
                keep = partial_suffix(self._buf, self.start)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return content, calls
            content += self._buf[:at]
            self._buf = self._buf[at + len(self.start) :]
            self._inside = True

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left: an unterminated call is parsed if it can be, else returned as text."""
        rest, self._buf = self._buf, ""
        if not self._inside:
            return rest, []
        self._inside = False
        # NOTE: without an end marker this is where every call is parsed; with one, the call was
        # cut short (max_tokens), and failing to parse is expected
        calls = self._parse(rest, quiet=bool(self.end))
        return ("", calls) if calls else (self.start + rest, [])

    def _parse(self, text: str, quiet: bool = False) -> list[dict[str, Any]]:
        """The calls in one call's text; none when the parser refuses it.

        NOTE: any exception is a refusal: mlx-lm's parsers raise more than ValueError (longcat
        an AttributeError on a body without its keys, qwen3_coder an OverflowError on an integer
        past a float's range), and a model's output must never fail its reply."""
        try:
            parsed = self.parser(text, self.tools)
            found = parsed if isinstance(parsed, list) else [parsed]
            out = [self._call(c) for c in found]
        except Exception as e:
            if not quiet:
                log.warning("unparsable tool call (%s: %s): %.200r", type(e).__name__, e, text)
            return []
        for call in out:
            call["index"], self.calls = self.calls, self.calls + 1
        return out

    def _call(self, parsed: dict[str, Any]) -> dict[str, Any]:
        """One parsed call in OpenAI's form, the model's own id kept (Mistral writes one)."""
        ident = parsed.get("id") or new_id(self.parser)
        return openai_call(parsed["name"], parsed.get("arguments", {}), 0, ident)


# NOTE: Mistral's templates refuse any other call id ("Tool call IDs should be alphanumeric
# strings with length 9!"), and a client sends the id back with the tool's result
MISTRAL_ID_CHARS = string.ascii_letters + string.digits


def new_id(parser: Parser) -> str:
    """A fresh id for a call parsed by `parser`, in the shape its model's template takes back."""
    if getattr(parser, "__module__", "").rsplit(".", 1)[-1] == "mistral":
        return "".join(secrets.choice(MISTRAL_ID_CHARS) for _ in range(9))
    return call_id()


class JsonCalls:
    """A forced call in the generic form (`tool_choice._generic`): the whole reply is a JSON
    array of `{"name", "parameters"}`, parsed at its end. A reply that does not parse (cut by
    max_tokens) stays text. The same `feed` / `finish` as `ToolCallStream`."""

    def __init__(self) -> None:
        self.calls = 0
        self._buf: list[str] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._buf.append(text)
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._buf = "".join(self._buf), []
        try:
            parsed = json.loads(text)
            calls = [openai_call(c["name"], c["parameters"], i) for i, c in enumerate(parsed)]
        except (ValueError, KeyError, TypeError):
            return text, []
        self.calls = len(calls)
        return "", calls


class BareJsonCalls:
    """Calls on a model that has no tool-call format of its own, under `auto`: a reply that is
    nothing but JSON calls, `{"name", "parameters"}` (Llama 3.x's form; `arguments` too) or an
    array of them, each naming an offered tool, is calls; any other reply is content. Text
    streams as content at once unless the reply opens with `{` or `[` (whitespace skipped), which
    is held to the end and parsed there. The same `feed` / `finish` as `ToolCallStream`."""

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.names = {t["function"]["name"] for t in tools}
        self.calls = 0
        self._buf = ""
        self._held: bool | None = None  # None: not known yet (only whitespace so far)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self._held is False:
            return text, []
        self._buf += text
        lead = self._buf.lstrip()
        if lead and self._held is None:
            self._held = lead[0] in "{["
        if self._held is False:
            out, self._buf = self._buf, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self._buf = self._buf, ""
        calls = self._parse(text) if self._held else []
        self.calls = len(calls)
        return ("", calls) if calls else (text, [])

    def _parse(self, text: str) -> list[dict[str, Any]]:
        try:
            parsed = json.loads(text)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = [_bare_call(c, i) for i, c in enumerate(items)]
        except (ValueError, KeyError, TypeError, AttributeError):
            return []
        names = {c["function"]["name"] for c in calls}
        return calls if calls and names <= self.names else []


def _bare_call(item: dict[str, Any], index: int) -> dict[str, Any]:
    args = item["parameters"] if "parameters" in item else item["arguments"]
    if set(item) - {"name", "parameters", "arguments", "type"}:
        raise KeyError("not a call")
    return openai_call(item["name"], args, index)


Stream = ToolCallStream | JsonCalls | BareJsonCalls


def for_request(tokenizer: Any, msg: Generate) -> Stream | None:
    """A stream parser when the request has tools: the generic form's when its call is forced
    so (`tool_choice.generic_form`), the model's own when its tokenizer marks tool calls, else
    bare JSON calls (`BareJsonCalls`)."""
    tools = msg.tools
    if tools and tool_choice.generic_form(msg, tokenizer):
        return JsonCalls()
    if not tools:
        return None
    if not getattr(tokenizer, "has_tool_calling", False):
        return BareJsonCalls(tools)
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    return ToolCallStream(start, end, tokenizer.tool_parser, tools)
