"""Messages the scheduler process receives on its PULL socket (tokenizer, detokenizer, launcher)."""

from __future__ import annotations

from engine.messages.admin import AdminCommand
from engine.protocol import Message
from engine.sampling_params import SamplingParams


class TokenizedRequest(Message):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    # NOTE: the unit of fair scheduling (tokenizer_proc/core.py `client_of`); "" for the
    # engine's own requests
    client: str = ""
    # NOTE: tokens of the prompt that other conversations share (a chat's leading system
    # messages); where a model that hits only at slot snapshots takes one (0: not known)
    shared: int = 0


class Abort(Message):
    """Stop a request (client gone, client abort, stop string hit); unknown rids are ignored."""

    rid: str


class StatsQuery(Message):
    rid: str


class Drain(Message):
    """Graceful shutdown: finish running requests within `grace` seconds, then abort and exit."""

    grace: float


ToScheduler = TokenizedRequest | Abort | StatsQuery | Drain | AdminCommand
