"""Tool calling over HTTP: tools reach the chat template, and a tool call in the model's output
comes back as `tool_calls` (whole, or streamed as deltas), parsed with mlx-lm's parser."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401
from tool_model import ANSWER

from engine.client import AsyncEngineClient, EngineClient
from engine.errors import InvalidRequest
from engine.inprocess import InProcessEngine
from engine.tokenizer_loader import load_tokenizer
from tokenizer_proc.tool_calls import ToolCallStream

pytestmark = pytest.mark.usefixtures("bounded")
ASK = [{"role": "user", "content": "What time is it?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "the current time",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@pytest.fixture(scope="module")
def engine(tiny_tool_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools") / "launch.log"
    launched = LaunchedEngine(tiny_tool_model_dir, log).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def oai(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="unused", max_retries=0)


def test_tools_reach_the_template(oai, tiny_tool_model_dir):
    tok = load_tokenizer(tiny_tool_model_dir)
    expected = tok.apply_chat_template(ASK, add_generation_prompt=True, tools=TOOLS)
    with_tools = oai.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=1, temperature=0.0
    )
    without = oai.chat.completions.create(model="m", messages=ASK, max_tokens=1, temperature=0.0)
    assert with_tools.usage.prompt_tokens == len(expected) > without.usage.prompt_tokens


def test_a_tool_call_comes_back_parsed(oai):
    r = oai.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "f" and json.loads(call.function.arguments) == {}


def test_a_tool_call_streams_as_a_delta(oai):
    chunks = list(
        oai.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "f"
    assert "".join(d.content or "" for d in deltas) == ""  # NOTE: the markup is not content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_text_is_content(oai):
    r = oai.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0.0)
    assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
    # NOTE: tool_choice none: the template gets no tools, so the model is not offered any
    none = oai.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=32, temperature=0.0
    )
    assert none.usage.prompt_tokens == r.usage.prompt_tokens
    assert none.choices[0].message.content == ANSWER


def test_a_tool_result_message_renders(oai):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    r = oai.chat.completions.create(
        model="m", messages=history, tools=TOOLS, max_tokens=1, temperature=0.0
    )
    assert r.usage.prompt_tokens > 0


# --- the SDK --------------------------------------------------------------------------------------


def _tool_call_through_the_sdk(client: EngineClient, tool_model_dir: Path) -> None:
    expected = load_tokenizer(tool_model_dir).apply_chat_template(
        ASK, add_generation_prompt=True, tools=TOOLS
    )
    r = client.generate(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0)
    assert r.usage.prompt_tokens == len(expected) and r.text == ANSWER
    assert r.finish_reason == "stop"
    streamed = client.stream(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0)
    assert "".join(c.text for c in streamed) == ANSWER
    without = client.generate(messages=ASK, max_tokens=1, temperature=0.0)
    assert without.usage.prompt_tokens < len(expected)
    for bad in ([{"type": "function"}], [5], {"type": "function"}):
        with pytest.raises(InvalidRequest) as e:
            client.generate(messages=ASK, tools=bad, max_tokens=1)
        assert e.value.field == "tools"
    with pytest.raises(InvalidRequest) as e:
        client.generate(prompt="hi", tools=TOOLS, max_tokens=1)
    assert e.value.field == "tools"


def test_the_sdk_passes_tools_to_the_template(engine, tiny_tool_model_dir):
    with EngineClient(engine.address, timeout=30.0) as client:
        _tool_call_through_the_sdk(client, tiny_tool_model_dir)


def test_the_in_process_engine_passes_tools_to_the_template(tiny_tool_model_dir):
    transport = InProcessEngine(str(tiny_tool_model_dir), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=30.0) as client:
        _tool_call_through_the_sdk(client, tiny_tool_model_dir)


def test_the_async_sdk_passes_tools_to_the_template(engine):
    async def scenario() -> tuple[str, str]:
        async with AsyncEngineClient(engine.address, timeout=30.0) as client:
            r = await client.generate(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0)
            chunks = client.stream(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0)
            return r.text, "".join([c.text async for c in chunks])

    assert asyncio.run(scenario()) == (ANSWER, ANSWER)


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
def test_the_stream_parser_at_every_split(tiny_tool_model_dir, prefix):
    tok = load_tokenizer(tiny_tool_model_dir)
    text = prefix + ANSWER + " done"
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(len(text), cut + 3)):
            s = ToolCallStream(tok.tool_call_start, tok.tool_call_end, tok.tool_parser, TOOLS)
            pieces = [s.feed(text[:cut]), s.feed(text[cut:cut2]), s.feed(text[cut2:]), s.finish()]
            content = "".join(p[0] for p in pieces)
            calls = [c for p in pieces for c in p[1]]
            assert content == prefix + " done", (cut, cut2)
            assert [c["function"]["name"] for c in calls] == ["f"]


def test_an_unterminated_or_broken_call_stays_text(tiny_tool_model_dir):
    tok = load_tokenizer(tiny_tool_model_dir)
    s = ToolCallStream(tok.tool_call_start, tok.tool_call_end, tok.tool_parser, TOOLS)
    assert s.feed("<tool_call>{not json") == ("", [])
    assert s.finish() == ("<tool_call>{not json", [])
