"""One streaming OpenAI-HTTP client for every server under test, this engine's included.

Time to first token is stamped on both sides at the same place: when the first chunk with
non-empty text arrives here; inter-token latency is per request, from the first to the last text
(mlx_engine/bench/metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from mlx_engine.bench.workload import Session, Workload


@dataclass
class RequestResult:
    """One request's timeline (perf_counter seconds) and what came back."""

    session: int
    turn: int
    start: float
    end: float = 0.0
    first: float | None = None  # first text chunk
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    text: str = ""


@dataclass(frozen=True)
class Target:
    """A server to measure: its base URL (`http://host:port`) and the fields it needs added."""

    name: str
    url: str
    extra_body: dict[str, Any] = field(default_factory=dict)


def request_body(session: Session, history: list[dict[str, str]], target: Target) -> dict:
    """The JSON body of a session's next turn, `history` holding the earlier turns and replies."""
    body: dict[str, Any] = {"max_tokens": session.max_tokens, "temperature": 0.0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    if session.chat:
        system = [{"role": "system", "content": session.system}] if session.system else []
        body["messages"] = system + history
    else:
        body["prompt"] = history[-1]["content"]
    return body | target.extra_body


async def stream_one(
    http: aiohttp.ClientSession, target: Target, body: dict, result: RequestResult
) -> None:
    """Send one streamed request and fill in `result`; failures land in `result.error`."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    pieces: list[str] = []
    try:
        async with http.post(target.url + path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    _chunk(json.loads(line[5:]), result, pieces)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
        result.text = "".join(pieces)
    if not result.error and not result.completion_tokens:
        result.completion_tokens = len(result.chunk_times)


def _chunk(chunk: dict, result: RequestResult, pieces: list[str]) -> None:
    if "error" in chunk:
        result.error = str(chunk["error"])[:200]
    usage = chunk.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
    for choice in chunk.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if text:
            now = time.perf_counter()
            result.first = result.first or now
            result.chunk_times.append(now)
            pieces.append(text)


@dataclass(frozen=True)
class Load:
    """A closed loop of `concurrency` sessions in flight, or Poisson arrivals at `rate` per
    second with at most `concurrency` in flight."""

    concurrency: int
    rate: float | None = None

    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate else f"concurrency {self.concurrency}"


async def run_load(
    target: Target, work: Workload, load: Load, *, seed: int = 0, bar=None
) -> list[RequestResult]:
    """Run every session of `work` under `load`; the results in the order they were sent."""
    results: list[RequestResult] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    gate = asyncio.Semaphore(load.concurrency)

    async def session(i: int, http: aiohttp.ClientSession) -> None:
        async with gate:
            await _session(i, work.sessions[i], http, target, results, bar)

    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        tasks = []
        gaps = random.Random(seed)
        for i in range(len(work.sessions)):
            if load.rate and i:
                await asyncio.sleep(gaps.expovariate(load.rate))
            tasks.append(asyncio.create_task(session(i, http)))
        await asyncio.gather(*tasks)
    return results


async def _session(
    i: int, s: Session, http: aiohttp.ClientSession, target: Target, results: list, bar
) -> None:
    history: list[dict[str, str]] = []
    for turn, user in enumerate(s.turns):
        history.append({"role": "user", "content": user})
        result = RequestResult(i, turn, time.perf_counter())
        results.append(result)
        await stream_one(http, target, request_body(s, history, target), result)
        if bar is not None:
            bar.update(1)
        if result.error:
            return
        # NOTE: each server continues from its own reply, as a real chat would.
        history.append({"role": "assistant", "content": result.text})


def served_model(url: str) -> dict[str, str]:
    """`{"model": ID}` when a server lists one model at /v1/models, for the requests sent to it: a
    router in front of engines (smg) routes by that name and refuses a request without one. Empty
    otherwise: mlx_lm.server lists every model it could load, and loads the one a request names."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            models = json.loads(resp.read()).get("data") or []
    except (OSError, ValueError):
        return {}
    return {"model": str(models[0]["id"])} if len(models) == 1 else {}


def read_counters(target: Target, names: tuple[str, ...]) -> dict[str, float]:
    """The engine's Prometheus counters `names` (`mlx_engine_<name>_total`) from `/metrics`;
    empty for a server without them (a peer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(target.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = name.removeprefix("mlx_engine_").removesuffix("_total")
        if key in names and name.startswith("mlx_engine_"):
            out[key] = float(value)
    return out
