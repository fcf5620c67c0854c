"""Typed errors shared by the SDK, the processes and the in-process engine."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine reports to a caller."""


class InvalidRequest(EngineError):
    """A request field is missing, malformed or out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Overloaded(EngineError):
    """The engine's request queue is full; retry later."""


class Paused(EngineError):
    """Generation is paused (`pause_generation` with new_requests="refuse"); retry after the
    operator continues it."""


class ShuttingDown(EngineError):
    """The engine is shutting down and takes no new requests."""


class EngineDead(EngineError):
    """An engine process died or the engine cannot be reached."""


class Timeout(EngineError):
    """No answer within the caller's deadline."""


class Unauthorized(EngineError):
    """The client did not present the engine's API key (`--api-key`)."""


class ModelError(EngineError):
    """A model file or directory cannot be used (missing, unsupported, corrupt)."""


class ProtocolMismatch(EngineError):
    """The client and the engine speak different wire protocol versions."""
