"""The stream parser (`tool_calls.ToolCallStream`) on every tool-call format mlx-lm parses: a
call written in each format's own syntax, fed at every split of its text, comes back as the same
structured calls, with the text around it as content.

Pure: mlx-lm's parser modules and their markers, no model. The texts are written here in the
shapes each parser reads (mlx_lm/tool_parsers/*.py).
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest

from tokenizer_proc.tool_calls import ToolCallStream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
TOOLS = [WEATHER]
ARGS = {"city": "Paris", "days": 2}

# NOTE: the text between each format's markers for get_weather(city="Paris", days=2)
BODIES: dict[str, str] = {
    "json_tools": '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
    "qwen3_coder": (
        "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n"
    ),
    "mistral": 'get_weather[ARGS]{"city": "Paris", "days": 2}',
    "pythonic": '[get_weather(city="Paris", days=2)]',
    "glm47": (
        "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value>"
    ),
    "laguna": (
        "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value>"
    ),
    "longcat": (
        "get_weather<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>Paris"
        "</longcat_arg_value><longcat_arg_key>days</longcat_arg_key>"
        "<longcat_arg_value>2</longcat_arg_value>"
    ),
    "gemma4": 'call:get_weather{city:<|"|>Paris<|"|>,days:2}',
    "function_gemma": "call:get_weather{city:<escape>Paris<escape>,days:2}",
    "kimi_k2": (
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 2}<|tool_call_end|>'
    ),
    "kimi_k3": (
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|>"
    ),
    "minimax_m2": (
        '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">2</parameter>\n</invoke>\n'
    ),
    "minicpm5": '"get_weather"><param name="city">Paris</param><param name="days">2</param>',
    "muse_spark": (
        '<atem:invoke name="get_weather"><atem:parameter name="city">Paris</atem:parameter>'
        '<atem:parameter name="days">2</atem:parameter></atem:invoke>'
    ),
}


def _module(fmt: str) -> Any:
    return importlib.import_module(f"mlx_lm.tool_parsers.{fmt}")


def _stream(fmt: str) -> ToolCallStream:
    m = _module(fmt)
    return ToolCallStream(m.tool_call_start, m.tool_call_end, m.parse_tool_call, TOOLS)


def _run(fmt: str, text: str, cuts: tuple[int, ...]) -> tuple[str, list[dict[str, Any]]]:
    s = _stream(fmt)
    bounds = [0, *cuts, len(text)]
    pieces = [s.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    pieces.append(s.finish())
    return "".join(p[0] for p in pieces), [c for p in pieces for c in p[1]]


def test_every_parser_of_mlx_lm_has_a_body_here():
    """A new format in mlx-lm gets a body here (its stream parsing is then tested)."""
    from pkgutil import iter_modules

    import mlx_lm.tool_parsers as pkg

    assert {m.name for m in iter_modules(pkg.__path__)} == set(BODIES)


@pytest.mark.parametrize("fmt", sorted(BODIES))
def test_each_format_streams_its_call_at_every_split(fmt):
    m = _module(fmt)
    # NOTE: mistral has no end marker: its call runs to the end of the output
    after = "" if not m.tool_call_end else " Done."
    text = "Let me see. " + m.tool_call_start + BODIES[fmt] + m.tool_call_end + after
    for cut in range(len(text) + 1):
        for cuts in ((cut,), (cut, min(len(text), cut + 3))):
            content, calls = _run(fmt, text, cuts)
            assert content == "Let me see. " + after, (fmt, cuts, content)
            assert [c["function"]["name"] for c in calls] == ["get_weather"], (fmt, cuts)
            assert json.loads(calls[0]["function"]["arguments"]) == ARGS, (fmt, cuts, calls)
            assert [c["index"] for c in calls] == [0]


def test_mistral_calls_run_to_the_end_and_are_parsed_at_finish():
    """Its end marker is empty: nothing is parsed while the output runs (an empty end matched
    at once and the call was parsed empty, lost), all of it at `finish()`."""
    s = _stream("mistral")
    assert s.feed('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"') == ("Sure. ", [])
    assert s.feed(', "days": 2}[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}') == ("", [])
    content, calls = s.finish()
    assert content == ""
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [ARGS, {"city": "Nice"}]
    assert [c["index"] for c in calls] == [0, 1]


def test_mistral_call_that_does_not_parse_comes_back_as_text():
    s = _stream("mistral")
    assert s.feed('[TOOL_CALLS]get_weather[ARGS]{"city": ') == ("", [])
    assert s.finish() == ('[TOOL_CALLS]get_weather[ARGS]{"city": ', [])


def test_a_complete_call_that_does_not_parse_comes_back_as_text():
    """A block between both markers that the parser refuses is the model's text, not dropped."""
    s = _stream("json_tools")
    assert s.feed("a <tool_call>{broken</tool_call> b") == (
        "a <tool_call>{broken</tool_call> b",
        [],
    )
    assert s.finish() == ("", [])


def test_a_parser_raising_anything_is_an_unparsable_call():
    """mlx-lm's parsers raise more than ValueError (longcat: AttributeError on a body without
    its keys; qwen3_coder: OverflowError on an integer past a float's range)."""
    s = _stream("longcat")
    text = "<longcat_tool_call>no keys here</longcat_tool_call>"
    assert s.feed(text) == (text, [])
    s = _stream("qwen3_coder")
    body = "<tool_call>\n<function=get_weather>\n<parameter=days>\n" + "9" * 400
    text = body + "\n</parameter>\n</function>\n</tool_call>"
    assert s.feed(text) == (text, [])


def test_start_equal_to_end_alternates():
    """A format whose start and end markers are the same text (none in mlx-lm today)."""
    parse = _module("json_tools").parse_tool_call
    s = ToolCallStream("|", "|", parse, TOOLS)
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    content, calls = s.feed(f"a |{call}| b |{call}")
    more, last = s.finish()
    assert content + more == "a  b " and len(calls + last) == 2


def test_a_call_json_cannot_carry_comes_back_as_text():
    """`1e400` is inf to Python, which JSON cannot hold (json.dumps wrote `Infinity`); a name
    that is not a string is no call either."""
    s = _stream("json_tools")
    inf = '<tool_call>{"name": "get_weather", "arguments": {"days": 1e400}}</tool_call>'
    nameless = '<tool_call>{"name": 5, "arguments": {}}</tool_call>'
    assert s.feed(inf + nameless) == (inf + nameless, [])
