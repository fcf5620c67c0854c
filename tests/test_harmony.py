"""gpt-oss's harmony format (tokenizer_proc/harmony.py): the analysis channel is reasoning, the
final channel the answer, a message to `functions.NAME` a tool call, however the text is cut
into deltas; what is not harmony stays text. Then end to end, on scripted harmony models
(tests/harmony_model.py) through the official clients and the SDK."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401
from harmony_model import (
    CALL_ARGS,
    CALL_THOUGHT,
    FINAL,
    THOUGHT,
    make_answer_model,
    make_call_model,
)

from detokenizer_proc.detokenizer import Detokenizer
from engine.client import EngineClient
from engine.messages.to_client import Chunk
from engine.messages.to_tokenizer import Generate
from engine.tokenizer_loader import load_tokenizer
from tokenizer_proc.harmony import (
    ANALYSIS,
    END,
    HarmonyStream,
    Header,
    Parts,
    parse_header,
    speaks,
)
from tokenizer_proc.reasoning import Markers, markers_of, opens_inside
from tokenizer_proc.reply_split import for_sdk

ANSWER = (
    "<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
# NOTE: the recipient after the role; a preamble (commentary without a recipient) before them
TWO_CALLS = (
    "<|channel|>commentary<|message|>Checking both.<|end|>"
    '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|end|>'
    "<|start|>assistant<|channel|>commentary to=functions.b<|message|>{}<|call|>"
)


def _calls(parts: Parts) -> list[tuple[int, str, str]]:
    return [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in parts.calls]


def _parse(pieces: list[str], inside: bool = False, tools: bool = True) -> Parts:
    """The pieces fed one by one, then finished: everything that came out, joined."""
    stream = HarmonyStream(inside, tools)
    out = Parts("", "", [], "")
    for piece in pieces:
        out = out.then(stream.feed(piece))
    return out.then(stream.finish())


def _cuts(text: str) -> list[list[str]]:
    """`text` whole, in two at every point, one character at a time and in random pieces."""
    rng = random.Random(38)
    ways = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), 6))
        ways.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return ways


@pytest.mark.parametrize("text", [ANSWER, CALL, TWO_CALLS], ids=["answer", "call", "two-calls"])
def test_every_cut_of_the_text_reads_the_same(text):
    whole = _parse([text])
    for pieces in _cuts(text):
        got = _parse(pieces)
        assert got._replace(calls=_calls(got)) == whole._replace(calls=_calls(whole)), pieces


def test_the_analysis_channel_is_reasoning_and_the_final_channel_the_answer():
    out = _parse([ANSWER])
    assert (out.reasoning, out.answer, out.calls) == (
        "User asks 2+2. Simple: 4.",
        "2 + 2 = **4**.",
        [],
    )
    assert out.raw == ANSWER  # NOTE: the SDK's text: as written


def test_a_message_to_a_function_is_a_tool_call():
    out = _parse([CALL])
    assert (out.reasoning, out.answer) == ("Need get_weather.", "")
    assert _calls(out) == [(0, "get_weather", '{"city": "Paris"}')]
    call = out.calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    # NOTE: the SDK's text keeps what is not a call
    assert out.raw == "<|channel|>analysis<|message|>Need get_weather.<|end|>"


def test_several_calls_keep_their_order_and_a_preamble_is_the_answer():
    out = _parse([TWO_CALLS])
    assert _calls(out) == [(0, "a", '{"x": 1}'), (1, "b", "{}")]
    assert (out.reasoning, out.answer) == ("", "Checking both.")


def test_a_stream_without_its_stop_tokens_reads_the_same():
    """The detokenizer drops the tokens a tokenizer names special (gpt-oss's `<|return|>`)."""
    assert _parse([ANSWER.removesuffix("<|return|>")])[:3] == _parse([ANSWER])[:3]
    assert _calls(_parse([CALL.removesuffix("<|call|>")])) == _calls(_parse([CALL]))


def test_a_thought_cut_short_is_all_reasoning():
    """max_tokens inside the analysis message: what came is reasoning; a header cut short
    holds no text."""
    for pieces in _cuts("<|channel|>analysis<|message|>Still thinking"):
        assert _parse(pieces) == Parts("Still thinking", "", [], "".join(pieces)), pieces
    assert _parse(["<|channel|>analy"]) == Parts("", "", [], "")
    cut = _parse(["<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fi"])
    assert (cut.reasoning, cut.answer) == ("Done.", "")


def test_a_prompt_that_opened_the_analysis_starts_inside_it():
    out = _parse(["weigh it<|end|><|start|>assistant<|channel|>final<|message|>yes"], inside=True)
    assert (out.reasoning, out.answer) == ("weigh it", "yes")


def test_a_second_message_of_a_kind_starts_on_a_new_line():
    text = "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
    out = _parse([text + "<|message|>two<|end|>"])
    assert out.reasoning == "one\ntwo"


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no harmony at all.",
        "Two lines\nwithout a header<|end|>",
        "<|channel|>secret<|message|>on an unknown channel<|end|>",
        "<|start|>user<|message|>a turn the model should not write<|end|>",
        "<|channel|>final extra words<|message|>a header that does not parse",
        "<|channel|>commentary to=functions.a to=functions.b<|message|>{}<|call|>",
        "<|channel|>final\n<|message|>a header across lines",
        "<|channel|>" + "x" * 300 + "<|message|>a header too long",
    ],
)
def test_what_is_not_harmony_stays_text_as_written(text):
    for pieces in _cuts(text):
        assert _parse(pieces) == Parts("", text, [], text), pieces


