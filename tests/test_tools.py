"""Tool calling over HTTP: tools reach the chat template, and a tool call in the model's output
comes back as `tool_calls` (whole, or streamed as deltas), parsed with mlx-lm's parser."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401
from tool_model import ANSWER

from engine.client import AsyncEngineClient, EngineClient
from engine.errors import InvalidRequest
from engine.tokenizer_loader import load_tokenizer
from mlx_engine.inprocess import InProcessEngine
from tokenizer_proc.tool_calls import BareJsonCalls, ToolCallStream

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


# --- tool_choice: forced calls within the tools' schemas -----------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TWO = [*TOOLS, {"type": "function", "function": {"name": "g", "parameters": CITY}}]
NAMED_G = {"type": "function", "function": {"name": "g"}}
EMPTY = {"type": "object", "properties": {}}


def _check_g(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and args["days"] in (1, 2, 3), args
    assert isinstance(args["city"], str) and len(args["city"]) <= 8, args


def test_a_named_function_is_called_with_arguments_of_its_schema(oai):
    """The model's own answer calls f with {}; naming g makes it call g, its arguments held to
    g's schema, ended when the call is complete."""
    for stream in (False, True):
        kwargs = dict(model="m", messages=ASK, tools=TWO, max_tokens=64, temperature=0.0)
        if stream:
            chunks = list(oai.chat.completions.create(tool_choice=NAMED_G, stream=True, **kwargs))
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            calls = [t for d in deltas for t in d.tool_calls or []]
            assert [t.function.name for t in calls] == ["g"]
            _check_g(calls[0].function.arguments)
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            r = oai.chat.completions.create(tool_choice=NAMED_G, **kwargs)
            calls = r.choices[0].message.tool_calls
            assert [c.function.name for c in calls] == ["g"] and r.choices[
                0
            ].finish_reason == "tool_calls"
            _check_g(calls[0].function.arguments)
            assert not r.choices[0].message.content


