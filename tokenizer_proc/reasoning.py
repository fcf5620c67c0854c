"""A thinking model's reasoning kept apart from its answer, as the text streams.

Text between the model's think markers (`<think>` / `</think>` and the others mlx-lm infers
from the vocabulary: `TokenizerWrapper.think_start` / `think_end`) is reasoning; the rest is the
answer, which the tool-call parser then reads. A chat template may open the thought itself (the
generation prompt ends with the start marker: DeepSeek-R1, Qwen3's thinking-only models), so the
stream starts inside it when the prompt's last marker is a start (`opens_inside`). A model that
speaks gpt-oss's harmony format has channels instead (tokenizer_proc/harmony.py): its markers
say so (`Markers.harmony`), and its analysis channel is what `opens_inside` looks for.

Pure and incremental like `tool_calls.ToolCallStream`: `feed()` each text delta, `finish()` at
the end; text that could still be the start of a marker is held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizer_proc import harmony
from tokenizer_proc.call_text import partial_suffix

PARSERS = ("auto", "harmony", "none")


@dataclass(frozen=True)
class Markers:
    """A model's think markers, as text and as token ids."""

    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    harmony: bool = False  # NOTE: the model speaks harmony: its replies are parsed by channel


def markers_of(tokenizer: Any, parser: str) -> Markers | None:
    """The model's think markers under `--reasoning-parser`: auto (harmony's when the model
    speaks it, else the tokenizer's, when it has them), harmony, none (reasoning stays in the
    answer's text)."""
    if parser == "none" or tokenizer is None:
        return None
    if parser == "harmony" or (parser == "auto" and harmony.speaks(tokenizer)):
        return _harmony_markers(tokenizer)
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    start_ids, end_ids = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if not (start and end and start_ids and end_ids):
        return None
    return Markers(start, end, tuple(start_ids), tuple(end_ids))


def _harmony_markers(tokenizer: Any) -> Markers:
    """Harmony's analysis message as think markers: its header opens the thought, `<|end|>`
    ends it (as a prompt is searched for them; the reply itself is parsed by channel)."""
    start, end = harmony.ANALYSIS, harmony.END
    ids = [tuple(tokenizer.encode(m, add_special_tokens=False)) for m in (start, end)]
    return Markers(start, end, ids[0], ids[1], harmony=True)


# NOTE: a template opens the thought at the very end of its generation prompt; only that far back
# is searched (a scan of a 100k-token prompt in Python would hold the front door's loop)
TAIL_TOKENS = 64


def opens_inside(ids: Sequence[int], markers: Markers | None) -> bool:
    """Whether a prompt leaves the model inside a thought: its last marker (within its last
    `TAIL_TOKENS` tokens) is a start."""
    if markers is None:
        return False
    tail = ids[-TAIL_TOKENS:]
    start = _rfind(tail, markers.start_ids)
    return start >= 0 and start > _rfind(tail, markers.end_ids)


def _rfind(ids: Sequence[int], seq: tuple[int, ...]) -> int:
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == seq:
            return i
    return -1


class ReasoningStream:
    """Splits generated text into (reasoning, answer); `inside`: the prompt opened the thought.

    One thought, where a reply starts: once it ended, or the answer began, a think marker is
    text. A tool call's argument or an answer about these models' own markup may spell
    `<think>`; read as a thought's start it swallowed the rest of the reply."""

    def __init__(self, markers: Markers, inside: bool = False) -> None:
        self.markers = markers
        self.inside = inside
        self._buf = ""
        self._lead = False  # NOTE: right after a thought: the template's blank line is dropped
        self._answering = False  # NOTE: the thought is over (or there was none): all is answer

    def feed(self, text: str) -> tuple[str, str]:
        """Reasoning and answer text that are final now."""
        self._buf += text
        reasoning: list[str] = []
        answer: list[str] = []
        if self._answering:
            self._take(self._buf, reasoning, answer)
            self._buf = ""
        while self._buf:
            marker = self.markers.end if self.inside else self.markers.start
            at = self._buf.find(marker)
            if at < 0:
                at = len(self._buf) - partial_suffix(self._buf, marker)
                self._take(self._buf[:at], reasoning, answer)
                self._buf = self._buf[at:]
                break
            self._take(self._buf[:at], reasoning, answer)
            if self._answering:  # NOTE: answer text came first: this start marker is text
                self._take(self._buf[at:], reasoning, answer)
                self._buf = ""
                break
            self._buf = self._buf[at + len(marker) :]
            self._lead = self.inside
            self._answering = self.inside
            self.inside = not self.inside
            if self._answering:
                self._take(self._buf, reasoning, answer)
                self._buf = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is left (a partial marker is text): reasoning if the thought never ended."""
        reasoning: list[str] = []
        answer: list[str] = []
        self._take(self._buf, reasoning, answer)
        self._buf = ""
        return "".join(reasoning), "".join(answer)

    def _take(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        if self.inside:
            reasoning.append(text)
            return
        if self._lead:
            text = text.lstrip("\n")
            self._lead = not text
        self._answering = self._answering or bool(text.strip())
        answer.append(text)
