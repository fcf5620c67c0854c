"""gpt-oss's harmony format, parsed as the text streams: the analysis channel is reasoning, the
final channel (and commentary without a recipient: a preamble meant for the user) is the answer,
and a message addressed `to=functions.NAME` is a tool call.

After the generation prompt `<|start|>assistant` the model writes messages, each a header, then
`<|message|>`, its body and an end marker: a thought, then the answer or a call (one text, broken
into lines here for reading):

    <|channel|>analysis<|message|>THOUGHT<|end|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>
    or <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>

The recipient may also follow the role (`<|start|>assistant to=functions.f<|channel|>commentary
json<|message|>`). `<|return|>` and `<|call|>` are stop tokens: the text may end with them or
without them (the detokenizer drops the tokens the tokenizer names as special: gpt-oss's names
`<|return|>` but not the header markers). A message addressed to another recipient (a built-in
`python` or `browser.*` tool) is the model's own work: reasoning. A header that does not parse,
a message on an unknown channel, and a call when the request offered no tools stay text, as
written. Text that does not start with a header (a model that does not speak harmony) is the
answer.

Pure and incremental like `reasoning.ReasoningStream`: `feed()` each text delta, `finish()` at
the end; text that could still be the start of a marker is held back, and a header is held until
its `<|message|>`.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from tokenizer_proc.call_text import openai_call, partial_suffix

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
# NOTE: what opens reasoning and what ends it, as `reasoning.opens_inside` finds them in a prompt
ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
TERMINATORS = (END, RETURN, CALL)
# NOTE: a body also ends where the model began the next header without ending it
BODY_ENDS = (*TERMINATORS, START, CHANNEL)
HEADER_ENDS = (MESSAGE, *TERMINATORS, START)
# NOTE: a header is a role, a channel, a recipient and a content type: far shorter than this, and
# never more than one line; text beyond either is not a header (and is not held back any longer)
HEADER_LIMIT = 256
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_WORD = re.compile(r"[\w.\-]+")

# NOTE: where a message's body goes
REASONING, ANSWER, TOOL, RAW = "reasoning", "answer", "tool", "raw"


def speaks(tokenizer: Any) -> bool:
    """Whether a model speaks harmony: its chat template writes the header markers and its
    vocabulary has them, one token each. NOTE: cheap enough for every request (a look at the
    template, two short encodes; the vocabulary of 200k tokens is not built)."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    if not any(isinstance(t, str) and CHANNEL in t and MESSAGE in t for t in templates):
        return False
    return all(len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in (CHANNEL, MESSAGE))


class Parts(NamedTuple):
    """What a delta added: reasoning, answer and tool calls (OpenAI's shape); `raw`: the text
    as written less the tool calls' messages (the SDK's text, which keeps the markers)."""

    reasoning: str
    answer: str
    calls: list[dict[str, Any]]
    raw: str

    def then(self, more: Parts) -> Parts:
        """These parts followed by `more`."""
        return Parts(
            self.reasoning + more.reasoning,
            self.answer + more.answer,
            self.calls + more.calls,
            self.raw + more.raw,
        )


class Header(NamedTuple):
    channel: str | None
    recipient: str | None


def parse_header(text: str) -> Header | None:
    """A message header (from `<|start|>`, or from the reply's start, to `<|message|>`): its
    channel and recipient; None when the text is not an assistant's header."""
    text = text.removeprefix(START)
    found = _RECIPIENT.findall(text)
    rest = _RECIPIENT.sub(" ", text).replace(CONSTRAIN, " ")
    role, has_channel, channel = rest.partition(CHANNEL)
    # NOTE: after the channel's name, at most a content type (` json`, `<|constrain|>json`)
    words = channel.split()
    if len(found) > 1 or role.split() not in ([], ["assistant"]):
        return None
    if has_channel and not (1 <= len(words) <= 2 and all(map(_WORD.fullmatch, words))):
        return None
    return Header(words[0] if has_channel else None, found[0] if found else None)


