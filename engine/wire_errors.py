"""Typed errors on the wire: an exception becomes a `Failure` message and back, by `kind`."""

from __future__ import annotations

from engine.errors import (
    EngineDead,
    EngineError,
    InvalidRequest,
    Overloaded,
    Paused,
    ProtocolMismatch,
    ShuttingDown,
    Timeout,
    Unauthorized,
)
from engine.messages.to_client import Failure

KINDS: dict[str, type[EngineError]] = {
    "invalid_request": InvalidRequest,
    "overloaded": Overloaded,
    "paused": Paused,
    "shutting_down": ShuttingDown,
    "engine_dead": EngineDead,
    "timeout": Timeout,
    "protocol": ProtocolMismatch,
    "unauthorized": Unauthorized,
}
_NAMES = {cls: name for name, cls in KINDS.items()}


def to_failure(rid: str, exc: EngineError) -> Failure:
    if isinstance(exc, InvalidRequest):
        return Failure(rid, "invalid_request", exc.message, exc.field)
    return Failure(rid, _NAMES.get(type(exc), "engine_error"), str(exc))


def to_exception(failure: Failure) -> EngineError:
    if failure.kind == "invalid_request":
        return InvalidRequest(failure.field or "request", failure.message)
    return KINDS.get(failure.kind, EngineError)(failure.message)
