"""Commands rank 0 broadcasts to every tensor-parallel rank (scheduler_proc/broadcast.py).

Only what changes the scheduler's state crosses: every rank applies the same commands at the same
step, so every rank runs the same steps (docs/distributed.md).
"""

from __future__ import annotations

from engine.messages.admin import AdminCommand
from engine.messages.to_scheduler import Abort, Drain, TokenizedRequest
from engine.protocol import Message


class Exit(Message):
    """Every rank leaves its loop after this iteration (drained, orphaned or told to stop)."""

    reason: str


RankCommand = TokenizedRequest | Abort | Drain | AdminCommand | Exit
