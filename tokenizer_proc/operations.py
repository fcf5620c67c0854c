"""The front door's side of operating a running engine (engine/messages/admin.py): each call is a
round trip to the scheduler, answered by its `AdminDone` after the outputs it waited for.

Used by the SDK endpoint (tokenizer_proc/server.py) and the HTTP routes
(tokenizer_proc/admin_api.py) alike; what is paused is kept in the core (`FrontDoor.paused`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from engine.errors import EngineError, Timeout
from engine.messages import admin as ops
from engine.wire_errors import to_exception
from tokenizer_proc.core import FrontDoor

# NOTE: a model change waits for running requests to finish, then loads; beyond this the caller
# hears Timeout (the operation itself goes on in the scheduler, and `get_model_info` tells).
OPERATION_TIMEOUT_S = 900.0


class Operations:
    def __init__(self, core: FrontDoor, send: Callable[[ops.AdminCommand], None]) -> None:
        self.core = core
        self._send = send
        self._calls: dict[str, asyncio.Future[ops.AdminDone]] = {}

    async def run(self, op: ops.AdminOp, timeout: float = OPERATION_TIMEOUT_S) -> dict[str, Any]:
        """Run `op` in the scheduler; its answer, or the typed error it failed with."""
        rid = f"admin-{uuid.uuid4().hex}"
        future: asyncio.Future[ops.AdminDone] = asyncio.get_running_loop().create_future()
        self._calls[rid] = future
        self.core.operation_sent(op)
        info: dict[str, Any] | None = None
        try:
            self._send(ops.AdminCommand(rid, op))
            done = await asyncio.wait_for(future, timeout)
            if done.failure is not None:
                raise to_exception(done.failure)
            info = dict(done.info)
            return info
        except asyncio.TimeoutError:
            raise Timeout(f"{type(op).__name__} not done within {timeout:g}s") from None
        finally:
            self._calls.pop(rid, None)
            self.core.operation_done(op, info)

    def done(self, msg: ops.AdminDone) -> None:
        future = self._calls.get(msg.rid)
        if future is not None and not future.done():
            future.set_result(msg)

    def fail_all(self, error: EngineError) -> None:
        """The engine died or drained: nobody waits for an answer that cannot come."""
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
