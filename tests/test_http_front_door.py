"""The HTTP API over a real front door without an engine behind it: what the engine would
answer is injected as its real wire messages, for cases no live engine produces on demand."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from engine.config import EngineConfig
from engine.ipc import Endpoints
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.messages.to_launcher import SchedulerFacts
from tokenizer_proc.http_api import HttpApi
from tokenizer_proc.server import TokenizerServer


def front_door(tmp_path: Path, **options: Any) -> TokenizerServer:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        config = EngineConfig(zmq_port=s.getsockname()[1], **options).validate()
    facts = SchedulerFacts("", "m", vocab_size=100, max_context=64)
    # NOTE: token-id prompts never reach the tokenizer; none is needed
    return TokenizerServer(config, Endpoints.create(config, tmp_path), None, facts, print)


@contextlib.asynccontextmanager
async def _served(
    tmp_path: Path, **options: Any
) -> AsyncIterator[tuple[TokenizerServer, TestClient]]:
    """A front door with its HTTP API on a test server; both closed on the way out."""
    frontend = front_door(tmp_path, **options)
    client = TestClient(TestServer(HttpApi(frontend).app))
    await client.start_server()
    try:
        yield frontend, client
    finally:
        await client.close()
        frontend.close()


async def _admitted(frontend: TokenizerServer) -> str:
    while not len(frontend.table):
        await asyncio.sleep(0.01)
    return frontend.table.rids()[0]


def test_a_refusal_before_the_first_token_gets_its_status_not_a_200(tmp_path):
    """The scheduler may refuse an admitted request (its own queue bound, a drain that began):
    a stream that has sent nothing yet answers with the refusal's status."""

    async def scenario() -> tuple[int, dict]:
        async with _served(tmp_path) as (frontend, client):
            body = {"prompt": [1, 2], "stream": True, "max_tokens": 4}
            reply = asyncio.create_task(client.post("/v1/completions", json=body))
            rid = await _admitted(frontend)
            failed = tt.RequestFailed(tc.Failure(rid, "overloaded", "4 requests already waiting"))
            await frontend._on_engine(failed)
            resp = await asyncio.wait_for(reply, 10)
            return resp.status, await resp.json()

    status, body = asyncio.run(scenario())
    assert status == 429 and body["error"]["code"] == "overloaded", body


def test_a_stream_sends_headers_with_its_first_token(tmp_path):
    async def scenario() -> list[str]:
        async with _served(tmp_path) as (frontend, client):
            body = {"prompt": [1, 2], "stream": True, "max_tokens": 2}
            reply = asyncio.create_task(client.post("/v1/completions", json=body))
            rid = await _admitted(frontend)
            chunks = [
                tc.Chunk(rid, text="a", token_ids=[5]),
                tc.Chunk(rid, text="b", token_ids=[6], finish_reason="length", completion_tokens=2),
            ]
            await frontend._on_engine(tt.Chunks(chunks))
            resp = await asyncio.wait_for(reply, 10)
            assert resp.status == 200
            return [line for line in (await resp.text()).splitlines() if line]

    events = asyncio.run(scenario())
    assert events[-1] == "data: [DONE]" and '"text":"a"' in events[0] and len(events) == 4


def test_a_caller_gone_while_its_prompt_is_tokenized_leaves_no_entry(tmp_path, tiny_model_dir):
    """An HTTP client that disconnects while its long prompt is tokenized on the thread pool
    aborts it (as the HTTP handler does on its way out); its table entry (an admission slot)
    must go with it once the tokenization ends, and nothing reaches the scheduler."""
    from engine.tokenizer_loader import load_tokenizer

    async def scenario() -> tuple[int, bool]:
        frontend = front_door(tmp_path)
        frontend.tokenizer = load_tokenizer(tiny_model_dir)
        frontend.core.settings = replace(
            frontend.core.settings, max_context=10**6, vocab_size=49152
        )
        try:
            msg = tt.Generate("long", prompt="word " * 100_000, params={"max_tokens": 1})
            entry = await frontend.submit(msg, ("http", "long"), "peer:127.0.0.1")
            await _admitted(frontend)
            frontend.abort("long", ("http", "long"))
            await asyncio.gather(*frontend._tasks)  # NOTE: the pooled tokenization ends
            await asyncio.sleep(0.05)
            return len(frontend.table), entry.sent
        finally:
            frontend.close()

    assert asyncio.run(scenario()) == (0, False)


