"""OpenAI's Responses API on a launched engine, with the official `openai` client's `responses`
methods: whole and streamed responses, instructions and input items through the chat template,
function tools as `function_call` items and `function_call_output` turns, usage with cached
tokens, the stateless rules, and bad input as a 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401

from engine.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.usefixtures("bounded")
ASK = [{"role": "user", "content": "What time is it?"}]
TOOL = {"type": "function", "name": "f", "description": "the current time", "parameters": {}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def engine(tiny_tool_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("responses") / "launch.log"
    launched = LaunchedEngine(tiny_tool_model_dir, log).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def client(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="unused", max_retries=0)


def test_a_response_matches_the_chat_completion_of_the_same_conversation(client):
    r = client.responses.create(
        model="m", instructions="Be terse.", input=ASK, max_output_tokens=12, temperature=0.0
    )
    chat = client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "Be terse."}, *ASK],
        max_tokens=12,
        temperature=0.0,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    done = chat.choices[0].finish_reason == "stop"
    assert r.status == ("completed" if done else "incomplete")
    if not done:
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_string_input_and_a_streamed_response(client):
    whole = client.responses.create(model="m", input="Hi there", max_output_tokens=8)
    assert whole.output[0].type == "message" and whole.output[0].role == "assistant"
    kwargs = dict(model="m", input="Hi there", max_output_tokens=8, temperature=0.0)
    first = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == first.output_text == events[-1].response.output_text


def test_a_tool_call_is_a_function_call_item(client):
    r = client.responses.create(
        model="m", input=ASK, tools=[TOOL], max_output_tokens=32, temperature=0.0
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "f" and call.arguments == "{}" and call.call_id
    events = list(
        client.responses.create(
            model="m", input=ASK, tools=[TOOL], max_output_tokens=32, temperature=0.0, stream=True
        )
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.type, i.name, i.arguments) for i in done] == [("function_call", "f", "{}")]
    # NOTE: the client's stream helper checks the event order and rebuilds the response (it
    # takes only a completed one: the tool call ends with the model's end token)
    with client.responses.stream(
        model="m", input=ASK, tools=[TOOL], max_output_tokens=32, temperature=0.0
    ) as stream:
        final = stream.get_final_response()
    assert final.status == "completed"
    assert [(o.type, o.name) for o in final.output] == [("function_call", "f")]


def test_a_function_call_output_renders_as_the_template_expects(engine, tiny_tool_model_dir):
    items = [
        *ASK,
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "noon"},
    ]
    body = {"input": items, "tools": [TOOL], "max_output_tokens": 1}
    status, reply = post_json(engine, "/v1/responses", body)
    assert status == 200, reply
    template = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]
    tok = load_tokenizer(tiny_tool_model_dir)
    expected = tok.apply_chat_template(template, add_generation_prompt=True, tools=[CHAT_TOOL])
    assert reply["usage"]["input_tokens"] == len(expected)


def test_a_repeated_input_reports_cached_tokens(client):
    kwargs = dict(model="m", instructions="You know clocks. " * 20, input=ASK, max_output_tokens=2)
    first = client.responses.create(**kwargs)
    again = client.responses.create(**kwargs)
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2


@pytest.mark.parametrize(
    "change,field",
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tool_choice": {"type": "function", "name": "zz"}, "tools": [TOOL]}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
            "text.format",
        ),
        ({"reasoning": {"effort": "max"}}, "reasoning.effort"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(engine, change, field):
    body = {"model": "m", "input": ASK, "max_output_tokens": 4, **change}
    status, reply = post_json(engine, "/v1/responses", body)
    assert status == 400 and reply["error"]["param"] == field, reply


def test_a_json_schema_text_format_gives_parseable_output(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    r = client.responses.create(
        model="m", input=ASK, max_output_tokens=40, temperature=0.0, text={"format": fmt}
    )
    value = json.loads(r.output_text)
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int), value
    assert r.status == "completed" and r.text.format.type == "json_schema"


def test_store_is_accepted_and_nothing_is_kept(engine):
    status, reply = post_json(
        engine, "/v1/responses", {"input": "hi", "store": True, "max_output_tokens": 2}
    )
    assert status == 200 and reply["object"] == "response", reply
    status, _ = post_json(
        engine, "/v1/responses", {"input": "x", "previous_response_id": reply["id"]}
    )
    assert status == 400


def test_input_items_become_the_templates_messages():
    """Unit: instructions first, `developer` as system, text parts joined, a function call on
    the assistant turn before it, its output a `tool` message; function tools nested."""
    from tokenizer_proc.responses_api import parse

    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]  # fmt: skip
    req = parse({"instructions": "Sys.", "input": items, "tools": [TOOL]}, "r", "m", 100)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    assert req.generate.messages == [
        {"role": "system", "content": "Sys."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert req.generate.tools == [CHAT_TOOL]
    assert req.generate.params["max_tokens"] == 100
    assert (
        parse({"input": "x", "tools": [TOOL], "tool_choice": "none"}, "r", "m", 9).generate.tools
        is None
    )
