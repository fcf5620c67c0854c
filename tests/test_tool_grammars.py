"""Forced tool calls in each model's own format (tokenizer_proc/tool_grammars): on tiny random
models with each format's template (tests/tool_formats.py), replies sampled at temperature 1
under the grammar alone are, to mlx-lm's parser of the format, calls valid for their tools'
schemas; texts each grammar must refuse are refused; tools a format cannot carry take the
generic JSON form; and the engine parses a forced call with the model's own parser on every
front door (in-process, OpenAI's stream, Anthropic's tool_use blocks)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
import tool_formats as tf
from engine_harness import LaunchedEngine
from tool_model import _rename_tokens

from engine.client import EngineClient
from engine.tokenizer_loader import load_tokenizer
from mlx_engine.inprocess import InProcessEngine
from tokenizer_proc import tool_choice, tool_grammars

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def build(tmp_path_factory, default_model_dir: Path):
    """A format's tiny random model, built once per module."""
    built: dict[str, Path] = {}

    def model(fmt: str) -> Path:
        if fmt not in built:
            out = tmp_path_factory.mktemp(f"format-{fmt}")
            built[fmt] = tf.make_format_model(fmt, out, default_model_dir)
        return built[fmt]

    return model


@pytest.fixture(scope="module")
def samplers(build):
    made: dict[str, tf.Sampler] = {}

    def sampler(fmt: str) -> tf.Sampler:
        if fmt not in made:
            made[fmt] = tf.Sampler(build(fmt))
        return made[fmt]

    return sampler


# --- which form a forced call takes -------------------------------------------------------------


@pytest.mark.parametrize("fmt", [*tf.FORMATS, tf.GENERIC])
def test_each_format_is_forced_into_its_own_syntax_or_the_generic_form(build, fmt):
    tok = _tok(build(fmt))
    native = fmt in tf.NATIVE
    assert tool_choice.generic_form(tf.request(), tok) is not native
    lark = tool_choice.grammar(tok, tf.TOOLS, "required", False)
    assert lark is not None and lark.startswith("start: calls") == (not native), lark[:80]


# --- sampled at temperature 1: every reply a valid call ----------------------------------------

# NOTE: (request, samples, max_tokens, share that must end): parallel replies run on
RUNS = [
    (tf.request(), 64, 128, 0.9),
    (tf.request(parallel=True), 24, 400, 0.4),
    (tf.request(choice=NAMED), 24, 128, 0.9),
]


# NOTE: formats whose tags take many tokens (`<longcat_arg_value>` is 8 of this tokenizer's)
LONGER = {"longcat": 2}


@pytest.mark.parametrize("fmt", tf.NATIVE)
def test_sampled_forced_calls_parse_and_hold_to_their_schemas(samplers, fmt):
    """`required` with and without parallel calls, and a named tool, from a random model: every
    reply that ends is a valid call (one without parallel calls) of its tools. (The generic
    form on a model without a format: tests/test_tools.py; 1,000 samples a format:
    scripts/check_tool_calls.py.)"""
    sampler = samplers(fmt)
    for msg, samples, max_tokens, share in RUNS:
        replies = sampler.sample(msg, samples, max_tokens * LONGER.get(fmt, 1))
        ended = [text for end, text in replies if end == "stop"]
        bad = [(t, why) for t in ended if (why := tf.verify(sampler.tokenizer, msg, t))]
        assert not bad, (fmt, msg.tool_choice, msg.parallel_tool_calls, bad[:3])
        # NOTE: a reply cut by max_tokens proves nothing; most must end
        assert len(ended) >= samples * share, (fmt, msg.parallel_tool_calls, len(ended))
        if msg.tool_choice == NAMED:
            assert all("get_weather" in t for t in ended)


# --- what each grammar must refuse -------------------------------------------------------------


_tok, _llg_tokenizer = tf.tokenizer_of, tf.llg_tokenizer


SPLIT = "\x00"  # NOTE: where a text is tokenized apart (`_accepts`)


