"""The one admission of every request: the tokenizer process's front door, the in-process engine
and `OfflineEngine` all call it, so a limit added here holds for all three (they had three copies
of this order, free to drift apart).

In order: `admit` runs the front door's checks (engine state, rid, the client's fair share), the
cheap input limits (`limits.check_generate`; a forced tool call's grammar), the sampling
parameters and the stop-string limits, every refusal counted by the core; then `token_ids`, on
the caller's thread or a pool (`pooled`), compiles a constraint and tokenizes (the chat template),
the prompt checked against the model's vocabulary and context. A failure after `admit` goes
through `fail`, which takes the request out of the core's table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from engine import constraints
from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequest
from engine.messages.to_tokenizer import Generate
from engine.sampling_params import SamplingParams
from tokenizer_proc import effort, limits, prepare, reasoning, reply_split, tool_choice
from tokenizer_proc.core import FrontDoor
from tokenizer_proc.reply_split import ReplySplit
from tokenizer_proc.requests import Entry
from tokenizer_proc.shared_heads import SharedHeads

log = logging.getLogger("tokenizer")

# NOTE: short inputs tokenize in tens of microseconds; a thread hop would cost more than it saves.
INLINE_CHARS = 2048


@dataclass(frozen=True)
class Admitted:
    params: SamplingParams
    chars: int  # characters of prompt text (messages and tools included), for `pooled`


class Admission:
    def __init__(self, core: FrontDoor, config: EngineConfig, tokenizer: Any) -> None:
        """`tokenizer`: None where every prompt comes as token ids (`OfflineEngine`)."""
        self.core, self.config, self.tokenizer = core, config, tokenizer
        self.heads = SharedHeads()
        self.markers = reasoning.markers_of(tokenizer, config.reasoning_parser)

    def admit(self, msg: Generate, entry: Entry) -> Admitted:
        """Admitted into the core's table, or the typed error that refused it (counted)."""
        chars = 0

        def screen() -> None:  # NOTE: the cheap limits, before any slow work
            nonlocal chars
            chars = limits.check_generate(msg, self.config, self.core.settings.max_context)
            if msg.tool_choice is not None:
                tool_choice.force(msg, self.tokenizer)
            level = effort.check(msg.reasoning_effort)
            if level is not None and msg.messages is not None:
                msg.chat_template_kwargs = effort.template_kwargs(level, msg.chat_template_kwargs)

        params = self.core.admit(msg, entry, screen)
        try:
            limits.check_stop(params, self.config)
            params = self._thought(self._effort(params, msg.reasoning_effort))
        except EngineError as e:
            self.core.fail(msg.rid, e)
            raise
        return Admitted(params, chars)

    def splitter(self, msg: Generate) -> ReplySplit | None:
        """An SDK request's reasoning and tool-call split (`reply_split.for_sdk`); `begin` it
        with `opens_inside` once the prompt is known."""
        if self.tokenizer is None:
            return None
        if msg.tools is not None:
            tool_choice.check_tools(msg.tools)  # NOTE: before a parser reads them (400, named)
        return reply_split.for_sdk(msg, self.tokenizer, self.markers)

    def opens_inside(self, ids: list[int]) -> bool:
        """Whether the prompt `ids` left the model inside a thought."""
        return reasoning.opens_inside(ids, self.markers)

    def for_prompt(self, params: SamplingParams, ids: list[int]) -> SamplingParams:
        """The params the scheduler gets for this prompt: a thinking budget's count starts
        inside a thought when the prompt opened one (`reasoning.opens_inside`)."""
        if params.think_budget is None:
            return params
        inside = reasoning.opens_inside(ids, self.markers)
        return msgspec.structs.replace(params, think_inside=inside)

    def _effort(self, params: SamplingParams, level: str | None) -> SamplingParams:
        """A reasoning effort's budget, for a thinking model (`_thinks`) whose request set none
        itself; any other model takes the effort and changes nothing."""
        if level is None or params.think_budget is not None or not self._thinks():
            return params
        tokens = effort.budget(level, params.max_tokens)
        return params if tokens is None else msgspec.structs.replace(params, think_budget=tokens)

    def _thinks(self) -> bool:
        """Whether the model has the one-token think markers a budget needs."""
        m = self.markers
        return m is not None and len(m.start_ids) == 1 and len(m.end_ids) == 1

    def _thought(self, params: SamplingParams) -> SamplingParams:
        """A thinking budget gets the model's think markers (one token each, which the
        scheduler counts and forces); a model without them is a 400 naming `think_budget`."""
        if params.think_budget is None:
            return params
        m = self.markers
        if m is None or not self._thinks():
            raise InvalidRequest("think_budget", "needs a thinking model (one-token think markers)")
        ids = {"think_start_id": m.start_ids[0], "think_end_id": m.end_ids[0]}
        return msgspec.structs.replace(params, **ids)

    def pooled(self, msg: Generate, admitted: Admitted) -> bool:
        """Whether `token_ids` is slow enough for a worker thread: long text, many messages, or
        a constraint to compile (a 190 KB schema: 0.36-0.65 s)."""
        return slow_text(msg, admitted.chars) or admitted.params.constrained

    def token_ids(self, msg: Generate, params: SamplingParams) -> prepare.Prompt:
        """The prompt's token ids (its constraint compiled first), and what of it a chat shares
        with other conversations where the scheduler asks (`DoorSettings.snapshot_hits`);
        `InvalidRequest` naming the field, or whatever the tokenizer raised (`fail` types it)."""
        if params.constrained:
            constraints.check(params)
        limit = self.core.settings
        return prepare.prompt(
            msg,
            self.tokenizer,
            limit.vocab_size,
            limit.max_context,
            shared=self.heads if limit.snapshot_hits else None,
        )

    def fail(self, rid: str, error: Exception) -> EngineError:
        """An admitted request failed before the scheduler took it: out of the table, counted;
        the typed error for its caller."""
        error = typed(rid, error)
        self.core.fail(rid, error)
        return error


def slow_text(msg: Generate, chars: int) -> bool:
    """Text slow to tokenize: many characters, or many messages."""
    # NOTE: every string counts (a huge value outside `content` templates as slowly), and each
    # message costs the template a loop turn.
    work = chars + 64 * len(msg.messages or ())
    return msg.input_ids is None and work >= INLINE_CHARS


def typed(rid: str, error: Exception) -> EngineError:
    if isinstance(error, EngineError):
        return error
    # NOTE: as in the scheduler: an unexpected failure fails this request alone, typed.
    log.error("rid=%s tokenization failed", rid, exc_info=error)
    return EngineError(f"{type(error).__name__}: {error}")
