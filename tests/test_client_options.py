"""The SDK's `generate` / `stream` keywords (engine/generate_options.py): every sampling field
is typed there, and each keyword lands where the engine reads it."""

from __future__ import annotations

import pytest

from engine.generate_options import FILLED_IN, REQUEST_KEYS, GenerateOptions, generate_message
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


def test_every_sampling_field_is_a_typed_keyword():
    """A field added to SamplingParams without its keyword would be untyped in the SDK."""
    sampling = set(GenerateOptions.__annotations__) - REQUEST_KEYS
    assert sampling | FILLED_IN == set(SamplingParams.__struct_fields__)
    assert not sampling & FILLED_IN
    assert REQUEST_KEYS <= set(GenerateOptions.__annotations__)


def test_request_keywords_stay_out_of_the_sampling_params():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msg = generate_message(
        None,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "rid": "mine",
            "timeout": 3.0,
            "max_tokens": 4,
            "temperature": 0.0,
        },
        "fresh",
    )
    assert msg.rid == "mine" and msg.tools == tools and msg.prompt is None
    assert msg.tool_choice == "required" and msg.parallel_tool_calls is False
    assert msg.params == {"max_tokens": 4, "temperature": 0.0}
    SamplingParams.parse(msg.params)  # NOTE: what the engine does with them; raises on a stray key


def test_defaults_a_fresh_rid_and_parallel_tool_calls():
    msg = generate_message("hello", {"rid": None}, "fresh")
    assert (msg.rid, msg.prompt, msg.params) == ("fresh", "hello", {})
    assert msg.parallel_tool_calls is True and msg.tool_choice is None