class HarmonyStream:
    """Splits harmony output into reasoning, answer and tool calls. `inside`: the prompt opened
    an analysis message (`reasoning.opens_inside`); `tools`: the request offered tools (else a
    call stays text); `reasoning_tokens` counts the tokens of reasoning messages, headers and
    end markers included, as `feed` is told how many tokens each delta holds."""

    def __init__(self, inside: bool = False, tools: bool = False) -> None:
        self.tools = tools
        self.calls = 0
        self.reasoning_tokens = 0
        self._pending = 0  # NOTE: tokens of a header not yet known to open reasoning
        self._buf = ""
        self._kind: str | None = REASONING if inside else None  # NOTE: None: in a header
        self._header = ""  # NOTE: a tool call's header as written, should its body not parse
        self._name = ""
        self._args: list[str] = []
        self._wrote: set[str] = set()  # NOTE: kinds with text, which a next message's follows
        self._sep = ""
        self._out: dict[str, list[str]] = {REASONING: [], ANSWER: [], RAW: []}
        self._calls: list[dict[str, Any]] = []

    def feed(self, text: str, tokens: int = 0) -> Parts:
        """What is final now of the output so far; `tokens`: how many tokens `text` holds."""
        was = self._kind == REASONING
        self._buf += text
        while self._step():
            pass
        parts = self._take()
        self._count(tokens, was, parts)
        return parts

    def finish(self) -> Parts:
        """What is left: a thought cut short is reasoning; a call cut short is a call if its
        arguments parse, else text; a partial marker is text; a header cut short is dropped (it
        holds no text), other unfinished text is text."""
        rest, self._buf = self._buf, ""
        if self._kind is None:
            self._text("" if _cut_header(rest) else rest)
        else:
            self._body(rest)
            if self._kind == TOOL:
                self._end_call(cut=True)
        self._kind = None
        return self._take()

    def _step(self) -> bool:
        """Consume what the buffer holds of one header or body; False: wait for more text."""
        return self._in_header() if self._kind is None else self._in_body()

    def _in_header(self) -> bool:
        buf = self._buf
        at, marker = _first(buf, HEADER_ENDS, len(START) if buf.startswith(START) else 0)
        if _not_header(buf, at):
            # NOTE: text without a header: as written, from its first character (a leading marker
            # is text here, else the body would end at it at once)
            lead = next((m for m in (START, CHANNEL) if buf.startswith(m)), "")
            self._text(lead)
            self._buf, self._kind, self._sep = buf[len(lead) :], RAW, ""
            return True
        if marker is None:
            return False
        head, self._buf = buf[:at], buf[at + len(marker) :]
        if marker == MESSAGE:
            self._open(head, head + marker)
        elif marker == START:
            self._text(head)  # NOTE: a header cut off by the next one's start is text
            self._buf = marker + self._buf
        else:
            self._text(head + marker)  # NOTE: ended before its body: text
        return True

    def _in_body(self) -> bool:
        buf = self._buf
        at, marker = _first(buf, BODY_ENDS)
        if marker is None:
            keep = max(partial_suffix(buf, m) for m in BODY_ENDS)
            self._body(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._body(buf[:at])
        ends = marker in TERMINATORS
        self._buf = buf[at + len(marker) :] if ends else buf[at:]
        self._close(marker if ends else "")
        return True

    def _open(self, header: str, written: str) -> None:
        """A header ended by `<|message|>`: the body that follows goes where it says."""
        kind, name = self._route(parse_header(header))
        self._kind, self._sep = kind, ""
        if kind == TOOL:
            self._header, self._name, self._args = written, name, []
            return
        self._out[RAW].append(written)
        if kind == RAW:
            self._out[ANSWER].append(written)
        elif kind in self._wrote:
            self._sep = "\n"  # NOTE: a second message of the same kind starts on a new line

    def _route(self, header: Header | None) -> tuple[str, str]:
        if header is None:
            return RAW, ""
        to, channel = header.recipient, header.channel
        if to is not None and to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS):
            return (TOOL, to[len(FUNCTIONS) :]) if self.tools else (RAW, "")
        if to is not None or channel == "analysis":
            return REASONING, ""
        if channel in (None, "final", "commentary"):
            return ANSWER, ""
        return RAW, ""

    def _body(self, text: str) -> None:
        if not text:
            return
        kind = self._kind
        assert kind is not None
        if kind == TOOL:
            self._args.append(text)
            return
        self._out[RAW].append(text)
        out = ANSWER if kind == RAW else kind
        self._out[out].append(self._sep + text)
        self._sep = ""
        self._wrote.add(kind)

    def _close(self, marker: str) -> None:
        """A message ended (by `marker`, or "" where the next header began)."""
        if self._kind == TOOL:
            self._end_call(cut=False)
        else:
            self._out[RAW].append(marker)
            if self._kind == RAW:
                self._out[ANSWER].append(marker)
        self._kind = None

    def _end_call(self, cut: bool) -> None:
        args = "".join(self._args).strip()
        if cut and not _parses(args):
            self._text(self._header + "".join(self._args))
            return
        self._calls.append(openai_call(self._name, args, self.calls))
        self.calls += 1

    def _text(self, text: str) -> None:
        """Text that is no message's body, as written: the answer's."""
        self._out[ANSWER].append(text)
        self._out[RAW].append(text)

    def _take(self) -> Parts:
        out, calls = self._out, self._calls
        parts = Parts("".join(out[REASONING]), "".join(out[ANSWER]), calls, "".join(out[RAW]))
        self._out = {REASONING: [], ANSWER: [], RAW: []}
        self._calls = []
        return parts

    def _count(self, tokens: int, was: bool, parts: Parts) -> None:
        """A delta's tokens are reasoning tokens when it wrote reasoning or began or ended
        inside a reasoning message; a header's wait until its body shows what it opened."""
        if was or parts.reasoning or self._kind == REASONING:
            self.reasoning_tokens += tokens + self._pending
            self._pending = 0
        elif self._kind is None:
            self._pending += tokens
        else:
            self._pending = 0


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The earliest marker in `text` from `start`, and where it is."""
    best, found = len(text), None
    for m in markers:
        at = text.find(m, start, best + len(m))
        if 0 <= at < best:
            best, found = at, m
    return best, found


def _not_header(buf: str, end: int) -> bool:
    """Whether a header that ends at `end` (`len(buf)`: not yet) is none: a line break or
    `HEADER_LIMIT` characters come first. NOTE: decided by where they are, not by where the text
    was cut into deltas, so that every cut reads the same."""
    return buf.find("\n", 0, end) >= 0 or end > HEADER_LIMIT


def _cut_header(text: str) -> bool:
    """Whether unfinished header text is a header cut short (max_tokens): it starts as one."""
    return any(text.startswith(m) or m.startswith(text) for m in (START, CHANNEL))


def _parses(args: str) -> bool:
    try:
        json.loads(args)
    except ValueError:
        return False
    return True
