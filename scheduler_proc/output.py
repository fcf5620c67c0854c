"""What the scheduler reports per request per step; sent over the wire as is."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One generated token's logprob and the top-n (id, logprob) pairs of its distribution."""

    logprob: float
    top: list[tuple[int, float]] = []


class StepOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request since its last output; `finish_reason` set on its last one."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop, length, abort, error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    error: str | None = None  # why, when finish_reason is "error"
