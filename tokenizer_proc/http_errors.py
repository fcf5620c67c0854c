"""HTTP error shapes: each engine error's status, and OpenAI's and Anthropic's error bodies."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from engine import errors
from engine.errors import EngineError, InvalidRequest
from tokenizer_proc import anthropic_api


class BodyTooLarge(InvalidRequest):
    """A request body over `--max-body-bytes`: a 413, not a 400."""


class BodyTooSlow(InvalidRequest):
    """A request body still incomplete after `--client-timeout`: a 408."""


# exception type -> (HTTP status, OpenAI error type, code)
STATUS: dict[type[EngineError], tuple[int, str, str | None]] = {
    InvalidRequest: (400, "invalid_request_error", None),
    BodyTooLarge: (413, "invalid_request_error", "request_too_large"),
    BodyTooSlow: (408, "invalid_request_error", "request_timeout"),
    errors.Unauthorized: (401, "authentication_error", "invalid_api_key"),
    errors.Overloaded: (429, "rate_limit_error", "overloaded"),
    errors.Paused: (503, "service_unavailable", "paused"),
    errors.ShuttingDown: (503, "service_unavailable", "shutting_down"),
    errors.EngineDead: (503, "service_unavailable", "engine_dead"),
    errors.Timeout: (504, "timeout", None),
}


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> bytes:
    error = {"message": message, "type": kind, "param": param, "code": code}
    return msgspec.json.encode({"error": error})


# HTTP status -> Anthropic's error type, for the /v1/messages routes
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def status_of(e: EngineError) -> int:
    return STATUS.get(type(e), (500, "server_error", None))[0]


def anthropic_error(message: str, status: int) -> web.Response:
    body = anthropic_api.error_body(message, ANTHROPIC_TYPES.get(status, "api_error"))
    return json_response(msgspec.json.encode(body), status)


def error_object(e: EngineError) -> tuple[int, dict[str, Any]]:
    """An engine error's HTTP status and OpenAI's error object for it."""
    status, kind, code = STATUS.get(type(e), (500, "server_error", None))
    param = e.field if isinstance(e, InvalidRequest) else None
    message = e.message if isinstance(e, InvalidRequest) else str(e)
    return status, {"message": message, "type": kind, "param": param, "code": code}


def error_response(e: EngineError) -> web.Response:
    status, error = error_object(e)
    return json_response(msgspec.json.encode({"error": error}), status)


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json")