def test_required_calls_one_of_the_tools_and_parallel_off_allows_one(oai):
    r = oai.chat.completions.create(
        model="m", messages=ASK, tools=TWO, max_tokens=96, temperature=0.0,
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("f", "g"), calls
    if calls[0].function.name == "g":
        _check_g(calls[0].function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "change,param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_a_tool_choice_that_cannot_be_honoured_is_a_400(oai, change, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="m", messages=ASK, tools=TWO, max_tokens=4, extra_body=change
        )
    assert e.value.body["param"] == param, e.value.body


def test_the_sdk_anthropic_and_responses_apis_force_calls_too(engine):
    with EngineClient(engine.address, timeout=30.0) as client:
        r = client.generate(
            messages=ASK, tools=TWO, max_tokens=64, tool_choice=NAMED_G, parallel_tool_calls=False
        )
        assert [c["function"]["name"] for c in r.tool_calls] == ["g"], (r.text, r.finish_reason)
        _check_g(r.tool_calls[0]["function"]["arguments"])
    tools = [{"name": "f", "input_schema": {"type": "object"}}, {"name": "g", "input_schema": CITY}]
    body = {"model": "m", "max_tokens": 64, "messages": ASK, "tools": tools}
    status, reply = post_json(
        engine,
        "/v1/messages",
        {**body, "tool_choice": {"type": "tool", "name": "g", "disable_parallel_tool_use": True}},
    )
    uses = [b for b in reply["content"] if b["type"] == "tool_use"]
    assert status == 200 and [b["name"] for b in uses] == ["g"], reply
    assert set(uses[0]["input"]) == {"city", "days"} and reply["stop_reason"] == "tool_use"
    fn = [{"type": "function", "name": "g", "parameters": CITY}]
    status, reply = post_json(
        engine, "/v1/responses",
        {"model": "m", "input": ASK, "tools": fn, "tool_choice": "required", "max_output_tokens": 64,
         "parallel_tool_calls": False},
    )  # fmt: skip
    assert status == 200, reply
    calls = [o for o in reply["output"] if o["type"] == "function_call"]
    assert status == 200 and [c["name"] for c in calls] == ["g"], reply
    _check_g(calls[0]["arguments"])


# --- the SDK --------------------------------------------------------------------------------------


def _tool_call_through_the_sdk(client: EngineClient, tool_model_dir: Path) -> None:
    expected = load_tokenizer(tool_model_dir).apply_chat_template(
        ASK, add_generation_prompt=True, tools=TOOLS
    )
    r = client.generate(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0)
    assert r.usage.prompt_tokens == len(expected) and r.text == ""
    assert [c["function"] for c in r.tool_calls] == [{"name": "f", "arguments": "{}"}]
    assert r.finish_reason == "stop" and r.tool_calls[0]["id"].startswith("call_")
    streamed = list(client.stream(messages=ASK, tools=TOOLS, max_tokens=32, temperature=0.0))
    assert "".join(c.text for c in streamed) == ""
    assert [c["function"]["name"] for s in streamed for c in s.tool_calls] == ["f"]
    # NOTE: without tools the same answer is text
    raw = client.generate(messages=ASK, max_tokens=32, temperature=0.0)
    assert "<tool_call>" not in raw.text or not raw.tool_calls
    without = client.generate(messages=ASK, max_tokens=1, temperature=0.0)
    assert without.usage.prompt_tokens < len(expected)
    for bad in ([{"type": "function"}], [5], {"type": "function"}):
        with pytest.raises(InvalidRequest) as e:
            client.generate(messages=ASK, tools=bad, max_tokens=1)
        assert e.value.field == "tools"
    with pytest.raises(InvalidRequest) as e:
        client.generate(prompt="hi", tools=TOOLS, max_tokens=1)
    assert e.value.field == "tools"


def test_a_bad_tool_choice_through_the_sdk_is_refused_by_name(engine, tiny_tool_model_dir):
    """Through the launched SDK endpoint: a typed error naming tool_choice, and the engine
    serves the next request (the parser used to be built outside the admission's try)."""
    with EngineClient(engine.address, timeout=30.0) as client:
        with pytest.raises(InvalidRequest) as e:
            client.generate(messages=ASK, tools=TWO, tool_choice="sometimes", max_tokens=4)
        assert e.value.field == "tool_choice"
        _tool_call_through_the_sdk(client, tiny_tool_model_dir)


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
            streamed = [c async for c in chunks]
            names = [t["function"]["name"] for c in streamed for t in c.tool_calls]
            return r.text, [t["function"]["name"] for t in r.tool_calls], names

    assert asyncio.run(scenario()) == ("", ["f"], ["f"])


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


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, tmp_path_factory):
    """An engine on a model whose template has no tool calling (the default tokenizer's)."""
    log = tmp_path_factory.mktemp("plain-tools") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log).wait_ready()
    yield launched
    launched.stop()


def test_a_model_without_a_tool_format_is_forced_into_the_generic_json_form(plain):
    """`required` or a named function on any model: the reply is held to a JSON array of
    `{"name", "parameters"}` calls, each held to its tool's schema, and parsed by the engine
    (vLLM's form); sampled at temperature 1, 128 replies, every one a valid call. `auto` on
    such a model tells it of the tools too, and its reply is content unless it is bare JSON
    calls (`BareJsonCalls`); it used to be a 400 naming `tools`."""
    client = openai.OpenAI(base_url=plain.http + "/v1", api_key="unused", max_retries=0)
    # NOTE: f closed to extra keys: an open object lets a random model write keys to max_tokens
    closed_f = {**TOOLS[0]["function"], "parameters": {**EMPTY, "additionalProperties": False}}
    tools = [{"type": "function", "function": closed_f}, TWO[1]]
    kwargs = dict(model="m", messages=ASK, tools=tools, max_tokens=96, temperature=1.0)
    for i in range(8):
        r = client.chat.completions.create(
            n=16, seed=i, tool_choice="required", parallel_tool_calls=False, **kwargs
        )
        for choice in r.choices:
            calls = choice.message.tool_calls or []
            assert len(calls) == 1 and choice.finish_reason == "tool_calls", choice
            if calls[0].function.name == "g":
                _check_g(calls[0].function.arguments)
            else:
                assert calls[0].function.name == "f"
                assert json.loads(calls[0].function.arguments) == {}
    chunks = list(client.chat.completions.create(tool_choice=NAMED_G, stream=True, **kwargs))
    calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert [c.function.name for c in calls] == ["g"]
    _check_g(calls[0].function.arguments)
    auto = client.chat.completions.create(tool_choice="auto", **{**kwargs, "max_tokens": 4})
    bare = client.chat.completions.create(**{**kwargs, "tools": None, "max_tokens": 1})
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # NOTE: the tools, told


