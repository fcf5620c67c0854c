"""Real chat templates (tests/templates/: Qwen3, Qwen3-Coder, DeepSeek-R1, Llama 3.1, Mistral,
gpt-oss) over tiny scripted models with each family's special tokens (tests/template_models.py),
through a launched engine and the official `openai` and `anthropic` clients, whole and streamed:

- mlx-lm infers from them the think markers and tool parser it infers for the real models;
- thinking families (Qwen3, DeepSeek-R1): the thought apart from the answer exactly
  (`reasoning_content`, thinking blocks); a thought cut by max_tokens ends with "length" and
  the thought so far; Qwen3's `enable_thinking: false` renders the template's empty thought;
- tool families (Qwen3's JSON, Qwen3-Coder's XML, Mistral's `[TOOL_CALLS]`, Llama 3.1's bare
  JSON): the model's call in its own syntax comes back as `tool_calls` / `tool_use` with its
  arguments; a forced call parses and holds to the tool's schema; the call, sent back with the
  tool's result, is written back into the prompt in the model's own syntax;
- gpt-oss (harmony): the template renders a conversation with tools (no engine test here).

mlx-lm has no parser for Llama 3.x's calls: the engine reads them as bare JSON calls
(`tool_calls.BareJsonCalls`).

Each scripted model writes the same reply to any chat (`ANSWERS`); with tools offered, the
reply's call is parsed, without it stays text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401
from template_models import TEMPLATES, make_template_model, make_template_tokenizer

from engine.tokenizer_loader import load_tokenizer

pytestmark = pytest.mark.usefixtures("bounded")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING = "Count apples then add"
ARGS = {"city": "Paris", "days": 3}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    }
]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
QWEN3_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
# NOTE: each family's reply in its own layout: Qwen3 opens its thought itself; DeepSeek-R1's
# template opened it ("<think>\n") in the generation prompt
ANSWERS = {
    "qwen3": f"<think>\n{REASONING}\n</think>\n\n{QWEN3_CALL}",
    "deepseek_r1": f"{REASONING}\n</think>\n\nFour.",
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    ),
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
}
# NOTE: Llama 3.1 ends a turn with a call to a tool with <|eom_id|> (its template sets "Environment:
# ipython" when tools are given), one of the stop tokens of its config besides <|eot_id|>
ENDS = {"llama3": "<|eom_id|>"}
# NOTE: the reasoning is the text between the markers as written (vLLM's split too): the
# template's newlines around it included; the answer's leading blank line is dropped
THOUGHTS = {"qwen3": f"\n{REASONING}\n", "deepseek_r1": f"{REASONING}\n"}
ANSWER_TEXT = {"qwen3": QWEN3_CALL, "deepseek_r1": "Four."}
# NOTE: max_tokens that end inside the thought, and the thought so far
CUT = {"qwen3": (4, "\nCount apples"), "deepseek_r1": (2, "Count apples")}


# --- the templates and what mlx-lm infers from them -----------------------------------------------


def _readme_hashes() -> dict[str, str]:
    readme = (TEMPLATES / "README.md").read_text()
    return dict(re.findall(r"^\| `(\w+\.jinja)` \|.*\| ([0-9a-f]{64}) \|$", readme, re.M))


def test_the_templates_are_the_cited_copies():
    """Byte for byte the files the README cites (their SHA-256 there)."""
    hashes = _readme_hashes()
    files = {p.name for p in TEMPLATES.glob("*.jinja")}
    assert set(hashes) == files and len(files) == 6, (hashes, files)
    for name, digest in hashes.items():
        assert hashlib.sha256((TEMPLATES / name).read_bytes()).hexdigest() == digest, name


# NOTE: family -> (think markers, tool parser module, tool-call markers) as mlx-lm infers them for
# the real model: from its vocabulary (think markers) and its template (parser)
INFERRED = {
    "qwen3": (("<think>", "</think>"), "json_tools", ("<tool_call>", "</tool_call>")),
    # NOTE: Qwen3-Coder's vocabulary is Qwen3's: mlx-lm finds think markers there too
    "qwen3_coder": (("<think>", "</think>"), "qwen3_coder", ("<tool_call>", "</tool_call>")),
    "deepseek_r1": (("<think>", "</think>"), None, (None, None)),
    "llama3": ((None, None), None, (None, None)),
    "mistral": ((None, None), "mistral", ("[TOOL_CALLS]", "")),
    "gpt_oss": ((None, None), None, (None, None)),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory, default_model_dir: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("template-tokenizers")
    return {
        family: load_tokenizer(make_template_tokenizer(family, root / family, default_model_dir))
        for family in INFERRED
    }


@pytest.mark.parametrize("family", list(INFERRED))
def test_mlx_lm_infers_what_it_infers_for_the_real_model(tokenizers, family):
    tok = tokenizers[family]
    think, parser, call = INFERRED[family]
    assert (tok.think_start, tok.think_end) == think
    module = getattr(tok.tool_parser, "__module__", None)
    assert (module and module.rsplit(".", 1)[-1]) == parser
    assert (tok.tool_call_start, tok.tool_call_end) == call
    for marker in [*think, *call]:
        if marker:  # NOTE: each marker is one token, as in the real tokenizer
            assert len(tok.encode(marker, add_special_tokens=False)) == 1, marker


CALL = {"name": "get_weather", "arguments": ARGS}


def test_gpt_oss_renders_a_conversation_with_tools(tokenizers):
    """The harmony template: tools as a TypeScript namespace in the developer message, the
    assistant's thought on the analysis channel, its call on commentary to the function, the
    tool's result from it, and a generation prompt that leaves the channel to the model."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "thinking": "Need the tool",
            "tool_calls": [{"id": "c1", "type": "function", "function": CALL}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    tok = tokenizers["gpt_oss"]
    text = tok.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {" in text
    assert "// The weather\ntype get_weather = (_: {\ncity: string,\n" in text
    assert "<|start|>user<|message|>What is the weather in Paris?<|end|>" in text
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the tool<|end|>" in text
    call = '<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}<|call|>'
    assert f"<|start|>assistant to=functions.get_weather{call}" in text
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    assert f'{result}"Sunny"<|end|>' in text
    assert text.endswith("<|start|>assistant")
    ids = tok.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)
    for marker in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"):
        (marker_id,) = tok.encode(marker, add_special_tokens=False)
        assert ids.count(marker_id) == text.count(marker), marker


# --- engines ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(request, tmp_path_factory, default_model_dir) -> Iterator[dict[str, LaunchedEngine]]:
    """An engine per family the selected tests ask for, all started before any is waited for:
    their start-ups (seconds of imports in three processes each) overlap."""
    started: dict[str, LaunchedEngine] = {}
    try:
        for family in _families_asked(request.session.items):
            root = tmp_path_factory.mktemp(family)
            model = make_template_model(
                family, root / "model", default_model_dir, ANSWERS[family], ENDS.get(family)
            )
            started[family] = LaunchedEngine(model, root / "launch.log")
        yield {family: engine.wait_ready() for family, engine in started.items()}
    finally:
        for engine in started.values():
            engine.stop()


def _families_asked(items: list[pytest.Item]) -> list[str]:
    """The `family` parameters of this file's selected tests that use an engine."""
    asked = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if item.path == Path(__file__) and "engines" in item.fixturenames and callspec:
            asked.add(callspec.params["family"])
    return sorted(asked)


@dataclass
class Reply:
    """One reply as either API gives it, whole or streamed."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    finish: str | None = None


def _openai(engine: LaunchedEngine, stream: bool, **kw: Any) -> Reply:
    client = openai.OpenAI(base_url=engine.http + "/v1", api_key="x", max_retries=0, timeout=30)
    kw = {"model": "m", "messages": ASK, "temperature": 0.0, "max_tokens": 64, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        message = choice.message
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []
        ]
        extra = message.model_extra or {}
        return Reply(extra.get("reasoning_content") or "", message.content or "", calls,
                     choice.finish_reason)  # fmt: skip
    reply, calls = Reply(), dict[int, list[str]]()  # NOTE: index -> [name, arguments...]
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reply.reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        reply.content += delta.content or ""
        for call in delta.tool_calls or []:
            function = call.function
            parts = calls.setdefault(call.index, [function.name or ""] if function else [""])
            parts.append((function and function.arguments) or "")
        reply.finish = chunk.choices[0].finish_reason or reply.finish
    reply.calls = [(c[0], json.loads("".join(c[1:]))) for _, c in sorted(calls.items())]
    return reply


def _anthropic(engine: LaunchedEngine, stream: bool, **kw: Any) -> Reply:
    client = anthropic.Anthropic(base_url=engine.http, api_key="x", max_retries=0, timeout=30)
    # NOTE: the anthropic client takes sampling fields only as extra body fields
    kw = {"model": "m", "messages": ASK, "max_tokens": 64, "extra_body": {"temperature": 0.0}, **kw}
    if stream:
        with client.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kw)
    reply = Reply(finish=msg.stop_reason)
    for block in msg.content:
        if block.type == "thinking":
            reply.reasoning += block.thinking
        elif block.type == "text":
            reply.content += block.text
        elif block.type == "tool_use":
            reply.calls.append((block.name, dict(block.input)))
    return reply


def _ask(api: str, engine: LaunchedEngine, stream: bool, **kw: Any) -> Reply:
    return (_openai if api == "openai" else _anthropic)(engine, stream, **kw)


FINISH = {
    "openai": {"stop": "stop", "length": "length", "calls": "tool_calls"},
    "anthropic": {"stop": "end_turn", "length": "max_tokens", "calls": "tool_use"},
}
APIS = pytest.mark.parametrize("api", ["openai", "anthropic"])
STREAMED = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


# --- thinking families --------------------------------------------------------------------------


@APIS
@STREAMED
@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1"])
def test_the_thought_comes_apart_exactly(engines, family, api, stream):
    engine = engines[family]
    reply = _ask(api, engine, stream)
    assert reply == Reply(THOUGHTS[family], ANSWER_TEXT[family], [], FINISH[api]["stop"])


@APIS
@STREAMED
@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1"])
def test_a_thought_cut_by_max_tokens_ends_with_length(engines, family, api, stream):
    engine = engines[family]
    max_tokens, so_far = CUT[family]
    reply = _ask(api, engine, stream, max_tokens=max_tokens)
    assert reply == Reply(so_far, "", [], FINISH[api]["length"])


@pytest.mark.parametrize("family", ["qwen3"])
def test_qwen3_thinking_off_renders_the_templates_empty_thought(engines, family):
    """`enable_thinking: false` (and Anthropic's `thinking: disabled`) reach Qwen3's template:
    its generation prompt closes an empty thought, and the model goes on to its answer."""
    qwen3 = engines[family]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    tokens = post_json(qwen3, "/tokenize", {"messages": ASK, **off})[1]["tokens"]
    tok = load_tokenizer(Path(qwen3.log_path).parent / "model")
    text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=False)  # fmt: skip
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokens == tok.encode(text, add_special_tokens=False)
    for stream in (False, True):
        reply = _openai(qwen3, stream, extra_body=off)
        assert reply == Reply("", QWEN3_CALL, [], "stop")
        reply = _anthropic(qwen3, stream, thinking={"type": "disabled"})
        assert reply == Reply("", QWEN3_CALL, [], "end_turn")


# --- tool families ------------------------------------------------------------------------------


@APIS
@STREAMED
@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "mistral", "llama3"])
def test_a_call_in_the_familys_syntax_comes_back_structured(engines, family, api, stream):
    engine = engines[family]
    tools = TOOLS if api == "openai" else ANTHROPIC_TOOLS
    reply = _ask(api, engine, stream, tools=tools)
    thought = THOUGHTS.get(family, "")
    assert reply == Reply(thought, "", [("get_weather", ARGS)], FINISH[api]["calls"])


@STREAMED
@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "mistral", "llama3"])
def test_a_forced_call_parses_and_holds_to_the_schema(engines, family, stream):
    """A named function (OpenAI) and `any` (Anthropic), one call only: it parses and its
    arguments hold to the tool's schema, whatever form the engine forces (the model's own or
    the generic JSON array)."""
    # NOTE: one call: with parallel calls the generic array may go on, and this model, whose
    # script wants to end where the array cannot yet, writes "," (ties go to the lower id)
    engine = engines[family]
    named = {"type": "function", "function": {"name": "get_weather"}}
    replies = {
        "openai": _openai(engine, stream, tools=TOOLS, tool_choice=named,
                          parallel_tool_calls=False, max_tokens=96),
        "anthropic": _anthropic(engine, stream, tools=ANTHROPIC_TOOLS, max_tokens=96,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}),
    }  # fmt: skip
    for api, reply in replies.items():
        assert reply.finish == FINISH[api]["calls"] and not reply.content, (api, reply)
        assert [name for name, _ in reply.calls] == ["get_weather"], (api, reply)
        jsonschema.validate(reply.calls[0][1], WEATHER)


# NOTE: the call as each template writes it back into the conversation
WRITTEN_BACK = {
    "qwen3": QWEN3_CALL,
    "qwen3_coder": ANSWERS["qwen3_coder"],
    "mistral": '[TOOL_CALLS]get_weather[CALL_ID]{id}[ARGS]{"city": "Paris", "days": 3}',
    "llama3": ANSWERS["llama3"],
}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder", "mistral", "llama3"])
def test_a_call_goes_back_into_the_conversation(engines, family):
    """The call as the client got it (its id, its arguments as a JSON string), then the tool's
    result: the template writes the call back in the model's own syntax."""
    engine = engines[family]
    client = openai.OpenAI(base_url=engine.http + "/v1", api_key="x", max_retries=0, timeout=30)
    kw = {"model": "m", "tools": TOOLS, "temperature": 0.0}
    (call,) = (
        client.chat.completions.create(messages=ASK, max_tokens=64, **kw)
        .choices[0]
        .message.tool_calls
    )
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    assert client.chat.completions.create(messages=history, max_tokens=1, **kw).usage
    status, body = post_json(engine, "/tokenize", {"messages": history, "tools": TOOLS})
    assert status == 200, body
    prompt = load_tokenizer(engine.log_path.parent / "model").decode(body["tokens"])
    assert WRITTEN_BACK[family].replace("{id}", call.id) in prompt, prompt


@APIS
@STREAMED
@pytest.mark.parametrize("family", ["llama3"])
def test_a_reply_ended_by_another_stop_token_keeps_it_out_of_the_text(engines, family, api, stream):
    """A stop token of the model's config that its tokenizer does not call special (Llama
    3.1's <|eom_id|>) ends the reply and is no text (it used to be written into it)."""
    reply = _ask(api, engines[family], stream)
    assert reply == Reply("", ANSWERS[family], [], FINISH[api]["stop"])