def _accepts(model_dir: Path, lark: str, text: str) -> bool:
    from llguidance import LLMatcher

    tok = _llg_tokenizer(model_dir)
    matcher = LLMatcher(tok, LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    # NOTE: each piece tokenized alone: a marker's text split in two is ordinary tokens
    ids = [i for piece in text.split(SPLIT) for i in tok.tokenize_str(piece)]
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def _check(
    build, fmt: str, good: list[str], bad: list[str], parallel: bool = False, tools: Any = None
) -> None:
    """`good` texts are accepted and valid calls to mlx-lm's parser; `bad` ones refused."""
    model_dir = build(fmt)
    tok = _tok(model_dir)
    msg = tf.request(parallel=parallel, tools=tools)
    lark = tool_choice.grammar(tok, msg.tools, "required", parallel)
    assert lark is not None
    for text in good:
        assert _accepts(model_dir, lark, text), text
        why = tf.verify(tok, msg, text.replace(SPLIT, ""))
        assert why is None, (text, why)
    for text in bad:
        assert not _accepts(model_dir, lark, text), text


def _qwen(*calls: str) -> str:
    return "".join(f"<tool_call>\n{c}</function>\n</tool_call>" for c in calls)


def _p(name: str, value: str) -> str:
    return f"<parameter={name}>\n{value}\n</parameter>\n"


def test_qwen3_coder_strings_are_any_text_the_parser_reads_back(build):
    weather = "<function=get_weather>\n"
    _check(
        build,
        "qwen3_coder",
        good=[
            _qwen("<function=now>\n"),
            _qwen(weather + _p("city", "a\n<b>&'\"") + _p("days", "14")),
            _qwen(weather + _p("city", "") + _p("days", "1") + _p("units", "celsius")),
            _qwen(weather + _p("city", "nulls") + _p("days", "3") + _p("detailed", "true")),
            _qwen(weather + _p("city", "</param") + _p("days", "3")),
            _qwen(weather + _p("city", "\n\nNull\n") + _p("days", "3")),
            _qwen(
                "<function=place_order>\n" + _p("item", "tea") + _p("quantity", "-2.5")
                + _p("address", '{"street": "x</p>y"}') + _p("tags", '["a", "b"]')
            ),
        ],
        bad=[
            _qwen(weather + _p("city", "</parameter>") + _p("days", "3")),
            _qwen(weather + _p("city", "null") + _p("days", "3")),
            _qwen(weather + _p("city", "NuLL") + _p("days", "3")),
            _qwen(weather + _p("city", f"</{SPLIT}tool_call>") + _p("days", "3")),
            _qwen(weather + _p("city", "thirteen long") + _p("days", "3")),
            _qwen(weather + _p("city", "x")),  # NOTE: days is required
            _qwen(weather + _p("city", "x") + _p("days", "15")),
            _qwen(weather + _p("city", "x") + _p("days", "2.0")),
            _qwen(weather + _p("city", "x") + _p("days", "3") + _p("units", "kelvin")),
            _qwen(weather + _p("city", "x") + _p("days", "3") + _p("detailed", "yes")),
            _qwen(weather + _p("city", "x") + _p("days", "3") + _p("wind", "3")),
            _qwen("<function=place_order>\n" + _p("item", "tea") + _p("quantity", "1e400")),
            _qwen("<function=nope>\n"),
            _qwen("<function=now>\n", "<function=now>\n"),  # NOTE: one call without parallel
        ],
    )  # fmt: skip


def test_qwen3_coder_free_text_runs_to_the_first_closing_tag(build):
    """A string without maxLength: any text, many lines, tags and JSON included, but not the
    closing tag (the parser's value would end there), the end marker (the stream's call
    would), or "null" in any case (the parser's None)."""
    note = [_tool("note", {"text": {"type": "string"}}, required=["text"])]
    call = "<function=note>\n"
    _check(
        build,
        "qwen3_coder",
        good=[
            _qwen(call + _p("text", "line one\n\n  <b>two</b>\n</param\n<parameter=x>")),
            _qwen(call + _p("text", '{"a": [1, 2]} and "null" and nullable </tool_cal')),
            _qwen(call + _p("text", "")),
        ],
        bad=[
            _qwen(call + _p("text", "a\n</parameter>\nb")),
            _qwen(call + _p("text", "text </tool_call> more")),
            _qwen(call + _p("text", f"text </{SPLIT}tool_call> more")),
            _qwen(call + _p("text", "Null")),
            _qwen(call),
        ],
        tools=note,
    )


def test_qwen3_coder_integers_stay_within_a_floats_exact_range(build):
    tok = _tok(build("qwen3_coder"))
    count = [{"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]  # fmt: skip
    lark = tool_choice.grammar(tok, count, "required", True)
    body = "<function=count>\n" + _p("n", "{}")
    ok, over = _qwen(body.format(2**53 - 1)), _qwen(body.format(2**53 + 1))
    assert _accepts(build("qwen3_coder"), lark, ok)
    assert not _accepts(build("qwen3_coder"), lark, over)
    both = _qwen(body.format(-1), body.format(7))
    assert _accepts(build("qwen3_coder"), lark, both)


def _py(*calls: str) -> str:
    return f"<|tool_call_start|>[{', '.join(calls)}]<|tool_call_end|>"


def test_pythonic_values_are_python_literals_of_their_schemas(build):
    _check(
        build,
        "pythonic",
        good=[
            _py("now()"),
            _py('get_weather(city="a\\nb\\"c", days=3)'),
            _py('get_weather(city="x", days=14, units="fahrenheit", detailed=true)'),
            _py('get_weather(city="x", days=2, detailed=false)'),
            _py('place_order(item="water", quantity=0.5, address={"street": "s", "zip": 7})'),
            _py('place_order(item="tea", quantity=-3, tags=["a", "bb"])'),
        ],
        bad=[
            _py('get_weather(city="x")'),
            _py('get_weather(days=3, city="x")'),  # NOTE: the schema's order
            _py("get_weather(city='x', days=3)"),
            _py('get_weather(city="a\\/b", days=3)'),  # NOTE: Python reads "\/" as two characters
            _py('get_weather(city="\\u0041", days=3)'),
            _py('get_weather(city="x", days=3, detailed=True)'),
            _py('get_weather(city="x", days=3,)'),
            _py('place_order(item="tea", quantity=1e5)'),
            _py('place_order(item="juice", quantity=1)'),
            _py("now(), now()"),
        ],
    )


def test_glm47_strings_are_raw_text_and_the_rest_json(build):
    """A "string" parameter is its text as written, read back whole: no closing tag or end
    marker inside, no whitespace at either end (the parser strips it); every other parameter
    (a union with "string", an untyped enum) is JSON, which the parser reads first."""
    tool = _tool(
        "f",
        {"s": {"type": "string"}, "u": {"type": ["string", "null"]}, "e": {"enum": [" x", "y"]}},
        required=["s", "u", "e"],
    )

    def call(s: str, u: str, e: str) -> str:
        args = [("s", s), ("u", u), ("e", e)]
        body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args)
        return f"<tool_call>f\n{body}</tool_call>"

    good = [call("a b\nc", "null", '"y"'), call("", '"text"', '" x"')]
    bad = [
        call(" a", "null", '"y"'),  # NOTE: leading whitespace, which the parser strips
        call("a ", "null", '"y"'),
        call("a</arg_value>b", "null", '"y"'),
        call("a</tool_call>b", "null", '"y"'),
        call("a", "text", '"y"'),  # NOTE: a union with string is JSON
        call("a", "null", "y"),  # NOTE: an untyped enum is JSON
    ]
    _check(build, "glm47", good, bad, tools=[tool])


def test_longcat_writes_a_call_without_parameters_as_json(build):
    """LongCat's parser fails on a call whose name has no key after it, and reads a block that
    starts with `{` as JSON: a call without parameters is that JSON, and a call in tags to a
    tool whose parameters are all optional has at least one of them, in their order."""
    tools = [
        _tool("now", {}),
        _tool("opt", {"a": {"type": "integer"}, "b": {"type": "string"}}),
    ]

    def call(body: str) -> str:
        return f"<longcat_tool_call>{body}</longcat_tool_call>"

    def arg(k: str, v: str) -> str:
        return (
            f"<longcat_arg_key>{k}</longcat_arg_key>\n<longcat_arg_value>{v}</longcat_arg_value>\n"
        )

    good = [
        call('{"name": "now", "arguments": {}}'),
        call('{"name": "opt", "arguments": {}}'),
        call("opt\n" + arg("a", "3") + arg("b", "x y")),
        call("opt\n" + arg("b", "x")),
    ]
    bad = [
        call("now\n"),  # NOTE: the parser finds no name without a key after it
        call("opt\n"),
        call("opt\n" + arg("b", "x") + arg("a", "3")),  # NOTE: out of their order
        call('{"name": "now", "arguments": {"a": 1}}'),
    ]
    _check(build, "longcat", good, bad, tools=tools)


def test_function_gemma_values_are_what_its_parser_reads_back(build):
    """FunctionGemma's parser cuts the arguments at the first `}`, a string at the next
    `<escape>` and any other value at the next `,`: a string is escaped text without `}` (a `,`,
    `:` or `{` in it is fine), other values JSON scalars; an optional array or object parameter
    is left out of the call (it cannot be written), and a tool with a required one takes the
    generic form."""

    def call(name: str, args: str) -> str:
        return f"<start_function_call>call:{name}{{{args}}}<end_function_call>"

    good = [
        call("get_weather", "city:<escape>Oslo, N: {x<escape>,days:3"),
        call("get_weather", "city:<escape><escape>,days:14,units:<escape>celsius<escape>"),
        call("get_weather", "city:<escape>a<escape>,days:1,detailed:false"),
        call("place_order", "item:<escape>tea<escape>,quantity:2.5"),
        call("now", ""),
    ]
    bad = [
        call("get_weather", "city:<escape>a}b<escape>,days:3"),
        call("get_weather", "city:Oslo,days:3"),  # NOTE: a string is escaped
        call("get_weather", "city:<escape>a<escape>,days:<escape>3<escape>"),
        call("get_weather", "days:3,city:<escape>a<escape>"),  # NOTE: out of their order
        call("place_order", "item:<escape>tea<escape>,quantity:1,tags:[]"),
    ]
    _check(build, "function_gemma", good, bad)
    # NOTE: FunctionGemma's own `<escape>` is an added token: a string closes with it alone
    esc = SPLIT + "<escape>" + SPLIT
    good = [t.replace("<escape>", esc) for t in good]
    bad = [t.replace("<escape>", esc) for t in bad]
    bad.append(call("get_weather", f"city:{esc}a<escape>b{esc},days:3"))
    _check(build, "function_gemma_escape", good, bad)
    tok = _tok(build("function_gemma"))
    required = [_tool("tag", {"tags": {"type": "array"}}, required=["tags"])]
    assert tool_choice.generic_form(tf.request(tools=required), tok)


def test_minimax_m2_values_by_the_types_the_parser_reads(build):
    """A string (or an untyped parameter) is raw text the parser reads back whole: no closing
    tag, `</invoke>` or end marker inside, no whitespace at either end, not "null" in any case;
    an integer, number, boolean, object or array is JSON of its schema."""
    tool = _tool(
        "f",
        {"s": {"type": "string"}, "free": {}, "n": {"type": "integer"}, "b": {"type": "boolean"}},
        required=["s", "free", "n", "b"],
    )

    def call(s: str, free: str = "x", n: str = "3", b: str = "true") -> str:
        args = [("s", s), ("free", free), ("n", n), ("b", b)]
        body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args)
        return f'<minimax:tool_call>\n<invoke name="f">\n{body}</invoke>\n</minimax:tool_call>'

    good = [call("a b\nc"), call("", free='{"k": 1}', n="-12", b="false"), call("nullish")]
    bad = [
        call(" a"),  # NOTE: leading whitespace, which the parser strips
        call("a\n"),
        call("NULL"),  # NOTE: the parser's None
        call("a</invoke>b"),
        call("a</minimax:tool_call>b"),
        call("a</parameter>b"),
        call("a", n="3.5"),
        call("a", n='"3"'),
        call("a", b="yes"),  # NOTE: the parser's word, but not JSON of the schema
    ]
    _check(build, "minimax_m2", good, bad, tools=[tool])


def test_minicpm5_values_as_minimax_m2s_in_its_own_blocks(build):
    """MiniCPM5's parser converts values as minimax_m2's does, each up to `</param>`, and
    unwraps a value that is a whole CDATA block: a string holds no `</param>`, `</function>` or
    CDATA opening, no whitespace at either end, not "null"; parallel calls are consecutive
    blocks, each with its own markers."""
    tool = _tool(
        "f",
        {"s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"}},
        required=["s", "n"],
    )

    def call(s: str, n: str = "3", b: str | None = None) -> str:
        args = [("s", s), ("n", n)] + ([("b", b)] if b is not None else [])
        body = "".join(f'<param name="{k}">{v}</param>\n' for k, v in args)
        return f'<function name="f">\n{body}</function>'

    good = [call("a <b> & c\nd"), call("", n="-12", b="false"), call("nullish")]
    bad = [
        call(" a"),  # NOTE: leading whitespace, which the parser strips
        call("NULL"),  # NOTE: the parser's None
        call("a</param>b"),
        call("a</function>b"),
        call("<![CDATA[a]]>"),  # NOTE: the parser would unwrap it
        call("a", n="3.5"),
        call("a", b="yes"),
        call("a", n="1") + call("a", n="2"),  # NOTE: two calls without parallel_tool_calls
    ]
    _check(build, "minicpm5", good, bad, tools=[tool])
    _check(build, "minicpm5", [call("a", n="1") + call("b", n="2")], [], True, tools=[tool])


