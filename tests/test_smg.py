"""Two engines behind Shepherd Model Gateway (smg), started with the command line
`mlx-engine supervisor-conf --router smg` writes (mlx_engine/router_conf.py), all on loopback:
smg registers them without a warning and reads their load; streamed chat, completions and
messages through smg are the bytes a direct call gets; the names a client sends an engine work
through smg; a client that leaves aborts its request on the engine; multi-turn sessions keep
their prefix-cache hits; and when one engine is killed, its streams end with an error while new
requests go to the other.

The engines take a key, as engines on other hosts must: smg passes it on (and probes /health
bare). The module's engines are shared; the kill test ends one of them, so it comes last.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_harness import LaunchedEngine, free_ports

from mlx_engine import router_conf

pytest.importorskip("smg", reason="smg has wheels for Linux x86_64 and macOS arm64 only")

START_S = 60.0
SESSIONS = 64
TURNS = 3
# NOTE: a turn's prompt: the shared system prompt, then the session's history
SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i}" for i in range(60))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# NOTE: keyed, as engines on other hosts must be (a non-loopback bind needs a key): smg asks its
# clients for the key and sends it to the engines
KEY = "fleet-key-41"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json", **AUTH}


class Smg:
    """smg on loopback in its own process group, in front of `workers`."""

    def __init__(self, workers: list[str], model: str, log_path: Path) -> None:
        self.port = free_ports(2)[0]  # NOTE: smg's metrics take the port above
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = router_conf.smg_command(workers, model, port=self.port, api_key=KEY)
        self._log = open(log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self) -> str:
        return ANSI.sub("", self.log_path.read_text())

    def wait_ready(self, n: int) -> Smg:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                workers = get_json(self.port, "/workers")["workers"]
            except OSError:
                workers = []
            if sum(w["is_healthy"] and w["status"] == "ready" for w in workers) == n:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"smg did not register {n} workers:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory) -> Iterator[tuple[list[LaunchedEngine], Smg]]:
    tmp = tmp_path_factory.mktemp("smg")
    engines = [
        LaunchedEngine(tiny_model_dir, tmp / f"engine{i}.log", "--api-key", KEY) for i in range(2)
    ]
    router = None
    try:
        for e in engines:
            e.wait_ready()
        model = get_json(engines[0].http_port, "/v1/models")["data"][0]["id"]
        router = Smg([e.http for e in engines], model, tmp / "smg.log").wait_ready(2)
        yield engines, router
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


# --- HTTP helpers ---------------------------------------------------------------------------------


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=AUTH)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def post(port: int, path: str, body: Any, timeout: float = 60) -> tuple[int, dict, bytes]:
    """(status, headers, the whole body, streamed or not)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), JSON)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def flush(engine: LaunchedEngine) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    try:
        conn.request("POST", "/flush_cache", headers=AUTH)  # NOTE: the owner's key
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def counters(engine: LaunchedEngine) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=AUTH)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and value:
            out[name] = float(value)
    return out


def served_by(headers: dict, engines: list[LaunchedEngine]) -> LaunchedEngine:
    """The engine smg sent a request to (it names it in a response header)."""
    url = headers["x-smg-routed-worker-id"]
    return next(e for e in engines if e.http == url)


# NOTE: what differs between any two calls to the same engine: the reply's id and its time
UNIQUE = [
    (re.compile(rb'"(id|item_id)":"[^"]*"'), b'"id":"-"'),
    (re.compile(rb'"created(_at)?":\d+'), b'"created":0'),
]


def same_but_ids(a: bytes, b: bytes) -> bool:
    for pattern, repl in UNIQUE:
        a, b = pattern.sub(repl, a), pattern.sub(repl, b)
    return a == b


# --- registration and the engine's own names --------------------------------------------------