def test_a_call_without_tools_offered_stays_text():
    call = CALL.split("<|end|>")[1]
    assert _parse([call], tools=False) == Parts("", call, [], call)


def test_a_call_cut_short_is_a_call_only_if_its_arguments_parse():
    head = "<|channel|>commentary to=functions.f json<|message|>"
    assert _calls(_parse([head + '{"a": [1, 2]}'])) == [(0, "f", '{"a": [1, 2]}')]
    cut = head + '{"a": [1,'
    assert _parse([cut]) == Parts("", cut, [], cut)


def test_headers_name_their_channel_and_recipient():
    assert parse_header("") == Header(None, None)
    assert parse_header("<|channel|>analysis") == Header("analysis", None)
    assert parse_header("<|start|>assistant<|channel|>final") == Header("final", None)
    f = "functions.get_weather"
    assert parse_header(f"<|start|>assistant<|channel|>commentary to={f} <|constrain|>json") == (
        Header("commentary", f)
    )
    assert parse_header(f"<|start|>assistant to={f}<|channel|>commentary json") == (
        Header("commentary", f)
    )
    assert parse_header(f" to={f}<|channel|>commentary<|constrain|>json") == Header("commentary", f)
    for bad in ("<|start|>user", "<|channel|>", "<|channel|>a b c", "to=a to=b<|channel|>x"):
        assert parse_header(bad) is None, bad


def test_reasoning_tokens_are_the_analysis_messages():
    """Each token its own delta: the analysis message's, header and end marker included."""
    tokens = ["<|channel|>", "analysis", "<|message|>", "Count", " apples", "<|end|>"]
    tokens += ["<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Four", "."]
    stream = HarmonyStream()
    for token in tokens:
        stream.feed(token, 1)
    stream.finish()
    assert stream.reasoning_tokens == 6


def test_the_sdk_gets_the_split_of_the_chat_route():
    """An SDK chat's chunks: the thought in `reasoning`, the answer in `text`, the calls in
    `tool_calls` (`reply_split.for_sdk`), a marker cut between chunks held back."""
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    gen = Generate("r", messages=[{"role": "user", "content": "hi"}], tools=tools)
    markers = Markers(ANALYSIS, END, (1,), (2,), harmony=True)
    split = for_sdk(gen, SimpleNamespace(has_tool_calling=False), markers)
    assert split is not None
    split.begin(False)
    first = split.sdk_chunk(Chunk("r", text=CALL[:40], token_ids=[0]))
    last = split.sdk_chunk(Chunk("r", text=CALL[40:], token_ids=[0], finish_reason="stop"))
    assert first.reasoning + last.reasoning == "Need get_weather."
    assert first.text + last.text == ""
    assert [c["function"]["name"] for c in first.tool_calls + last.tool_calls] == ["get_weather"]


def _tokenizer(vocab: dict[str, int], template: str | None) -> SimpleNamespace:
    """A tokenizer with `vocab` as its added tokens (the rest: a token a character)."""

    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        while text:
            token = next((t for t in vocab if text.startswith(t)), text[0])
            ids.append(vocab[token] if token in vocab else 100 + ord(token))
            text = text[len(token) :]
        return ids

    return SimpleNamespace(chat_template=template, encode=encode, has_thinking=False)