def test_muse_spark_strings_read_back_raw_or_as_json_strings(build):
    """The parser tries `json.loads` on every value first: a string is raw text it cannot read
    (trimmed, no closing tag or end marker inside), or a JSON string without escapes for the
    texts it could ("42", "true"); every other value is JSON of its schema. A `</atem:invoke>`
    inside a value does not end the call (the parser takes a parameter element whole)."""
    tool = _tool(
        "f",
        {
            "s": {"type": "string"},
            "free": {},
            "n": {"type": "integer"},
            "e": {"enum": ["a b", "1", " pad"]},
        },
        required=["s", "free", "n", "e"],
    )

    def call(s: str, free: str = "1", n: str = "3", e: str = "a b") -> str:
        args = [("s", s), ("free", free), ("n", n), ("e", e)]
        body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in args)
        return f'<atem:function_calls>\n<atem:invoke name="f">\n{body}</atem:invoke>\n</atem:function_calls>'

    good = [
        call("a b\nc", free='"x"'),
        call('"42"', free='{"k": [1, null]}', n="-12"),
        call('"true"', e='"1"'),
        call('""', e='" pad"'),
        call(""),
        call("a</atem:invoke>b", free="true"),
        call('"{a: [1]}"', free="2.5"),  # NOTE: text opening with `{`, as a JSON string
        call('a "b" {c}'),
        call("Null and nullable", free="null"),
    ]
    bad = [
        call(" a"),  # NOTE: leading whitespace, which the parser strips
        call("a\n"),
        call("a\x1f"),  # NOTE: Python's strip takes it, a regex's \S does not
        call("42"),  # NOTE: the parser's int
        call("-1.5e3"),
        call("null"),
        call("NaN"),
        call("true"),
        call('{"a": 1}'),  # NOTE: the parser's dict
        call("[1]"),
        call("{a"),  # NOTE: raw text that opens as JSON does is left out (it is written quoted)
        call('"a\\"b"'),  # NOTE: a JSON string with escapes is not written
        call("a</atem:parameter>b"),
        call("a</atem:function_calls>b"),
        call("x", free="raw text"),  # NOTE: an untyped value is JSON
        call("x", n="3.5"),
        call("x", e="1"),  # NOTE: the parser's int: "1" is written as JSON
        call("x", e="pad"),
    ]
    _check(build, "muse_spark", good, bad, tools=[tool])
    weather = '<atem:invoke name="get_weather">\n<atem:parameter name="city">{}</atem:parameter>\n'
    weather += '<atem:parameter name="days">3</atem:parameter>\n</atem:invoke>\n'

    def calls(*cities: str) -> str:
        return (
            "<atem:function_calls>\n"
            + "".join(weather.format(c) for c in cities)
            + "</atem:function_calls>"
        )

    _check(
        build,
        "muse_spark",
        good=[calls("twelve chars"), calls('"12345678901"'), calls("Oslo", "Bergen")],
        bad=[calls("thirteen long"), calls('"1234567890123"'), calls("Oslo") + calls("Bergen")],
        parallel=True,
    )