@pytest.mark.parametrize(
    ("pieces", "content", "calls"),
    [
        (['  {"name": "g", "parame', 'ters": {"city": "Oslo"}}'], "", [("g", {"city": "Oslo"})]),
        (['[{"name": "f", "arguments": {}},', ' {"name": "g", "parameters": {}}]'], "",
         [("f", {}), ("g", {})]),
        (["Sure", ", here"], "Sure, here", []),
        (['{"name": "h", "parameters": {}}'], '{"name": "h", "parameters": {}}', []),
        (['{"name": "g", "parameters": {"ci'], '{"name": "g", "parameters": {"ci', []),
        (['{"answer": 4}'], '{"answer": 4}', []),
        (["\n", "[1, 2]"], "\n[1, 2]", []),
    ],
)  # fmt: skip
def test_bare_json_calls_are_calls_and_anything_else_content(pieces, content, calls):
    """A model without a tool-call format, under `auto`: a reply of bare JSON calls naming
    offered tools (Llama 3.x's `{"name", "parameters"}`, or an array) is calls; prose streams as
    content at once; JSON that is no call of an offered tool, or cut short, stays content."""
    stream = BareJsonCalls(TWO)
    text, found = "", []
    for piece in pieces:
        more, got = stream.feed(piece)
        text, found = text + more, found + got
        if pieces[0][:1] not in "{[ \n":
            assert more == piece  # NOTE: prose is not held back
    rest, got = stream.finish()
    text, found = text + rest, found + got
    assert text == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found] == calls


def test_bad_tools_through_the_sdk_on_a_model_without_a_format_are_refused(plain):
    """The bare-JSON parser reads the tools' names: malformed tools are refused, named, before
    it is built (a KeyError there would have left the call unanswered)."""
    with EngineClient(plain.address, timeout=30.0) as client:
        with pytest.raises(InvalidRequest) as e:
            client.generate(messages=ASK, tools=[{"type": "function"}], max_tokens=2)
        assert e.value.field == "tools"
        assert client.generate(messages=ASK, tools=TWO, max_tokens=2).finish_reason


def test_the_generic_form_tells_a_model_without_tools_of_them(plain, tiny_model_dir):
    """Its template cannot show tools, so the system message names them (the prompt grows by
    their specs), and the SDK gets the parsed calls too."""
    tok = load_tokenizer(tiny_model_dir)
    bare = len(tok.apply_chat_template(ASK, add_generation_prompt=True))
    with EngineClient(plain.address, timeout=30.0) as client:
        r = client.generate(messages=ASK, tools=TWO, max_tokens=64, tool_choice=NAMED_G)
    assert [c["function"]["name"] for c in r.tool_calls] == ["g"], (r.text, r.finish_reason)
    _check_g(r.tool_calls[0]["function"]["arguments"])
    assert r.usage.prompt_tokens > bare + 20


def test_the_in_process_engine_parses_a_call_in_the_generic_form(tiny_model_dir):
    """The same parser choice on every front door (`tool_calls.for_request`): a forced call
    on a model without a tool format comes back parsed from the in-process engine too."""
    transport = InProcessEngine(str(tiny_model_dir), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=30.0) as client:
        r = client.generate(messages=ASK, tools=TWO, max_tokens=64, tool_choice=NAMED_G)
    assert [c["function"]["name"] for c in r.tool_calls] == ["g"], (r.text, r.finish_reason)
    _check_g(r.tool_calls[0]["function"]["arguments"])
