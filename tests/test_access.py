"""Who may use an engine: the API key on HTTP and ZMQ (control messages included), a refused
non-loopback bind without a key, and a client that tries to abort another client's request."""

from __future__ import annotations

import http.client
import json
import os
import queue
import subprocess
import sys
from pathlib import Path

import msgspec
import openai
import pytest
from engine_harness import LaunchedEngine, bounded, raw_dealer  # noqa: F401

from engine.client import EngineClient
from engine.errors import InvalidRequest, Unauthorized
from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import PROTOCOL_VERSION

pytestmark = pytest.mark.usefixtures("bounded")
KEY = "s3cret-key"
LONG = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("access") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log, "--api-key", KEY).wait_ready()
    yield launched
    launched.stop()


def get(engine, path: str, key: str | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=40)
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    if r.status == 401:
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    return r.status


@pytest.mark.parametrize("path", ["/v1/models", "/health_generate", "/metrics", "/v1/loads"])
def test_http_needs_the_key(engine, path):
    assert get(engine, path, None) == 401
    assert get(engine, path, "wrong") == 401
    assert get(engine, path, KEY) == 200


def test_liveness_answers_without_the_key(engine):
    """Routers and load balancers probe /health bare (smg will not register an engine whose
    /health refuses it); it says ok or why not, nothing else."""
    assert get(engine, "/health", None) == 200
    assert get(engine, "/health", "wrong") == 200