def test_a_model_that_writes_harmony_gets_its_parser_unless_turned_off():
    vocab = {"<|channel|>": 1, "analysis": 2, "<|message|>": 3, "<|end|>": 4}
    harmony = _tokenizer(vocab, "<|channel|>x<|message|>")
    markers = Markers("<|channel|>analysis<|message|>", "<|end|>", (1, 2, 3), (4,), harmony=True)
    assert speaks(harmony) and markers_of(harmony, "auto") == markers
    assert markers_of(harmony, "none") is None
    # NOTE: the vocabulary alone, or the template alone, is not harmony
    assert not speaks(_tokenizer(vocab, "{{ messages }}"))
    plain = _tokenizer({"analysis": 2}, "<|channel|>x<|message|>")
    assert not speaks(plain) and markers_of(plain, "auto") is None
    assert markers_of(plain, "harmony").harmony  # NOTE: asked for by name, it is harmony
    # NOTE: the prompt's last analysis header, not ended, opens the reply inside it
    assert opens_inside([9, 1, 2, 3, 7], markers) and not opens_inside([1, 2, 3, 7, 4, 9], markers)


# --- end to end --------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "What is two plus two?"}]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# NOTE: the thought's four tokens and its end marker (the template opened the message)
THOUGHT_TOKENS = 5
# NOTE: the anthropic client takes sampling fields only as extra body fields
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def answer_model(default_model_dir: Path, tmp_path_factory) -> Path:
    return make_answer_model(tmp_path_factory.mktemp("harmony-answer"), default_model_dir)


@pytest.fixture(scope="module")
def answer_engine(answer_model: Path):
    launched = LaunchedEngine(answer_model, answer_model / "launch.log").wait_ready()
    yield launched
    launched.stop()


@pytest.fixture(scope="module")
def call_engine(default_model_dir: Path, tmp_path_factory):
    model = make_call_model(tmp_path_factory.mktemp("harmony-call"), default_model_dir)
    launched = LaunchedEngine(model, model / "launch.log").wait_ready()
    yield launched
    launched.stop()


def test_the_detokenizer_keeps_the_markers_a_tokenizer_only_marks_special(answer_model):
    """gpt-oss's tokenizer marks its markers special but names only bos / eos / pad as its
    special tokens, which are all the detokenizer drops: the markers reach the parser as text.
    The test model's markers are marked so too; its eos is `<|im_end|>`."""
    tok = load_tokenizer(answer_model)
    ids = tok.encode("<|channel|>final<|message|>Four.<|call|><|im_end|>", add_special_tokens=False)
    detok = Detokenizer(tok)
    detok.register("r", [])
    chunks, _ = detok.process([Chunk("r", token_ids=ids, finish_reason="stop")])
    assert chunks[0].text == "<|channel|>final<|message|>Four.<|call|>"


def _oai(engine: LaunchedEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.usefixtures("bounded")
def test_a_harmony_reply_has_its_analysis_apart_from_its_final_answer(answer_engine):
    client = _oai(answer_engine)
    ask = {"model": "m", "messages": ASK, "temperature": 0.0, "max_tokens": 20}
    r = client.chat.completions.create(**ask)
    message = r.choices[0].message
    assert message.content == FINAL and r.choices[0].finish_reason == "stop"
    assert (message.model_extra or {})["reasoning_content"] == THOUGHT
    assert r.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    deltas = list(client.chat.completions.create(**ask, stream=True))
    reasoning = "".join(
        (d.choices[0].delta.model_extra or {}).get("reasoning") or "" for d in deltas
    )
    content = "".join(d.choices[0].delta.content or "" for d in deltas)
    assert (reasoning, content) == (THOUGHT, FINAL)
    msg = anthropic.Anthropic(base_url=answer_engine.http, api_key="x", max_retries=0).messages
    reply = msg.create(model="m", max_tokens=20, messages=ASK, **GREEDY)
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content
    ] == [
        ("thinking", THOUGHT),
        ("text", FINAL),
    ]


