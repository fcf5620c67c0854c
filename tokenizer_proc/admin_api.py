"""HTTP routes that operate a running engine, named as SGLang names them so tools written for it
work: pause and continue, new weights from disk, LoRA adapters, the prefix cache, model info.

They change the engine for every client, so they take the owner's key (`--api-key`) or, without
one, the owner's control token (engine/control_token.py) as `Authorization: Bearer`; a client key
of `--api-keys-file` is not enough. Answers are JSON with SGLang's `success` and `message` beside
what the operation reports; a failure carries OpenAI's `error` object too, with the status of its
typed error (400 a bad field, 503 shutting down, ...).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, get_args

import msgspec
from aiohttp import web

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequest, Unauthorized
from engine.messages import admin as ops
from tokenizer_proc.core import NO_TOKEN, FrontDoor
from tokenizer_proc.http_errors import error_object, json_response
from tokenizer_proc.operations import Operations

Handler = Callable[[web.Request], Awaitable[web.Response]]
ReadBody = Callable[[web.Request, EngineConfig], Awaitable[Any]]


class AdminApi:
    def __init__(
        self, core: FrontDoor, operations: Operations, config: EngineConfig, read_body: ReadBody
    ) -> None:
        """`read_body`: the HTTP API's JSON body reader (its size and time limits)."""
        self.core, self.operations, self.config = core, operations, config
        self._read_body = read_body

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/pause_generation", self._route(_pause, "Generation paused.")),
            web.post("/continue_generation", self._route(_empty(ops.ContinueGeneration), "")),
            web.post("/update_weights_from_disk", self._route(_update, "Weights updated.")),
            web.post("/load_lora_adapter", self._route(_load_adapter, "Adapter loaded.")),
            web.post("/unload_lora_adapter", self._route(_unload_adapter, "Adapter unloaded.")),
            web.post("/flush_cache", self._route(_empty(ops.FlushCache), "Cache flushed.")),
            web.get("/flush_cache", self._route(_empty(ops.FlushCache), "Cache flushed.")),
            web.get("/get_model_info", self._route(_empty(ops.GetModelInfo), "")),
        ]

    def _route(self, parse: Callable[[dict[str, Any]], ops.AdminOp], message: str) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            try:
                self._check_owner(request)
                op = parse(await self._body(request))
                info = await self.operations.run(op)
            except EngineError as e:
                return _failure(e)
            text = message or ("Generation continues." if info.get("was_paused") else "ok")
            return json_response(msgspec.json.encode({"success": True, "message": text, **info}))

        return handle

    def _check_owner(self, request: web.Request) -> None:
        if not self.core.control_ok(request.get("key")):
            raise Unauthorized(
                "this route needs the engine's --api-key" if self.config.api_key else NO_TOKEN
            )

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON object of a POST (an empty body is `{}`); a GET's query parameters."""
        if request.method == "GET" or not request.can_read_body:
            return dict(request.query)
        body = await self._read_body(request, self.config)
        if not isinstance(body, dict):
            raise InvalidRequest("body", "must be a JSON object")
        return body


def _failure(e: EngineError) -> web.Response:
    status, error = error_object(e)
    body = {"success": False, "message": str(e), "error": error}
    return json_response(msgspec.json.encode(body), status)


# --- bodies -> operations ------------------------------------------------------------------------


def _empty(make: Callable[[], ops.AdminOp]) -> Callable[[dict[str, Any]], ops.AdminOp]:
    """An operation without arguments: whatever the body holds is ignored."""
    return lambda body: make()


def _pause(body: dict[str, Any]) -> ops.AdminOp:
    mode = _choice(body, "mode", get_args(ops.PauseMode), "abort")
    new_requests = _choice(body, "new_requests", get_args(ops.WhilePaused), "queue")
    return ops.PauseGeneration(mode, new_requests)  # type: ignore[arg-type]


def _update(body: dict[str, Any]) -> ops.AdminOp:
    abort = body.get("abort_all_requests", False)
    if not isinstance(abort, bool):
        raise InvalidRequest("abort_all_requests", "must be true or false")
    return ops.UpdateWeights(_text(body, "model_path"), abort)


def _load_adapter(body: dict[str, Any]) -> ops.AdminOp:
    name = body.get("lora_name", "")
    if not isinstance(name, str):
        raise InvalidRequest("lora_name", "must be a string")
    return ops.LoadAdapter(_text(body, "lora_path"), name)


def _unload_adapter(body: dict[str, Any]) -> ops.AdminOp:
    name = body.get("lora_name", "")
    if not isinstance(name, str):
        raise InvalidRequest("lora_name", "must be a string")
    return ops.UnloadAdapter(name)


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(field, "required: a non-empty string")
    return value


def _choice(body: dict[str, Any], field: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(field, default)
    if value not in allowed:
        raise InvalidRequest(field, f"must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)
