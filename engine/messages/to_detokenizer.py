"""Messages the detokenizer process receives on its PULL socket (all from the scheduler).

One sender keeps every request's messages in order: `Register` before its first `StepOutputs`,
`Heartbeat` / `SchedulerStats` / `RequestFailed` forwarded to the tokenizer as they come, and
`SchedulerExited` last of all.
"""

from __future__ import annotations

from engine.messages.admin import AdminDone
from engine.messages.to_client import Chunk
from engine.messages.to_tokenizer import Heartbeat, RequestFailed, SchedulerStats
from engine.protocol import Message


class Register(Message):
    """A request was admitted: its stop strings (the detokenizer's job, not the scheduler's)."""

    rid: str
    stop: list[str] = []


class StepOutputs(Message):
    """One scheduler step's `Chunk`s, token ids only (`text` empty until the detokenizer)."""

    outputs: list[Chunk]


class SchedulerExited(Message):
    """The scheduler's last message: every request got its terminal output."""


ToDetokenizer = (
    Register
    | StepOutputs
    | Heartbeat
    | SchedulerStats
    | AdminDone
    | RequestFailed
    | SchedulerExited
)