def test_smg_registers_the_engines_without_a_warning_and_reads_their_load(fleet):
    engines, router = fleet
    warnings = [
        line
        for line in router.log().splitlines()
        if (" WARN " in line or " ERROR " in line) and "smg::posture" not in line
    ]
    # NOTE: smg::posture warns that the gateway itself takes no key: its own setting
    assert warnings == []
    for worker in get_json(router.port, "/workers")["workers"]:
        assert worker["labels"]["served_model_name"] == worker["model_id"]
        # NOTE: an engine smg cannot identify is "generic" (warned above) and its load unread
        assert worker["runtime_type"] == "vllm"
    # NOTE: smg polls /v1/loads on its load-monitor interval (10 s by default)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        loads = get_json(router.port, "/loads")["loads"]
        if len(loads) == 2 and all(w["max_total_num_tokens"] > 0 for w in loads):
            break
        time.sleep(0.5)
    assert len(loads) == 2 and all(w["max_total_num_tokens"] > 0 for w in loads), loads


STREAMS = [
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Tell me about the sea"}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("/v1/completions", {"prompt": "Once upon a", "max_tokens": 24, "stream": True, "seed": 3}),
    (
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 24,
            "stream": True,
            "temperature": 0,
        },
    ),
    (
        "/v1/responses",
        {"input": "Hi", "max_output_tokens": 24, "stream": True, "temperature": 0.0},
    ),
]


