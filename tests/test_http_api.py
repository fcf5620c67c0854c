"""The OpenAI-compatible HTTP API of a launched engine, with the official `openai` package as the
client: chat and completions, whole and streamed, stop strings, seeds, usage, logprobs, greedy
parity with the SDK, bad input of every kind, a client that disconnects, /metrics, shutdown."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401
from prometheus_client.parser import text_string_to_metric_families

from engine.client import EngineClient
from engine.errors import InvalidRequest

pytestmark = pytest.mark.usefixtures("bounded")
NO_EOS = {"extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0.0, **NO_EOS}
HI = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("http") / "launch.log"
    # NOTE: the grace holds the last test's stream (and the engine) open while it reads the
    # 503s; at 2 s a loaded machine saw /health's connection reset: the engine had gone
    extra = ("--max-running-requests", "4", "--max-queued-requests", "4", "--shutdown-grace", "10")
    extra += ("--client-share", "1")  # NOTE: every request here comes from one peer
    launched = LaunchedEngine(tiny_model_dir, log, *extra).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def oai(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def sdk(engine):
    with EngineClient(engine.address, timeout=30.0) as c:
        yield c


def call(
    engine, method: str, path: str, body: Any = None, timeout: float = 10, **headers: str
) -> tuple[int, Any]:
    """One plain HTTP request: (status, decoded JSON body or text)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=timeout)
    headers = {"Content-Type": "application/json", **headers}
    try:
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        raw = r.read().decode()
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, raw


