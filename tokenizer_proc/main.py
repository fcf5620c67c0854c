"""The tokenizer process: the only process clients talk to (see tokenizer_proc.frontend)."""

from __future__ import annotations

import asyncio
from typing import Any

from engine import child
from engine.config import EngineConfig
from engine.ipc import Endpoints
from engine.tokenizer_loader import load_tokenizer


def run(config: EngineConfig, endpoints: Endpoints, parent_pid: int, facts: dict[str, Any]) -> None:
    child.setup("tokenizer", config.log_level)
    me = child.Child("tokenizer", endpoints.launcher, parent_pid)
    asyncio.run(_serve(me, config, endpoints, facts))
    me.close()


async def _serve(
    me: child.Child, config: EngineConfig, endpoints: Endpoints, facts: dict[str, Any]
) -> None:
    from tokenizer_proc.frontend import Frontend

    with me.starting():
        tokenizer = load_tokenizer(str(facts["model_dir"]), str(facts["tokenizer_defaults"]))
        frontend = Frontend(config, endpoints, tokenizer, facts, me.send_launcher_shutdown)
    me.ready(endpoint=endpoints.client)
    await frontend.serve(me.orphaned)