@pytest.mark.parametrize("path,body", STREAMS, ids=["chat", "completions", "messages", "responses"])
def test_a_stream_through_smg_is_the_stream_of_a_direct_call(fleet, path, body):
    engines, router = fleet
    model = get_json(router.port, "/v1/models")["data"][0]["id"]
    body = {**body, "model": model}
    for e in engines:  # NOTE: the same prefix-cache state for both calls (usage reports hits)
        flush(e)
    status, headers, routed = post(router.port, path, body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    engine = served_by(headers, engines)
    flush(engine)
    status, _, direct = post(engine.http_port, path, body)
    assert status == 200
    assert routed.endswith(b"data: [DONE]\n\n") or re.search(rb"message_stop|response\.inc", routed)
    assert same_but_ids(routed, direct), (routed[:600], direct[:600])


@pytest.mark.parametrize("name", ["default", "served"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_the_names_a_client_sends_an_engine_work_through_smg(fleet, name, path):
    engines, router = fleet
    served = get_json(engines[0].http_port, "/v1/models")["data"][0]["id"]
    model = served if name == "served" else "default"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status, _, direct = post(engines[0].http_port, path, body)
    status_smg, _, routed = post(router.port, path, body)
    assert status == 200 and status_smg == 200, routed
    # NOTE: smg sends the name it routed by, the served one
    assert json.loads(routed)["model"] == served


def test_a_client_that_leaves_smg_aborts_its_request_on_the_engine(fleet):
    engines, router = fleet
    before = {e.http: counters(e) for e in engines}
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    body = {"model": "default", "prompt": "On and on", "max_tokens": 8000, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON)
    r = conn.getresponse()
    engine = served_by({k.lower(): v for k, v in r.getheaders()}, engines)
    assert r.readline().startswith(b"data: ")
    conn.close()  # NOTE: mid-stream: smg closes its connection to the engine
    aborted = 'mlx_engine_requests_finished_total{reason="abort"}'
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = counters(engine)
        if (
            now[aborted] > before[engine.http][aborted]
            and now["mlx_engine_requests_in_flight"] == 0
        ):
            return
        time.sleep(0.1)
    pytest.fail(f"the engine did not abort the request: {now}")


# --- prefix-cache affinity -----------------------------------------------------------------------


def _sessions(seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(500)]
    return [
        [" ".join(rng.choices(words, k=rng.randint(20, 40))) for _ in range(TURNS)]
        for _ in range(SESSIONS)
    ]


async def _chat(port: int, sessions: list[list[str]], concurrency: int = 16) -> list[str]:
    """Every session's turns in order, `concurrency` sessions at a time; the errors."""
    import aiohttp

    errors: list[str] = []
    gate = asyncio.Semaphore(concurrency)

    async def one(turns: list[str], http: aiohttp.ClientSession) -> None:
        history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        async with gate:
            for text in turns:
                history.append({"role": "user", "content": text})
                body = {"model": "default", "messages": history, "max_tokens": 8}
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions", json=body
                ) as r:
                    reply = await r.json()
                if r.status != 200:
                    errors.append(str(reply))
                    return
                history.append(
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
                )

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, headers=AUTH) as http:
        await asyncio.gather(*(one(s, http) for s in sessions))
    return errors


def _hit_rate(
    engines: list[LaunchedEngine], port: int, sessions: list[list[str]]
) -> tuple[float, list[float]]:
    """Prompt tokens the engines' prefix caches served over all prompt tokens, for `sessions`
    sent to `port`; and each engine's share of the prompt tokens."""
    for e in engines:
        flush(e)
    before = [counters(e) for e in engines]
    assert asyncio.run(_chat(port, sessions)) == []
    after = [counters(e) for e in engines]

    def delta(name: str) -> list[float]:
        return [a[name] - b[name] for a, b in zip(after, before, strict=True)]

    hits, prompt = (
        delta("mlx_engine_prefix_cache_hit_tokens_total"),
        delta("mlx_engine_prompt_tokens_total"),
    )
    return sum(hits) / sum(prompt), [p / sum(prompt) for p in prompt]


def test_sessions_through_smg_keep_their_prefix_cache_hits(fleet):
    engines, router = fleet
    alone, _ = _hit_rate(engines[:1], engines[0].http_port, _sessions(1))
    routed, shares = _hit_rate(engines, router.port, _sessions(2))
    split = " / ".join(f"{s:.2f}" for s in shares)
    print(f"prefix-cache hit rate: one engine {alone:.3f}, two through smg {routed:.3f} ({split})")
    assert alone > 0.5  # NOTE: the workload repeats most of each prompt
    assert routed >= 0.9 * alone
    # NOTE: and smg did spread them: cache_aware spills a session to the less busy engine when
    # the one holding its prefix is much busier (16 sessions at a time make it so)
    assert min(shares) >= 0.1


# --- an engine killed ----------------------------------------------------------------------------


def _stream(port: int, body: dict, out: dict) -> None:
    """One stream read to its end in a thread: its engine, its bytes, and when it ended."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), JSON)
        r = conn.getresponse()
        out["worker"] = r.getheader("x-smg-routed-worker-id")
        data = b""
        while line := r.readline():
            data += line
            out["started"] = True
        out["data"] = data
    except Exception as e:  # NOTE: any way the stream ends is recorded, never a hang
        out["raised"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        conn.close()


def test_an_engine_killed_fails_its_streams_and_the_other_serves_new_requests(fleet):
    engines, router = fleet
    outs: list[dict] = [{} for _ in range(4)]
    body = {"model": "default", "max_tokens": 7000, "ignore_eos": True}
    # NOTE: daemons: the streams on the surviving engine end when the module's engines stop
    threads = [
        threading.Thread(
            target=_stream, args=(router.port, {**body, "prompt": f"{i} " * 9}, o), daemon=True
        )
        for i, o in enumerate(outs)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not all(o.get("started") for o in outs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(o.get("started") for o in outs), outs
    victim = next(e for e in engines if e.http == outs[0]["worker"])
    other = next(e for e in engines if e is not victim)
    killed = time.monotonic()
    victim.stop()  # NOTE: SIGKILL to the launcher's process group, then its children
    served = None
    while served is None and time.monotonic() - killed < 5:
        status, headers, _ = post(
            router.port, "/v1/completions", {**body, "prompt": "new", "max_tokens": 4}, timeout=5
        )
        if status == 200:
            served = time.monotonic() - killed
            assert headers["x-smg-routed-worker-id"] == other.http
    assert served is not None, "no request was served within 5 s of the kill"
    for _ in range(10):  # NOTE: and from then on, every one
        status, headers, _ = post(
            router.port, "/v1/completions", {**body, "prompt": "more", "max_tokens": 4}, timeout=5
        )
        assert status == 200 and headers["x-smg-routed-worker-id"] == other.http
    lost = [o for o in outs if o["worker"] == victim.http]
    for o in lost:
        o_thread = threads[outs.index(o)]
        o_thread.join(10)
        assert not o_thread.is_alive(), "a stream of the killed engine hangs"
        assert o["ended"] - killed < 10
        # NOTE: smg ends the stream with an error event (a client SDK raises it), not [DONE] alone
        events = [
            json.loads(x[6:]) for x in o.get("data", b"").splitlines() if x.startswith(b"data: {")
        ]
        assert "raised" in o or "error" in events[-1], o.get("data", b"")[-400:]