def test_the_body_limit_is_the_option_and_a_413_naming_it(tmp_path):
    """`--max-body-bytes`: a body one byte over it is a 413 in OpenAI's format naming the option,
    declared (Content-Length) or not (chunked); one at the limit is read and judged (a 400 here:
    its field is unknown)."""

    def body(size: int) -> bytes:
        head = b'{"pad": "'
        return head + b"x" * (size - len(head) - 2) + b'"}'

    async def chunked(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 100):
            yield data[i : i + 100]

    async def scenario() -> list[tuple[int, dict]]:
        async with _served(tmp_path, max_body_bytes=1000) as (_, client):
            out = []
            for data in (body(1001), chunked(body(1001)), body(1000)):
                resp = await client.post("/v1/completions", data=data)
                out.append((resp.status, (await resp.json())["error"]))
            return out

    (over, over_chunked, at) = asyncio.run(scenario())
    for status, error in (over, over_chunked):
        assert status == 413 and error["code"] == "request_too_large", error
        assert error["param"] == "body" and error["type"] == "invalid_request_error"
        assert "max_body_bytes=1000 (--max-body-bytes)" in error["message"], error
    assert "1001 bytes" in over[1]["message"]
    assert at[0] == 400 and at[1]["param"] == "pad", at


def test_a_stream_whose_client_reset_it_ends_quietly(tmp_path, caplog):
    """Found by the HTTP fuzzer: a client that resets its connection mid-stream while the rest
    of its stream is already queued (the handler runs before the reset is noticed, so it is not
    cancelled) made the last write raise, logged as an unhandled error with a traceback."""
    body = b'{"prompt": [1, 2], "stream": true, "max_tokens": 3}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    request = head.encode() + body

    async def scenario() -> int:
        async with _served(tmp_path) as (frontend, client):
            # NOTE: blocking socket calls: the loop (and so the server) waits while they run
            sock = socket.create_connection(("127.0.0.1", client.server.port))
            sock.sendall(request)
            rid = await _admitted(frontend)
            await frontend._on_engine(tt.Chunks([tc.Chunk(rid, text="a", token_ids=[5])]))
            await asyncio.sleep(0.1)
            assert sock.recv(10) == b"HTTP/1.1 2"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # NOTE: unread bytes and linger 0: a reset
            rest = [tc.Chunk(rid, text="b", token_ids=[6]), tc.Chunk(rid, finish_reason="length")]
            await frontend._on_engine(tt.Chunks(rest))
            await asyncio.sleep(0.2)
            return len(frontend.table)

    with caplog.at_level(logging.INFO):
        assert asyncio.run(scenario()) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert "HTTP client gone mid-stream" in caplog.text


def test_a_body_that_stops_coming_is_a_408_after_the_client_timeout(tmp_path):
    """A client that stops sending mid-body held its connection and handler for good (found
    by the HTTP fuzzer's truncated bodies); it now gets `--client-timeout`, as a silent SDK
    client does."""

    async def scenario() -> tuple[bytes, bytes, float]:
        async with _served(tmp_path, client_timeout=0.5) as (_, client):
            reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
            )
            start = time.monotonic()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            waited = time.monotonic() - start
            length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
            body = await reader.readexactly(length)
            writer.close()
            return head, body, waited

    head, body, waited = asyncio.run(scenario())
    assert head.startswith(b"HTTP/1.1 408"), head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["param"] == "body", error
    assert "--client-timeout" in error["message"] and 0.4 < waited < 5, (error, waited)


def test_a_client_gone_mid_body_ends_quietly(tmp_path, caplog):
    """A client that hangs up before its body is complete: the body's read fails (the timeout
    around it once turned that into an unhandled ConnectionResetError with a traceback)."""

    async def scenario() -> int:
        async with _served(tmp_path) as (frontend, client):
            for _ in range(3):
                _, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"
                )
                await asyncio.sleep(0.1)
                writer.close()
                await asyncio.sleep(0.1)
            return len(frontend.table)

    with caplog.at_level(logging.INFO):
        assert asyncio.run(scenario()) == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_a_reply_in_the_background_is_held_until_it_is_sent(tmp_path):
    """A stats reply runs as a task beside the loops; the front door holds it until it ends (the
    event loop keeps only a weak reference: an unheld task may be collected mid-way, its reply
    never sent)."""
    import gc

    async def scenario() -> int:
        frontend = front_door(tmp_path)
        try:
            await frontend._on_call(b"client", tt.GetStats("s1"))
            gc.collect()
            held = len(frontend._tasks)
            for future in frontend._stats_calls.values():
                future.set_result({})  # NOTE: the scheduler's answer
            await asyncio.gather(*frontend._tasks)
            return held
        finally:
            frontend.close()

    assert asyncio.run(scenario()) == 1