_DELIMITERS = ("<|open|>", "<|sep|>", "<|close|>")


def _kimi(*calls: str) -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>"


def _kimi_call(name: str, *args: tuple[str, str, str], index: str = "0") -> str:
    body = "".join(
        f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>'
        for k, t, v in args
    )
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def _spelled(text: str) -> str:
    """`text` with each delimiter in ordinary tokens (its text split in two)."""
    for tag in _DELIMITERS:
        text = text.replace(tag, tag[:3] + SPLIT + tag[3:])
    return text


def test_kimi_k3_strings_are_raw_text_typed_string_and_the_rest_json(build):
    """A value typed "string" is kept as written: any text within its lengths, whitespace
    included, without the text of a tag that would end its argument, its call or the section
    early, an `<|open|>json` block, or the think start; other values are JSON typed by their
    schema. The delimiters are the model's added tokens: spelled in ordinary tokens they are
    text, which the grammar takes only inside a value."""
    weather = "get_weather"

    def city(value: str, *more: tuple[str, str, str]) -> str:
        return _kimi(
            _kimi_call(weather, ("city", "string", value), ("days", "integer", "3"), *more)
        )

    good = [
        _kimi(_kimi_call("now")),
        _kimi(_kimi_call("now", index="12")),
        city(" Oslo\n"),
        city(""),
        city("42", ("units", "string", "celsius"), ("detailed", "boolean", "false")),
        _kimi(
            _kimi_call(
                "place_order",
                ("item", "string", "tea"),
                ("quantity", "number", "-2.5"),
                ("address", "object", '{"street": "x", "zip": 7}'),
                ("tags", "array", '["a", "b"]'),
            )
        ),
    ]
    bad = [
        city("thirteen long"),
        _kimi(_kimi_call(weather, ("city", "string", "x"), ("days", "string", "3"))),
        _kimi(_kimi_call(weather, ("city", "json", '"x"'), ("days", "integer", "3"))),
        _kimi(_kimi_call(weather, ("city", "string", "x"))),  # NOTE: days is required
        _kimi(_kimi_call(weather, ("days", "integer", "3"), ("city", "string", "x"))),
        city("x", ("units", "string", "kelvin")),
        city("x", ("detailed", "boolean", "yes")),
        _kimi(_kimi_call("now", index="x")),
        _kimi(_kimi_call("now"), _kimi_call("now")),  # NOTE: one call without parallel calls
        _spelled(_kimi(_kimi_call("now"))),  # NOTE: the tags are the model's tokens
    ]
    _check(build, "kimi_k3", good, bad)
    note = [_tool("note", {"text": {"type": "string"}}, required=["text"])]

    def text(value: str) -> str:
        return _kimi(_kimi_call("note", ("text", "string", _spelled(value))))

    good = [
        text("a<|close|>b<|open|>argument<|sep|>"),
        text("<|close|>argument</|sep|>"),
        text("<|open|>jso <|open|>thinks<|sep|>"),
    ]
    bad = [
        text("a<|close|>argument<|sep|>b"),
        text("a<|close|>call<|sep|>b"),
        text("a<|close|>tools<|sep|>b"),
        text("<|open|>json"),  # NOTE: the parser would look for a JSON block
        text("<|open|>think<|sep|>"),  # NOTE: the engine would cut a thought there
    ]
    _check(build, "kimi_k3", good, bad, tools=note)
    two = _kimi(_kimi_call("now"), _kimi_call("now", index="1"))
    _check(build, "kimi_k3", [two], [_kimi()], parallel=True)
    # NOTE: a string held to more than raw text can be is JSON, typed so that the parser reads it
    tool = _tool("f", {"s": {"type": "string", "pattern": "^a+$"}}, required=["s"])
    typed = [_kimi(_kimi_call("f", ("s", "json", '"aa"')))]
    _check(build, "kimi_k3", typed, [_kimi(_kimi_call("f", ("s", "string", "aa")))], tools=[tool])


