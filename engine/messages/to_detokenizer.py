"""Messages the detokenizer process receives on its PULL socket (all from the scheduler).

One sender keeps every request's messages in order: `Register` before its first `StepOutputs`,
`Heartbeat` / `SchedulerStats` / `RequestFailed` forwarded to the tokenizer as they come, and
`SchedulerExited` last of all.
"""

from __future__ import annotations

import msgspec

from engine.messages.to_client import FinishReason, TokenLogprob
from engine.messages.to_tokenizer import Heartbeat, RequestFailed, SchedulerStats
from engine.protocol import Message


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request since its last output; `finish_reason` set on its last one.

    NOTE: the detokenizer turns it into a `to_client.Chunk` with the same fields plus the text.
    """

    rid: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    error: str | None = None  # why, when finish_reason is "error"


class Register(Message):
    """A request was admitted: its stop strings (the detokenizer's job, not the scheduler's)."""

    rid: str
    stop: list[str] = []


class StepOutputs(Message):
    outputs: list[StepOutput]


class SchedulerExited(Message):
    """The scheduler's last message: every request got its terminal output."""


ToDetokenizer = (
    Register | StepOutputs | Heartbeat | SchedulerStats | RequestFailed | SchedulerExited
)
