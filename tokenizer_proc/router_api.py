"""What a router in front of several engines asks each of them, beside the serving routes: which
engine and model this is, and how loaded it is (docs/distributed.md, "Scale out").

Named and shaped as routers know them from other engines, so that Shepherd Model Gateway (smg)
registers an engine without a warning and reads its load: `GET /version` (vLLM's: smg takes an
engine that answers it for an OpenAI-compatible server and then reads `/v1/loads`, else vLLM's
metric names), `GET /server_info` and `/model_info` (SGLang's; smg reads them from engines it
takes for SGLang, and its own `/get_server_info` asks a worker's `/get_server_info`), and
`GET /v1/loads` (SGLang's load report, which smg prefers over scraping `/metrics`). They take a
client's key like any serving route; nothing here changes the engine.
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from aiohttp import web

from tokenizer_proc.http_errors import json_response
from tokenizer_proc.router_metrics import kv_usage
from tokenizer_proc.server import TokenizerServer

ENGINE = "mlx-engine"


def engine_version() -> str:
    try:
        return version(ENGINE)
    except PackageNotFoundError:  # NOTE: run from a source tree that was never installed
        return "0+unknown"


class RouterApi:
    def __init__(self, frontend: TokenizerServer) -> None:
        self.fe = frontend
        self.core = frontend.core

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/version", self._version),
            web.get("/server_info", self._server_info),
            web.get("/get_server_info", self._server_info),
            web.get("/model_info", self._model_info),
            web.get("/v1/loads", self._loads),
        ]

    async def _version(self, request: web.Request) -> web.Response:
        return _json({"version": engine_version()})

    async def _server_info(self, request: web.Request) -> web.Response:
        """The limits a router sizes its routing by (SGLang's field names)."""
        settings, config = self.core.settings, self.fe.config
        stats = await self.fe.stats()
        body = {
            "engine": ENGINE,
            "version": engine_version(),
            "model_path": config.model or settings.model,
            "served_model_name": settings.model,
            "context_length": settings.max_context,
            "max_total_tokens": int(stats.get("kv_tokens_total", 0)),
            "max_running_requests": settings.running_slots,
            "tp_size": config.tp,
            "dp_size": 1,
            "pp_size": 1,
            "is_embedding": False,
        }
        return _json(body)

    async def _model_info(self, request: web.Request) -> web.Response:
        settings = self.core.settings
        body = {
            "model_path": self.fe.config.model or settings.model,
            "served_model_name": settings.model,
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "lora_adapter": self.core.metrics.adapter,
        }
        return _json(body)

    async def _loads(self, request: web.Request) -> web.Response:
        """One rank's load (an engine is one data-parallel rank, whatever its --tp); the
        `include` query is taken as given: the core section is all there is."""
        stats = await self.fe.stats()
        total = int(stats.get("kv_tokens_total", 0))
        load = {
            "dp_rank": 0,
            "num_running_reqs": int(stats.get("running", 0)),
            "num_waiting_reqs": int(stats.get("waiting", 0)),
            "num_total_reqs": int(stats.get("requests_in_flight", 0)),
            "num_used_tokens": int(stats.get("kv_tokens_in_use", 0)),
            "max_total_num_tokens": total,
            "token_usage": kv_usage(stats),
            "cache_hit_rate": float(stats.get("prefix_cache_hit_rate", 0.0)),
            "max_running_requests": self.core.settings.running_slots,
        }
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return _json({"timestamp": stamp, "dp_rank_count": 1, "loads": [load]})


def _json(body: dict[str, Any]) -> web.Response:
    return json_response(msgspec.json.encode(body))