def test_kimi_k3_takes_the_generic_form_where_a_delimiter_is_text(build, tmp_path):
    """mlx-lm infers the format from the delimiters in the vocabulary; where one is not an added
    token (the tokenizer spells it in ordinary tokens) the grammar, written for tokens, is not
    used."""
    out = tmp_path / "model"
    shutil.copytree(build("kimi_k3"), out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|sep|>"]
    (out / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(out)
    assert tool_grammars.format_of(tok) == "kimi_k3"
    assert len(tok.encode("<|sep|>", add_special_tokens=False)) > 1
    assert tool_grammars.native(tok, tf.TOOLS, False) is None


def _gemma(*calls: str) -> str:
    return "".join(f"<|tool_call>call:{c}<tool_call|>" for c in calls)


def _q(text: str) -> str:
    return f'<|"|>{text}<|"|>'


def test_gemma4_arguments_are_what_its_json_conversion_reads_back(build):
    """Gemma 4's parser balances the braces (not those in strings), quotes a bare key after `{`
    or `,` and reads the result as JSON: strings are `<|"|>`-quoted text without `<|"|>` or the
    end marker (braces, commas and colons inside are fine); numbers, booleans and null JSON;
    objects and arrays in the same syntax, no spaces; properties in their schema's order."""
    good = [
        _gemma("now{}"),
        _gemma("get_weather{city:" + _q("O, {x:1}: y") + ",days:3}"),
        _gemma("get_weather{city:" + _q("") + ",days:14,units:" + _q("celsius") + ",detailed:false}"),
        _gemma("get_weather{city:" + _q("a\n<b>") + ",days:1,detailed:true}"),
        _gemma(
            "place_order{item:" + _q("tea") + ",quantity:2.5,address:{street:" + _q("s")
            + ",zip:7},tags:[" + _q("a") + "," + _q("bb") + "]}"
        ),
        _gemma("place_order{item:" + _q("water") + ",quantity:-3,tags:[]}"),
    ]  # fmt: skip
    bad = [
        _gemma("get_weather{city:" + _q("a") + ", days:3}"),  # NOTE: a key after a space stays bare
        _gemma('get_weather{city:"a",days:3}'),  # NOTE: a string is quoted by <|"|>
        _gemma("get_weather{city:" + _q("a") + ",days:3,}"),
        _gemma("get_weather{days:3,city:" + _q("a") + "}"),  # NOTE: out of their order
        _gemma("get_weather{city:" + _q("thirteen long") + ",days:3}"),
        _gemma("get_weather{city:" + _q("a") + ",days:3,wind:1}"),
        _gemma("place_order{item:" + _q("tea") + ",quantity:1e5}"),
        _gemma("place_order{item:" + _q("tea") + ",quantity:1,address:{zip:7}}"),
        _gemma("place_order{item:" + _q("tea") + ',quantity:1,address:{"street":' + _q("s") + "}}"),
        _gemma("place_order{item:" + _q("tea") + ",quantity:1,tags:[" + ",".join([_q("a")] * 4) + "]}"),
        _gemma("now{}", "now{}"),  # NOTE: one call without parallel calls
    ]  # fmt: skip
    note = [_tool("note", {"text": {"type": "string"}}, required=["text"])]
    good.append(_gemma("note{text:" + _q(f"a<tool_call|b<|tool_{SPLIT}call>") + "}"))
    bad.append(_gemma("note{text:" + _q(f"a<tool_{SPLIT}call|>b") + "}"))
    _check(build, "gemma4", good, bad, tools=[*tf.TOOLS, *note])
    _check(build, "gemma4", [_gemma("now{}", "get_weather{city:" + _q("x") + ",days:2}")], [], True)
    # NOTE: Gemma 4's own `<|"|>` is an added token: a string opens and closes with it alone
    quote = SPLIT + '<|"|>' + SPLIT
    good = [t.replace('<|"|>', quote) for t in good]
    bad = [t.replace('<|"|>', quote) for t in bad]
    bad.append(_gemma(f'note{{text:{quote}a<|{SPLIT}"|>b{quote}}}'))
    _check(build, "gemma4_quote", good, bad, tools=[*tf.TOOLS, *note])


def test_gemma4_writes_unions_untyped_values_and_nested_items(build):
    """A value of several types is any one of them, an untyped one any value in the syntax (its
    objects' keys word characters), an enum its values; an optional property whose schema says
    more than the syntax can hold is left out of the call."""
    props = {
        "u": {"type": ["string", "null"], "maxLength": 3},
        "any": {},
        "n": {"enum": [1, 2.5, None, "x y"]},
        "rows": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            "minItems": 2,
            "maxItems": 3,
        },
        "skip": {"type": "string", "format": "email"},
    }
    tool = _tool("f", props, required=["u", "any", "n", "rows"])

    def call(u: str, any_: str, n: str, rows: str, more: str = "") -> str:
        return _gemma(f"f{{u:{u},any:{any_},n:{n},rows:{rows}{more}}}")

    good = [
        call("null", "null", "1", "[[1],[2,3]]"),
        call(_q("abc"), "{a:[1," + _q("}") + "],b:{}}", "2.5", "[[1],[2],[3]]"),
        call(_q(""), _q("text"), "null", "[[0],[0]]"),
        call("null", "true", _q("x y"), "[[1],[2]]"),
    ]
    bad = [
        call(_q("abcd"), "1", "1", "[[1],[2]]"),
        call("null", "{a b:1}", "1", "[[1],[2]]"),
        call("null", "1", "3", "[[1],[2]]"),
        call("null", "1", "1", "[[1]]"),
        call("null", "1", "1", "[[1],[]]"),
        call("null", "1", "1", "[[1],[2]]", ",skip:" + _q("a@b.c")),
    ]
    _check(build, "gemma4", good, bad, tools=[tool])


# NOTE: (format, the text of a forced call up to a long string's value): each value's lexeme
LONG_VALUES = [
    ("muse_spark", '<atem:function_calls>\n<atem:invoke name="note">\n<atem:parameter name="text">'),
    ("muse_spark", '<atem:function_calls>\n<atem:invoke name="note">\n<atem:parameter name="text">"'),
    ("kimi_k3", '<|open|>tools<|sep|><|open|>call tool="note" index="0"<|sep|><|open|>argument key="text" type="string"<|sep|>'),
    ("gemma4", '<|tool_call>call:note{text:<|"|>'),
    ("gemma4_quote", "<|tool_call>call:note{text:" + SPLIT + '<|"|>' + SPLIT),
    # NOTE: the trimmed raw values of `lark.free_text`, whose lengths were once intersected
    ("minimax_m2", '<minimax:tool_call>' + SPLIT + '\n<invoke name="note">\n<parameter name="text">'),
    ("glm47", "<tool_call>" + SPLIT + "note\n<arg_key>text</arg_key>\n<arg_value>"),
    ("longcat", "<longcat_tool_call>" + SPLIT + "note\n<longcat_arg_key>text</longcat_arg_key>\n<longcat_arg_value>"),
    ("minicpm5", '<function name="note">\n<param name="text">'),
]  # fmt: skip


@pytest.mark.parametrize("fmt,prefix", LONG_VALUES)
def test_a_long_string_keeps_the_lexer_within_its_limits(build, fmt, prefix):
    """A string up to 1,000 characters long, its text drawn at random among the tokens the
    grammar allows: every mask is computed (llguidance's lexer gives up on a lexeme whose
    derivatives grow past its limit, "too many expressions constructed", which ends the reply
    in the middle of the call)."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    model_dir = build(fmt)
    note = [_tool("note", {"text": {"type": "string", "minLength": 2, "maxLength": 1000}})]
    lark = tool_choice.grammar(_tok(model_dir), note, "required", False)
    tok = _llg_tokenizer(model_dir)
    rng = np.random.default_rng(0)
    for _ in range(3):
        matcher = LLMatcher(tok, LLMatcher.grammar_from_lark(lark), log_level=0)
        ids = [i for piece in prefix.split(SPLIT) for i in tok.tokenize_str(piece)]
        assert matcher.try_consume_tokens(ids) == len(ids), prefix
        mask = allocate_token_bitmask(1, tok.vocab_size)
        for _ in range(60):
            fill_next_token_bitmask(matcher, mask, 0)
            assert not matcher.is_error(), matcher.get_error()[:200]
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: tok.vocab_size])
            allowed = allowed[allowed != tok.eos_token]
            if not len(allowed):
                break
            assert matcher.consume_token(int(rng.choice(allowed)))


def test_mistral_headers_and_arrays(build):
    _check(
        build,
        "mistral",
        good=[
            "[TOOL_CALLS]now[ARGS]{}",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "x", "days": 2}',
        ],
        bad=[
            '[TOOL_CALLS]now[ARGS]{"x": 1}',
            '[TOOL_CALLS]get_weather[ARGS]{"city": "x"}',
            "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]{}",
            '[TOOL_CALLS] [{"name": "now", "arguments": {}}]',
        ],
    )
    _check(
        build,
        "mistral",
        good=["[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]{}"],
        bad=["[TOOL_CALLS]now[ARGS]{}now[ARGS]{}"],
        parallel=True,
    )
    _check(
        build,
        "mistral_array",
        good=['[TOOL_CALLS] [{"name": "now", "arguments": {}}]'],
        bad=[
            "[TOOL_CALLS]now[ARGS]{}",
            '[TOOL_CALLS] [{"name": "now", "arguments": {}}, {"name": "now", "arguments": {}}]',
            "[TOOL_CALLS] []",
        ],
    )


# --- tools a format cannot carry take the generic form -------------------------------------------


def _tool(name: str, props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    params = {"type": "object", "properties": props, **extra}
    return {"type": "function", "function": {"name": name, "parameters": params}}


@pytest.mark.parametrize(
    "fmt,tool",
    [
        ("qwen3_coder", _tool("f", {"s": {"type": "string", "pattern": "^a+$"}})),
        ("qwen3_coder", _tool("f", {"s": {"type": ["string", "null"]}})),
        ("qwen3_coder", _tool("f", {"s": {"enum": [1, 2]}})),
        ("qwen3_coder", _tool("f", {"s": {"type": "string", "enum": ["ok", "NULL"]}})),
        ("qwen3_coder", _tool("f", {"s": {"$ref": "#"}})),
        ("qwen3_coder", _tool("f", {"s": {}}, minProperties=1)),
        ("qwen3_coder", _tool("f g", {})),
        ("qwen3_coder", _tool("f", {"a b": {"type": "string"}})),
        ("pythonic", _tool("f", {"class": {"type": "string"}})),
        ("pythonic", _tool("f", {"my-key": {"type": "string"}})),
        ("pythonic", _tool("f-g", {})),
        ("pythonic", _tool("f", {"x": {"type": "integer"}}, required=["y"])),
        ("mistral", _tool("f.g", {})),
        ("glm47", _tool("f", {"s": {"type": "string", "pattern": "^a+$"}})),
        ("glm47", _tool("f", {"s": {"type": "string", "enum": [" a", "b "]}})),
        ("glm47", _tool("f g", {})),
        ("glm47", _tool("{f}", {})),
        ("glm47", _tool("f", {"a b": {"type": "integer"}})),
        ("kimi_k2", _tool("f:1", {})),
        ("minimax_m2", _tool("f", {"s": {"type": ["string", "integer"]}})),
        ("minimax_m2", _tool("f", {"s": {"type": "integer", "enum": [1, 2]}})),
        ("minimax_m2", _tool("f", {"s": {"enum": ["a", 1]}})),
        ("minimax_m2", _tool("f", {"s": {"anyOf": [{"type": "string"}]}})),
        ("minimax_m2", _tool("f", {"s": {"type": "string", "enum": ["null"]}})),
        ("minimax_m2", _tool('f"', {})),
        ("muse_spark", _tool('f"', {})),
        ("muse_spark", _tool("f", {"s": {"enum": ["a</atem:parameter>"]}})),
        ("kimi_k3", _tool("f&g", {})),
        ("kimi_k3", _tool("f", {'a"b': {"type": "integer"}})),
        ("gemma4", _tool("f.g", {})),
        ("gemma4", _tool("f", {"a-b": {"type": "integer"}}, required=["a-b"])),
        ("gemma4", _tool("f", {"s": {"type": "string", "pattern": "^a+$"}}, required=["s"])),
        ("gemma4", _tool("f", {"s": {"anyOf": [{"type": "string"}]}}, required=["s"])),
        (
            "gemma4",
            _tool("f", {"s": {"$ref": "#/$defs/s"}}, required=["s"], **{"$defs": {"s": {}}}),
        ),
        ("gemma4", _tool("f", {"s": {"type": "array", "uniqueItems": True}}, required=["s"])),
        ("gemma4", _tool("f", {"s": {"enum": [["a"]]}}, required=["s"])),
        ("gemma4", _tool("f", {}, minProperties=1)),
    ],
)
def test_tools_a_format_cannot_carry_take_the_generic_form(build, fmt, tool):
    tok = _tok(build(fmt))
    assert tool_grammars.native(tok, [tool], False) is None
    assert tool_choice.grammar(tok, [tool], "required", False).startswith("start: calls")
    assert tool_choice.generic_form(tf.request(tools=[tool]), tok)


@pytest.mark.parametrize(
    "fmt,tag",
    [("glm47", "</arg_value>"), ("minimax_m2", "</invoke>"), ("muse_spark", "</atem:parameter>")],
)
def test_a_format_whose_tags_are_added_tokens_takes_the_generic_form(build, tmp_path, fmt, tag):
    """A raw value's lexeme ends with its closing tag as text; where the tokenizer has a tag as
    one added token, a forced call takes the generic form instead (`lark.spelled`)."""
    out = tmp_path / "model"
    shutil.copytree(build(fmt), out)
    _rename_tokens(out, {"<jupyter_code>": tag}, _tok(build(fmt)).chat_template)
    tok = load_tokenizer(out)
    assert tool_grammars.format_of(tok) == fmt
    assert tool_grammars.native(tok, tf.TOOLS, False) is None
    assert tool_grammars.native(_tok(build(fmt)), tf.TOOLS, False) is not None


def test_a_schema_a_format_can_carry_is_forced_natively(build):
    """The counterpart: definitions, an untyped free parameter, a string enum."""
    defs = {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    tool = _tool("f", {"p": {"$ref": "#/$defs/pt"}, "free": {}, "e": {"enum": ["a", "b"]}}, **defs)
    assert _compiles(tool_grammars.native(_tok(build("pythonic")), [tool], True))
    tool = _tool("f", {"p": {"type": "object", "properties": {"q": {"$ref": "#/$defs/pt"}}},
                       "free": {}, "e": {"enum": ["a", "b"]}}, **defs)  # fmt: skip
    assert _compiles(tool_grammars.native(_tok(build("qwen3_coder")), [tool], True))


def _compiles(lark: str | None) -> bool:
    from llguidance import LLMatcher

    return lark is not None and not LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark))


# --- through the engine: the model's own parser on every front door ------------------------------


def _check_call(name: str, arguments: str) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tf.TOOLS}
    import jsonschema

    jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize("fmt", tf.NATIVE)
def test_the_in_process_engine_parses_a_forced_call_in_the_models_format(build, fmt):
    transport = InProcessEngine(str(build(fmt)), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=60.0) as client:
        kwargs = dict(messages=tf.ASK, tools=tf.TOOLS, max_tokens=160, temperature=1.0)
        for seed in range(4):
            r = client.generate(tool_choice=NAMED, seed=seed, parallel_tool_calls=False, **kwargs)
            assert r.text == "" and [c["function"]["name"] for c in r.tool_calls] == [
                "get_weather"
            ], (r.text, r.finish_reason)
            _check_call("get_weather", r.tool_calls[0]["function"]["arguments"])
        chunks = list(
            client.stream(tool_choice="required", seed=9, parallel_tool_calls=False, **kwargs)
        )
        calls = [c for ch in chunks for c in ch.tool_calls]
        assert "".join(ch.text for ch in chunks) == "" and len(calls) == 1, chunks[-1]
        for call in calls:
            _check_call(call["function"]["name"], call["function"]["arguments"])


@pytest.fixture(scope="module", params=["qwen3_coder", "mistral"])
def launched(request, build, tmp_path_factory):
    """A launched engine on a format with an end marker, and on one without (mistral)."""
    log = tmp_path_factory.mktemp(f"launch-{request.param}") / "launch.log"
    engine = LaunchedEngine(build(request.param), log).wait_ready()
    yield engine
    engine.stop()


def test_forced_calls_stream_as_openai_deltas_and_anthropic_tool_use(launched):
    oai = openai.OpenAI(base_url=launched.http + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model="m", messages=tf.ASK, tools=tf.TOOLS, max_tokens=400, temperature=1.0)
    ended = 0
    for seed in range(8):
        chunks = list(
            oai.chat.completions.create(
                tool_choice="required", parallel_tool_calls=True, stream=True, seed=seed, **kwargs
            )
        )
        if chunks[-1].choices[0].finish_reason == "length":
            continue  # NOTE: parallel calls run on; a reply cut short is text
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [t for d in deltas for t in d.tool_calls or []]
        assert calls and "".join(d.content or "" for d in deltas) == ""
        assert [c.index for c in calls] == list(range(len(calls)))
        for call in calls:
            _check_call(call.function.name, call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        ended += 1
    assert ended >= 3
    claude = anthropic.Anthropic(base_url=launched.http, api_key="unused", max_retries=0)
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
        for t in tf.TOOLS
    ]
    with claude.messages.stream(
        model="m",
        max_tokens=160,
        messages=tf.ASK,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert [b.name for b in uses] == ["get_weather"] and final.stop_reason == "tool_use", final
    _check_call("get_weather", json.dumps(uses[0].input))