@pytest.mark.usefixtures("bounded")
def test_a_harmony_tool_call_comes_back_structured(call_engine):
    client = _oai(call_engine)
    ask = {"model": "m", "messages": ASK, "tools": WEATHER, "temperature": 0.0, "max_tokens": 40}
    r = client.chat.completions.create(**ask)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert (choice.message.model_extra or {})["reasoning_content"] == CALL_THOUGHT
    deltas = list(client.chat.completions.create(**ask, stream=True))
    streamed = [c for d in deltas if d.choices for c in d.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        ("get_weather", CALL_ARGS)
    ]
    fn = [{"type": "function", **WEATHER[0]["function"]}]
    items = client.responses.create(
        model="m", input=ASK, tools=fn, max_output_tokens=40, temperature=0.0
    ).output
    assert [i.type for i in items] == ["reasoning", "function_call"]
    assert (items[0].content[0].text, items[1].name) == (CALL_THOUGHT, "get_weather")
    spec = {"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}
    msg = anthropic.Anthropic(base_url=call_engine.http, api_key="x", max_retries=0).messages
    reply = msg.create(model="m", max_tokens=40, messages=ASK, tools=[spec], **GREEDY)
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    assert reply.content[1].input == {"city": "Paris"} and reply.stop_reason == "tool_use"
    with EngineClient(call_engine.address, timeout=30.0) as sdk:
        out = sdk.generate(messages=ASK, tools=WEATHER, max_tokens=40, temperature=0.0)
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"]
    assert (out.reasoning, out.text) == (CALL_THOUGHT, "")  # NOTE: as the chat route splits it


# NOTE: tools whose calls a model at temperature 1 ends: no free keys, a short string
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {
        "name": "now",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


@pytest.mark.usefixtures("bounded")
def test_a_forced_call_is_held_to_harmony_and_comes_back_structured(call_engine):
    """`required` and a named function: the reply is held to harmony's call
    (tokenizer_proc/harmony_calls.py; tests/test_harmony_calls.py checks the grammar) and read
    back by channel, a call with arguments valid for the tool's schema and no content, over the
    OpenAI API (whole and streamed), Anthropic's and the SDK. A reply that runs on in a thought
    (the model at temperature 1 seldom ends one) proves nothing: another seed is tried."""
    client, schema = _oai(call_engine), CITY["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = {"model": "m", "messages": ASK, "temperature": 1.0, "max_tokens": 64}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY, NOW)}
    ended = 0
    for seed in range(4):
        for choice in ("required", named):
            tools = [CITY, NOW]
            r = client.chat.completions.create(**ask, tools=tools, tool_choice=choice, seed=seed)
            if r.choices[0].finish_reason == "length":
                continue
            message = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and not message.content, message
            (call,) = message.tool_calls
            assert choice == "required" or call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            ended += 1
    assert ended >= 4

    def streamed(seed: int) -> list[Any] | None:
        deltas = list(
            client.chat.completions.create(
                **ask, tools=[CITY], tool_choice=named, seed=seed, stream=True
            )
        )
        return None if deltas[-1].choices[0].finish_reason == "length" else deltas

    deltas = _ended(streamed)
    calls = [c for d in deltas if d.choices for c in d.choices[0].delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert not "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    jsonschema.validate(json.loads("".join(c.function.arguments or "" for c in calls)), schema)
    # NOTE: the anthropic client takes no seed: its greedy reply
    spec = {"name": "get_weather", "input_schema": schema}
    msg = anthropic.Anthropic(base_url=call_engine.http, api_key="x", max_retries=0).messages
    reply = msg.create(
        model="m", max_tokens=64, messages=ASK, tools=[spec], tool_choice={"type": "any"}, **GREEDY
    )
    assert reply.stop_reason == "tool_use", reply
    assert [b.type for b in reply.content if b.type != "thinking"] == ["tool_use"], reply
    jsonschema.validate(reply.content[-1].input, schema)

    def generated(seed: int) -> Any:
        with EngineClient(call_engine.address, timeout=30.0) as sdk:
            out = sdk.generate(
                messages=ASK,
                tools=[CITY],
                tool_choice="required",
                max_tokens=64,
                temperature=1.0,
                seed=seed,
            )
        return None if out.finish_reason == "length" else out

    out = _ended(generated)
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"] and out.text == ""


def _ended(reply: Any, seeds: int = 8) -> Any:
    """The first of `reply(seed)`'s replies that ended (None: it ran to max_tokens)."""
    for seed in range(seeds):
        out = reply(seed)
        if out is not None:
            return out
    raise AssertionError(f"no reply of {seeds} ended")
