"""Anthropic's Messages API on a launched engine, with the official `anthropic` client: whole and
streamed messages, system prompts and content blocks through the chat template, tools as
`tool_use` blocks and `tool_result` turns, stop sequences, cached input tokens, token counting,
`x-api-key`, and bad input answered in Anthropic's error shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401

from engine.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.usefixtures("bounded")
KEY = "sk-test-anthropic"
ASK = [{"role": "user", "content": "What time is it?"}]
TOOL = {"name": "f", "description": "the current time", "input_schema": {"type": "object"}}
NO_TOOL = {"type": "none"}
# NOTE: the client takes sampling fields only as extra body fields
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def engine(tiny_tool_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("anthropic") / "launch.log"
    launched = LaunchedEngine(tiny_tool_model_dir, log, "--api-key", KEY).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def client(engine) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=engine.http, api_key=KEY, max_retries=0, timeout=30)


def post(engine, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    return post_json(engine, path, body, **{"x-api-key": KEY, **headers})


def test_a_message_matches_the_chat_completion_of_the_same_conversation(engine, client):
    """The same template, prompt and greedy tokens as /v1/chat/completions."""
    system = "You are terse."
    msg = client.messages.create(
        model="m", max_tokens=12, system=system, messages=ASK, tool_choice=NO_TOOL, **GREEDY
    )
    oai = openai.OpenAI(base_url=engine.http + "/v1", api_key=KEY, max_retries=0)
    chat = oai.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": system}, *ASK],
        max_tokens=12,
        temperature=0.0,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    total = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert total == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    want = "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    assert msg.stop_reason == want and msg.stop_sequence is None


def test_a_streamed_message_has_the_whole_ones_text(client):
    kwargs = dict(model="m", max_tokens=12, messages=ASK, tool_choice=NO_TOOL, **GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens > 0


def test_a_tool_call_comes_back_as_a_tool_use_block(client):
    msg = client.messages.create(model="m", max_tokens=32, messages=ASK, tools=[TOOL], **GREEDY)
    assert msg.stop_reason == "tool_use"
    (block,) = [b for b in msg.content if b.type == "tool_use"]
    assert block.name == "f" and block.input == {} and block.id
    with client.messages.stream(
        model="m", max_tokens=32, messages=ASK, tools=[TOOL], **GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        ("tool_use", "f", {})
    ]


def test_a_tool_result_turn_renders_as_the_template_expects(client, tiny_tool_model_dir):
    call = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}
    history = [
        *ASK,
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result, {"type": "text", "text": "Thanks"}]},
    ]
    count = client.messages.count_tokens(model="m", messages=history, tools=[TOOL])
    tok = load_tokenizer(tiny_tool_model_dir)
    function = {"name": "f", "description": "the current time", "parameters": {"type": "object"}}
    template = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},
        {"role": "user", "content": "Thanks"},
    ]
    expected = tok.apply_chat_template(
        template, add_generation_prompt=True, tools=[{"type": "function", "function": function}]
    )
    assert count.input_tokens == len(expected)


def test_a_stop_sequence_ends_the_text_and_is_named(client):
    kwargs = dict(model="m", max_tokens=16, messages=ASK, tool_choice=NO_TOOL, **GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    assert len(text) > 4, text
    stop = text[2:4]
    msg = client.messages.create(stop_sequences=[stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]


def test_a_repeated_conversation_reads_its_prefix_from_the_cache(client):
    system = "You answer questions about clocks. " * 20
    kwargs = dict(model="m", max_tokens=2, system=system, messages=ASK, tool_choice=NO_TOOL)
    first = client.messages.create(**kwargs)
    again = client.messages.create(**kwargs)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens > total // 2
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total


def test_count_tokens_counts_the_system_prompt(client):
    bare = client.messages.count_tokens(model="m", messages=ASK).input_tokens
    system = client.messages.count_tokens(model="m", system="Be brief.", messages=ASK)
    assert system.input_tokens > bare > 0


def test_the_api_key_is_checked(engine):
    wrong = anthropic.Anthropic(base_url=engine.http, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="m", max_tokens=1, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "change,field",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0]"),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"temperature": "hot"}, "temperature"),
        ({"container": "x"}, "container"),
        ({"tools": [{"name": 3}]}, "tools[0]"),
    ],
)
def test_bad_input_is_a_400_in_anthropics_shape(engine, change, field):
    body = {"model": "m", "max_tokens": 4, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, reply = post(engine, "/v1/messages", body)
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert field in reply["error"]["message"], reply


def test_headers_a_client_sends_are_accepted(engine):
    body = {"model": "m", "max_tokens": 2, "messages": ASK, "metadata": {"user_id": "u1"}}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    status, reply = post(engine, "/v1/messages", body, **headers)
    assert status == 200 and reply["type"] == "message", reply
    status, reply = post(engine, "/v1/messages/count_tokens", {"messages": "x"})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error"


def test_content_blocks_become_the_templates_messages():
    """Unit: system blocks, tool_use as an assistant tool call, each tool_result a `tool` message
    ahead of its turn's text, an error result marked, tools as functions."""
    from tokenizer_proc.anthropic_api import conversation

    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}
    body = {
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}, call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "no", "is_error": True},
                    {"type": "text", "text": "And?"},
                ],
            },
        ],
        "tools": [TOOL],
    }
    messages, tools = conversation(body)
    function = {"name": "f", "arguments": {"x": 1}}
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [{"id": "t1", "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "42"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no"},
        {"role": "user", "content": "And?"},
    ]
    parameters = {"type": "object"}
    described = {"name": "f", "description": "the current time", "parameters": parameters}
    assert tools == [{"type": "function", "function": described}]
    assert conversation({**body, "tool_choice": {"type": "none"}})[1] is None
