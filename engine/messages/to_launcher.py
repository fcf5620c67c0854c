"""Messages the launcher receives on its private PULL socket."""

from __future__ import annotations

from engine.protocol import Message


class Ready(Message):
    """A child finished starting; `facts` carry what the next children need (model dir, limits)."""

    process: str
    pid: int
    facts: dict[str, str | int | float] = {}


class StartFailed(Message):
    process: str
    error: str


class ShutdownRequested(Message):
    """An SDK client called `shutdown()`; the launcher runs the same path as SIGTERM."""

    reason: str


ToLauncher = Ready | StartFailed | ShutdownRequested
