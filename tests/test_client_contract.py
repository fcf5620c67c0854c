"""One client contract, two engines: the in-process transport and a launched multi-process engine.

Every test here runs against both (same methods, same typed errors).
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_harness import LaunchedEngine, bounded, reference_greedy  # noqa: F401

import engine.client as client_module
from engine.client import AsyncEngineClient, EngineClient
from engine.errors import EngineError, InvalidRequest, ProtocolMismatch
from mlx_engine.inprocess import InProcessEngine

TIMEOUT = 60.0
pytestmark = pytest.mark.usefixtures("bounded")


@pytest.fixture(scope="module", params=["inprocess", "multiprocess"])
def engine(request, tiny_model_dir: Path, tmp_path_factory):
    """(kind, address or transport factory) of a running engine on the tiny model."""
    if request.param == "inprocess":
        transport = InProcessEngine(str(tiny_model_dir))
        yield "inprocess", transport
        transport.close()
        return
    log = tmp_path_factory.mktemp("engine") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log).wait_ready()
    yield "multiprocess", launched
    launched.stop()


def _client(engine) -> EngineClient:
    kind, target = engine
    if kind == "inprocess":
        return EngineClient(transport=_Borrowed(target), timeout=TIMEOUT)
    return EngineClient(target.address, timeout=TIMEOUT)


def _async_client(engine) -> AsyncEngineClient:
    kind, target = engine
    if kind == "inprocess":
        return AsyncEngineClient(transport=_Borrowed(target), timeout=TIMEOUT)
    return AsyncEngineClient(target.address, timeout=TIMEOUT)


class _Borrowed:
    """A module-scoped in-process transport shared by clients: closing a client keeps it."""

    def __init__(self, transport: InProcessEngine) -> None:
        self._t = transport

    def __getattr__(self, name: str):
        return getattr(self._t, name)

    def close(self) -> None:
        pass


@pytest.fixture
def client(engine):
    c = _client(engine)
    yield c
    c.close()


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    rng = random.Random(5)
    lens = [1, 2, 3, 5, 8, 13, 16, 17, 21, 30, 34, 55, 64, 89, 100, 144]
    return [([rng.randrange(49152) for _ in range(n)], rng.randint(6, 16)) for n in lens]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, workload) -> list[list[int]]:
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model_dir)
    return [reference_greedy(model, ids, n) for ids, n in workload]


def _greedy(ids: list[int], n: int) -> dict:
    return {"input_ids": ids, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}


# --- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("streaming", [False, True], ids=["generate", "stream"])
def test_greedy_parity_16_concurrent(client, workload, reference, streaming):
    def run(job: tuple[list[int], int]) -> list[int]:
        if not streaming:
            return client.generate(**_greedy(*job)).token_ids
        chunks = list(client.stream(**_greedy(*job)))
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == "length"
        return [t for c in chunks for t in c.token_ids]

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, workload))
    assert got == reference


def test_result_fields(client, workload):
    ids, n = workload[4]
    r = client.generate(**_greedy(ids, n))
    assert r.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == n
    assert len(r.token_ids) == n and isinstance(r.text, str) and r.rid


def test_caller_chosen_rid_and_prompt_text(client):
    r = client.generate(prompt="Hello there", max_tokens=3, temperature=0.0, rid="my-rid-1")
    assert r.rid == "my-rid-1" and r.usage.prompt_tokens > 0 and r.finish_reason == "length"


def test_chat_messages_use_the_template(client, tiny_model_dir):
    from mlx_lm.utils import load_tokenizer

    messages = [{"role": "user", "content": "Hi"}]
    expected = load_tokenizer(tiny_model_dir).apply_chat_template(
        messages, add_generation_prompt=True
    )
    r = client.generate(messages=messages, max_tokens=2, temperature=0.0)
    assert r.usage.prompt_tokens == len(expected)


def test_stop_string_across_token_boundaries(client, workload):
    ids, _ = workload[6]
    full = client.generate(**_greedy(ids, 24))
    pieces = [c.text for c in client.stream(**_greedy(ids, 24))]
    assert "".join(pieces) == full.text
    # NOTE: a stop string made of the end of one token's text and the start of the next.
    boundary = len(pieces[0]) + len(pieces[1]) if len(pieces) > 2 else len(full.text) // 2
    text = full.text
    stop = text[max(0, boundary - 2) : boundary + 2]
    assert len(stop) >= 2, text
    chunks = list(client.stream(**_greedy(ids, 24), stop=[stop]))
    got = "".join(c.text for c in chunks)
    assert got == text[: text.find(stop)]
    assert chunks[-1].finish_reason == "stop"
    assert all(stop not in c.text for c in chunks)


def test_logprobs(client, workload):
    ids, n = workload[3]
    r = client.generate(**_greedy(ids, n), logprobs=3)
    assert len(r.logprobs) == n
    for token, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.logprob <= 0.0 and len(lp.top) == 3
        assert lp.top[0][0] == token  # NOTE: greedy: the chosen token is the most likely one


def test_stop_token_ids(client, workload):
    ids, _ = workload[6]
    full = client.generate(**_greedy(ids, 12))
    target = full.token_ids[3]
    r = client.generate(**_greedy(ids, 12), stop_token_ids=[target])
    assert r.finish_reason == "stop"
    assert r.token_ids == full.token_ids[: full.token_ids.index(target) + 1]


def test_abort_mid_stream(client):
    stream = client.stream(input_ids=[1, 2, 3], max_tokens=3000, temperature=0.0, ignore_eos=True)
    first = next(stream)
    client.abort(first.rid)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in [first, *rest]) < 3000


def test_abandoned_stream_is_aborted(client):
    before = client.stats().get("finish_abort", 0)
    stream = client.stream(input_ids=[4, 5], max_tokens=3000, temperature=0.0, ignore_eos=True)
    next(stream)
    stream.close()  # NOTE: the caller stops reading: the SDK aborts the request
    _eventually(lambda: client.stats().get("finish_abort", 0) == before + 1)


# --- errors -------------------------------------------------------------------------------------

INVALID = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop": "x"}, "stop"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"no_such_option": 1}, "no_such_option"),
]
INVALID_INPUTS = [
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "input_ids": [1]}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids"),
    ({"input_ids": [49152]}, "input_ids"),
    ({"input_ids": [1] * 9000}, "input_ids"),  # NOTE: past the model's 8192
]


def test_every_invalid_field_is_named_and_the_engine_keeps_serving(client):
    for kwargs, field in INVALID:
        with pytest.raises(InvalidRequest) as e:
            client.generate(input_ids=[1, 2], **kwargs)
        assert e.value.field == field, (kwargs, e.value)
    for kwargs, field in INVALID_INPUTS:
        with pytest.raises(InvalidRequest) as e:
            client.generate(max_tokens=2, **kwargs)
        assert e.value.field == field, (kwargs, e.value)
    assert (
        client.generate(input_ids=[1, 2], max_tokens=2, ignore_eos=True).finish_reason == "length"
    )


def test_duplicate_rid_is_refused(client):
    stream = client.stream(input_ids=[1], max_tokens=3000, ignore_eos=True, rid="dup-rid")
    next(stream)
    with pytest.raises(InvalidRequest) as e:
        client.generate(input_ids=[1], max_tokens=1, rid="dup-rid")
    assert e.value.field == "rid"
    stream.close()


# --- health and stats ---------------------------------------------------------------------------


def test_health(client):
    assert client.health() is True


def test_a_protocol_mismatch_is_the_same_clear_error(engine, monkeypatch):
    """One welcome for both engines (the front-door core): the same refusal, worded the same."""
    monkeypatch.setattr(client_module, "PROTOCOL_VERSION", 999)
    with pytest.raises(ProtocolMismatch, match="v999.*use a matching mlx-engine client"):
        _client(engine)


def test_health_generate_goes_through_the_real_path(client):
    _eventually(lambda: client.stats()["requests_in_flight"] == 0)  # NOTE: earlier tests' aborts
    before = client.stats()
    assert client.health_generate() is True
    after = client.stats()
    for key in ("requests_received", "requests_answered", "requests_finished"):
        assert after[key] == before.get(key, 0) + 1, key
    assert after["generated_tokens"] >= before["generated_tokens"] + 1


# --- async ------------------------------------------------------------------------------------


def test_async_client_matches_sync(engine, workload, reference):
    async def main() -> list[list[int]]:
        async with _async_client(engine) as c:
            assert await c.health()
            jobs = [c.generate(**_greedy(ids, n)) for ids, n in workload[:8]]
            results = await asyncio.gather(*jobs)
            streamed = [t async for ch in c.stream(**_greedy(*workload[8])) for t in ch.token_ids]
            return [r.token_ids for r in results] + [streamed]

    assert asyncio.run(asyncio.wait_for(main(), TIMEOUT)) == reference[:9]


def _eventually(check, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_repeated_prompt_reports_cached_tokens(client):
    """The prefix cache's reuse reaches the caller as usage.cached_tokens."""
    prompt = [random.Random(11).randrange(49152) for _ in range(80)]
    first = client.generate(input_ids=prompt, max_tokens=4, temperature=0.0)
    again = client.generate(input_ids=prompt, max_tokens=4, temperature=0.0)
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == len(prompt) - 1  # the last token is always computed
    assert again.token_ids == first.token_ids


def test_a_request_the_scheduler_cannot_take_fails_alone(engine, client, monkeypatch):
    """An unexpected error while submitting one request fails that request with a typed error,
    as the scheduler process does, and the engine keeps serving (in-process only: the fault is
    injected into its scheduler)."""
    kind, target = engine
    if kind != "inprocess":
        pytest.skip("the fault is injected into the in-process scheduler")

    def broken(*args, **kwargs):
        raise ValueError("injected submit failure")

    monkeypatch.setattr(target.sched, "submit", broken)
    with pytest.raises(EngineError, match="ValueError: injected submit failure"):
        client.generate(input_ids=[1, 2], max_tokens=2, timeout=10.0)
    monkeypatch.undo()
    assert client.generate(input_ids=[1, 2], max_tokens=2).finish_reason in ("stop", "length")
