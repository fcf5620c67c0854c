"""The utility endpoints agents and UIs use: `/tokenize` and `/detokenize` (vLLM's shapes, the
chat template on request) and `GET /v1/models/{id}` (the `openai` client's `models.retrieve`)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401

from engine.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.usefixtures("bounded")
CHAT = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("utility") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def test_tokenize_a_prompt_and_a_chat(engine, tok):
    status, reply = post_json(engine, "/tokenize", {"prompt": "Hello there"})
    assert status == 200, reply
    assert reply["tokens"] == list(tok.encode("Hello there")) and reply["count"] == len(
        reply["tokens"]
    )
    assert reply["max_model_len"] > 0
    status, reply = post_json(engine, "/tokenize", {"messages": CHAT})
    assert status == 200, reply
    assert reply["tokens"] == list(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    status, bare = post_json(
        engine, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}
    )
    assert bare["tokens"] == list(tok.apply_chat_template(CHAT, add_generation_prompt=False))
    assert bare["count"] < reply["count"]


def test_detokenize_gives_back_the_text(engine, tok):
    ids = list(tok.encode("Hello there, friend"))
    status, reply = post_json(engine, "/detokenize", {"tokens": ids})
    assert status == 200 and reply["prompt"] == tok.decode(ids), reply


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": "yes"}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(engine, path, body, field):
    status, reply = post_json(engine, path, body)
    assert status == 400 and reply["error"]["param"] == field, reply


def test_models_retrieve(engine):
    client = openai.OpenAI(base_url=engine.http + "/v1", api_key="unused", max_retries=0)
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("some-other-model")
