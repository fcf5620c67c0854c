"""The tokenizer process: the only process clients talk to (see tokenizer_proc.server)."""

from __future__ import annotations

import asyncio

from engine import child
from engine.config import EngineConfig
from engine.ipc import Endpoints
from engine.messages.to_launcher import SchedulerFacts
from engine.tokenizer_loader import load_tokenizer
from tokenizer_proc.trim import keep_large_blocks_mapped


def run(config: EngineConfig, endpoints: Endpoints, parent_pid: int, facts: SchedulerFacts) -> None:
    child.setup("tokenizer", config.log_level)
    keep_large_blocks_mapped()  # NOTE: client inputs of many MB must not pin heap memory
    me = child.Child("tokenizer", endpoints.launcher, parent_pid)
    asyncio.run(_serve(me, config, endpoints, facts))
    me.close()


async def _serve(
    me: child.Child, config: EngineConfig, endpoints: Endpoints, facts: SchedulerFacts
) -> None:
    from tokenizer_proc.http_api import HttpApi
    from tokenizer_proc.server import TokenizerServer

    with me.starting():
        tokenizer = load_tokenizer(facts.model_dir, facts.tokenizer_defaults)
        frontend = TokenizerServer(config, endpoints, tokenizer, facts, me.send_launcher_shutdown)
        # NOTE: bound while starting, so a port in use is a start-up failure the launcher reports.
        http = HttpApi(frontend)
        await http.start(config.host, config.port)
    me.ready()
    try:
        await frontend.serve(me.orphaned)
    finally:
        await http.close()