@contextmanager
def open_stream(
    engine, body: dict[str, Any], respond: bool = True
) -> Iterator[http.client.HTTPResponse | None]:
    """A streaming POST /v1/completions; leaving the block closes the connection. The response
    (its headers come with the first token) is awaited only with `respond`."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        yield conn.getresponse() if respond else None
    finally:
        conn.close()


def metrics(engine) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name), parsed by prometheus."""
    status, text = call(engine, "GET", "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def eventually(check, timeout: float = 10.0, state=lambda: None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"condition not reached in time: {state()}"
        time.sleep(0.05)


# --- generation ---------------------------------------------------------------------------------


def test_chat_matches_the_sdk_token_for_token(oai, sdk):
    r = oai.chat.completions.create(model="m", messages=HI, max_tokens=12, **GREEDY)
    ref = sdk.generate(messages=HI, max_tokens=12, temperature=0.0, ignore_eos=True)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_stream_with_usage(oai, sdk):
    stream = oai.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    ref = sdk.generate(messages=HI, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_with_token_ids_match_the_sdk(oai, sdk):
    ids = [17, 4242, 99, 1000, 5]
    r = oai.completions.create(model="m", prompt=ids, max_tokens=8, **GREEDY)
    ref = sdk.generate(input_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ids)
    streamed = oai.completions.create(model="m", prompt=ids, max_tokens=8, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_stop_string(oai):
    full = oai.completions.create(model="m", prompt="Once upon", max_tokens=24, **GREEDY)
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    r = oai.completions.create(model="m", prompt="Once upon", max_tokens=24, stop=stop, **GREEDY)
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(oai):
    def run(seed: int) -> str:
        r = oai.completions.create(
            model="m", prompt="Hi", max_tokens=16, temperature=1.5, seed=seed, **NO_EOS
        )
        return r.choices[0].text

    assert run(7) == run(7)
    assert len({run(7), run(8), run(9)}) > 1


def test_logprobs(oai):
    r = oai.chat.completions.create(
        model="m", messages=HI, max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for lp in content:
        assert lp.logprob <= 0.0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token  # NOTE: greedy: the chosen one is the top one
    c = oai.completions.create(model="m", prompt="Hi", max_tokens=3, logprobs=2, **GREEDY)
    assert len(c.choices[0].logprobs.token_logprobs) == 3
    assert all(len(top) == 2 for top in c.choices[0].logprobs.top_logprobs)


def test_cached_tokens_in_usage(oai):
    prompt = list(range(1000, 1080))
    first = oai.completions.create(model="m", prompt=prompt, max_tokens=2, **GREEDY)
    again = oai.completions.create(model="m", prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object_parse(oai):
    """A random model's reply is JSON of the requested shape, ended when complete ("stop")."""
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    r = oai.chat.completions.create(
        model="m", messages=HI, max_tokens=100, temperature=0.0, response_format=fmt
    )
    person = json.loads(r.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    assert r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=100,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_the_sdk_takes_the_same_constraints(sdk):
    r = sdk.generate(messages=HI, max_tokens=100, temperature=0.0, json_schema=PERSON)
    assert set(json.loads(r.text)) == {"name", "age"} and r.finish_reason == "stop"
    r = sdk.generate("Call", max_tokens=20, regex=r"[A-Z]{3}-\d{2}")
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", r.text), r.text
    with pytest.raises(InvalidRequest) as e:
        sdk.generate("Call", max_tokens=4, regex="a(b")
    assert e.value.field == "regex"


def test_regex_and_grammar_streamed(oai):
    with oai.completions.create(
        model="m",
        prompt="Call",
        max_tokens=30,
        stream=True,
        extra_body={"regex": r"\(\d{3}\) \d{4}"},
    ) as stream:
        text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r"\(\d{3}\) \d{4}", text), text
    r = oai.chat.completions.create(
        model="m",
        messages=HI,
        max_tokens=10,
        temperature=0.0,
        extra_body={"grammar": 'start: "yes" | "no"'},
    )
    assert r.choices[0].message.content in ("yes", "no")


def test_models(oai, tiny_model_dir):
    assert [m.id for m in oai.models.list().data] == [tiny_model_dir.name]


# --- bad input ----------------------------------------------------------------------------------

DEEP_CALL = {"function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
BAD = [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 99}, "n"),
    ({"best_of": 2}, "best_of"),  # NOTE: completions only, as OpenAI's
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
        "response_format",
    ),
    ({"response_format": {"type": "json_object"}, "regex": "[0-9]+"}, "response_format"),
    ({"regex": "a(b"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"grammar": 'start: "a" start'}, "grammar"),  # NOTE: no end: gives out mid-output
    ({"logit_bias": {"5": 3}}, "logit_bias"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop": 5}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    # NOTE: found by the HTTP fuzzer (tests/reliability), each a 500 before
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"top_k": 2**64}, "top_k"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": 5}]}, "messages[0].tool_calls"),
    (
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [DEEP_CALL]}]},
        "messages[0].tool_calls",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_a_400_naming_them(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=HI, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [[False], [True, 5], [1, 2.5]], ids=["false", "true", "float"])
def test_token_ids_that_are_not_integers_are_a_400(engine, prompt):
    """JSON booleans are Python ints: `{"prompt": [false]}` passed the front door's checks, the
    scheduler dropped the frame it could not decode, and the request was never answered (found
    by the HTTP fuzzer's soak). `prepare.token_ids`, which every entry point passes, refuses
    them."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 1, "stream": True}
    status, reply = call(engine, "POST", "/v1/completions", body, timeout=10)
    assert status == 400 and reply["error"]["param"] == "prompt", reply


def test_malformed_json_oversized_body_and_unknown_route(engine, oai):
    status, reply = call(engine, "POST", "/v1/chat/completions", b"{nope")
    assert status == 400 and reply["error"]["param"] == "body"
    status, reply = call(engine, "POST", "/v1/completions", ["a", "list"])
    assert status == 400 and reply["error"]["param"] == "body"
    big = b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'
    try:
        status, reply = call(engine, "POST", "/v1/completions", big, timeout=30)
        assert status == 413 and reply["error"]["code"] == "request_too_large"
    except (BrokenPipeError, ConnectionResetError):
        pass  # NOTE: the server may answer 413 and close before the whole body is sent
    status, reply = call(engine, "GET", "/v1/nothing")
    assert status == 404 and "error" in reply
    # the engine keeps serving
    assert oai.completions.create(model="m", prompt="a", max_tokens=1).usage.completion_tokens == 1


def test_bodies_too_deep_or_undecodable_are_a_400(engine, oai):
    """Found by the HTTP fuzzer: JSON nested past the parser's recursion limit, and a body whose
    Content-Encoding does not decode, were 500s."""
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, reply = call(engine, "POST", "/v1/completions", deep)
    assert status == 400 and reply["error"]["param"] == "body", reply
    assert "max_nesting_depth" in reply["error"]["message"]
    garbled = call(engine, "POST", "/v1/completions", b"\x01\x02not deflate", **{
        "Content-Encoding": "deflate"})  # fmt: skip
    assert garbled[0] == 400 and garbled[1]["error"]["param"] == "body", garbled
    assert oai.completions.create(model="m", prompt="a", max_tokens=1).usage.completion_tokens == 1


def test_too_long_a_prompt_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt=[5] * 9000, max_tokens=1)  # NOTE: past 8192
    assert e.value.body["param"] == "prompt"


# --- disconnects, overload, health, metrics -----------------------------------------------------


def test_a_client_that_disconnects_mid_stream_aborts_its_request(engine):
    before = metrics(engine)
    body = {"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with open_stream(engine, body) as r:
        assert r.status == 200 and r.readline().startswith(b"data: ")
    # NOTE: the connection is closed here, mid-stream

    def aborted() -> bool:
        m = metrics(engine)
        key = "mlx_engine_requests_finished_total{reason=abort}"
        return m[key] == before[key] + 1 and m["mlx_engine_requests_in_flight"] == 0

    eventually(aborted)
    eventually(lambda: metrics(engine)["mlx_engine_kv_tokens_used"] == 0)


def test_a_client_that_disconnects_while_waiting_aborts_its_request(engine):
    before = metrics(engine)["mlx_engine_requests_finished_total{reason=abort}"]
    body = {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(socket.timeout):
        call(engine, "POST", "/v1/completions", body, timeout=1.0)
    eventually(
        lambda: metrics(engine)["mlx_engine_requests_finished_total{reason=abort}"] == before + 1
    )


def test_overload_is_a_429(engine, oai):
    """4 running + 4 queued fill this engine; one client (every HTTP request here comes from
    one peer) may take all but the last, the reserve for other clients (docs/operations.md,
    "Fair admission"); its next request is refused with 429."""
    body = {"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    streams = [open_stream(engine, body, respond=i < 4) for i in range(7)]
    in_flight = lambda: metrics(engine)["mlx_engine_requests_in_flight"]  # noqa: E731
    try:
        for s in streams[:4]:
            assert s.__enter__().status == 200
        eventually(lambda: metrics(engine)["mlx_engine_requests_running"] == 4)
        for s in streams[4:]:
            s.__enter__()  # NOTE: queued: no token, so no response yet
        eventually(lambda: in_flight() == 7, state=in_flight)
        with pytest.raises(openai.RateLimitError) as e:
            oai.completions.create(model="m", prompt="Hi", max_tokens=1)
        assert e.value.status_code == 429 and e.value.body["code"] == "overloaded"
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    eventually(lambda: in_flight() == 0)


def test_health(engine):
    assert call(engine, "GET", "/health") == (200, {"status": "ok", "detail": ""})
    before = metrics(engine)["mlx_engine_requests_received_total"]
    assert call(engine, "GET", "/health_generate", timeout=40)[0] == 200
    assert metrics(engine)["mlx_engine_requests_received_total"] == before + 1


def test_metrics_move_with_traffic(engine, oai):
    before = metrics(engine)
    oai.completions.create(model="m", prompt=[1, 2, 3], max_tokens=5, **GREEDY)
    after = metrics(engine)
    assert after["mlx_engine_prompt_tokens_total"] == before["mlx_engine_prompt_tokens_total"] + 3
    gen = "mlx_engine_generation_tokens_total"
    assert after[gen] == before[gen] + 5
    length = "mlx_engine_requests_finished_total{reason=length}"
    assert after[length] == before[length] + 1
    for name in ("time_to_first_token", "e2e_request_latency"):
        key = f"mlx_engine_{name}_seconds_count"
        assert after[key] == before[key] + 1
    assert after["mlx_engine_inter_token_latency_seconds_count"] >= (
        before["mlx_engine_inter_token_latency_seconds_count"] + 4
    )
    assert after["mlx_engine_steps_launched_total"] > before["mlx_engine_steps_launched_total"]
    assert after["mlx_engine_kv_tokens_total"] > 0


def test_shutting_down_is_a_503(engine, oai, sdk):
    """Last in this module: it stops the module's engine."""
    body = {"prompt": "Hi", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    events: list[str] = []

    def read() -> None:
        with open_stream(engine, body) as r:
            events.extend(line.decode().strip() for line in r if line.strip())

    reader = threading.Thread(target=read)
    reader.start()
    eventually(lambda: metrics(engine)["mlx_engine_requests_running"] == 1)
    sdk.shutdown()
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(model="m", prompt="Hi", max_tokens=1)
    assert e.value.status_code == 503 and e.value.body["code"] == "shutting_down"
    status, reply = call(engine, "GET", "/health")
    assert status == 503 and reply == {"status": "unhealthy", "detail": "shutting down"}
    reader.join(30)
    assert events[-1] == "data: [DONE]" and '"error"' in events[-2]
    assert engine.wait(timeout=20) == 0