def test_openai_client_with_and_without_the_key(engine):
    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=engine.http + "/v1", api_key=key, max_retries=0)

    with pytest.raises(openai.AuthenticationError):
        client("wrong").completions.create(model="m", prompt="Hi", max_tokens=1)
    r = client(KEY).completions.create(model="m", prompt="Hi", max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_sdk_needs_the_key(engine, monkeypatch):
    monkeypatch.delenv("MLX_ENGINE_API_KEY", raising=False)
    with pytest.raises(Unauthorized):
        EngineClient(engine.address, timeout=10.0)
    with pytest.raises(Unauthorized):
        EngineClient(engine.address, timeout=10.0, api_key="wrong")
    with EngineClient(engine.address, timeout=10.0, api_key=KEY) as c:
        assert c.generate(input_ids=[1, 2], max_tokens=2, ignore_eos=True).finish_reason == "length"
        assert "requests_received" in c.stats()
    monkeypatch.setenv("MLX_ENGINE_API_KEY", KEY)
    with EngineClient(engine.address, timeout=10.0) as c:
        assert c.health()


@pytest.fixture
def raw(engine):
    """A bare DEALER socket: `ask(msg)` sends one message and returns the reply."""
    with raw_dealer(engine.address) as ask:
        yield lambda msg: ask(msgspec.msgpack.encode(msg))


def test_zmq_messages_without_a_welcome_are_refused(raw):
    for msg in (
        tt.Generate("g1", input_ids=[1], params={"max_tokens": 1}),
        tt.HealthCheck("h1"),
        tt.GetStats("s1"),
        tt.ShutdownEngine("x1"),
        tt.AbortRequest("a1", "g1"),
    ):
        reply = raw(msg)
        assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized", (msg, reply)
        assert reply.rid == msg.rid
    assert isinstance(raw(tt.Ping()), tc.Pong)  # NOTE: liveness is open; it reveals nothing


def test_control_messages_carry_the_key_again(raw, engine):
    assert isinstance(raw(tt.Hello("w1", PROTOCOL_VERSION, "wrong")), tc.Failure)
    assert isinstance(raw(tt.Hello("w2", PROTOCOL_VERSION, KEY)), tc.Welcome)
    assert isinstance(raw(tt.HealthCheck("h2")), tc.HealthReply)
    reply = raw(tt.GetStats("s2"))  # NOTE: welcomed, but a control message without the key
    assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized"
    assert isinstance(raw(tt.GetStats("s3", KEY)), tc.StatsReply)
    reply = raw(tt.ShutdownEngine("x2", "wrong"))
    assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized"
    assert get(engine, "/health", KEY) == 200  # still serving: nothing was shut down


def test_a_client_cannot_abort_another_clients_request(engine):
    with (
        EngineClient(engine.address, timeout=30.0, api_key=KEY) as owner,
        EngineClient(engine.address, timeout=30.0, api_key=KEY) as other,
    ):
        stream = owner.stream(input_ids=[3, 4], rid="mine", **LONG)
        first = next(stream)
        with pytest.raises(InvalidRequest) as e:
            other.abort("mine")
        assert e.value.field == "rid" and "another client" in e.value.message
        more = [next(stream) for _ in range(5)]  # NOTE: still running
        assert all(c.finish_reason is None for c in [first, *more])
        other.abort("no-such-request")  # NOTE: an unknown (or finished) rid is a no-op
        owner.abort("mine")
        assert list(stream)[-1].finish_reason == "abort"


def test_a_non_loopback_host_without_a_key_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "mlx_engine.cli", "launch", "--host", "0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENGINE_API_KEY"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "--api-key" in r.stderr and "0.0.0.0" in r.stderr, r.stderr


class _Kept:
    """An in-process transport that a failed client's close() leaves running."""

    def __init__(self, transport) -> None:
        self._t = transport

    def __getattr__(self, name: str):
        return getattr(self._t, name)

    def close(self) -> None:
        pass


def test_the_in_process_engine_applies_the_same_key_rule(tiny_model_dir, monkeypatch):
    from mlx_engine.inprocess import InProcessEngine

    monkeypatch.delenv("MLX_ENGINE_API_KEY", raising=False)
    transport = InProcessEngine(str(tiny_model_dir), api_key=KEY, max_total_tokens=4096)
    try:
        with pytest.raises(Unauthorized):
            EngineClient(transport=_Kept(transport), timeout=10.0)
        c = EngineClient(transport=_Kept(transport), timeout=10.0, api_key=KEY)
        assert c.generate(input_ids=[1, 2], max_tokens=2, ignore_eos=True).finish_reason == "length"
        replies: queue.SimpleQueue[tc.ToClient] = queue.SimpleQueue()
        transport.register("s-no-key", replies.put)
        transport.send(tt.GetStats("s-no-key"))  # NOTE: a control message without the key
        reply = replies.get(timeout=10)
        assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized"
    finally:
        transport.close()


@pytest.fixture(scope="module")
def keyless(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyless") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log).wait_ready()
    yield launched
    launched.stop()


def test_without_a_key_control_messages_need_the_owners_token(keyless):
    """Without --api-key any local process could stop the engine or read its stats; now a raw
    socket's control messages are refused, the launching user's SDK (which reads the token
    file, 0600 in a 0700 directory) still stops it, and generation stays open to all."""
    from engine import control_token

    port = control_token.port_of(keyless.address)
    path = control_token.path_for(port)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    with raw_dealer(keyless.address) as ask:
        raw = lambda msg: ask(msgspec.msgpack.encode(msg))  # noqa: E731
        assert isinstance(raw(tt.Hello("w1", PROTOCOL_VERSION)), tc.Welcome)
        for msg in (tt.ShutdownEngine("x1"), tt.GetStats("s1"), tt.ShutdownEngine("x2", "guess")):
            reply = raw(msg)
            assert isinstance(reply, tc.Failure) and reply.kind == "unauthorized", (msg, reply)
            assert "owner" in reply.message
        reply = raw(tt.Generate("g1", input_ids=[1, 2], params={"max_tokens": 2}))
        assert isinstance(reply, tc.Chunk)
    with EngineClient(keyless.address, timeout=10.0) as c:
        assert c.health() and "requests_received" in c.stats()
        c.shutdown()
    assert keyless.proc.wait(timeout=30) == 0
    assert not path.exists(), "the token outlived its engine"
