"""A thinking model's thought apart from its answer on every HTTP route, through the official
`openai` and `anthropic` clients, whole and streamed: `reasoning_content` / `reasoning` and the
reasoning tokens in usage (chat completions), `thinking` blocks (messages), `reasoning` items
(responses); a thought cut short by max_tokens; `chat_template_kwargs` and `thinking: disabled`
(the template's empty thought); `--reasoning-parser none` (the thought stays in the text).

The model (tests/think_model.py) answers every chat with the same thought, then "Four.", and its
template opens the thought in the generation prompt, so the split starts inside it."""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401
from think_model import FINAL, REASONING

pytestmark = pytest.mark.usefixtures("bounded")
ASK = [{"role": "user", "content": "What is two plus two?"}]
# NOTE: the anthropic client takes sampling fields only as extra body fields
GREEDY = {"extra_body": {"temperature": 0.0}}
# NOTE: the thought's tokens, "</think>", then the answer's two: the whole scripted reply
THOUGHT_TOKENS = 5


@pytest.fixture(scope="module")
def engine(tiny_think_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning") / "launch.log"
    launched = LaunchedEngine(tiny_think_model_dir, log).wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def oai(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="x", max_retries=0, timeout=30)


def _chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model="m", messages=ASK, temperature=0.0, **kw)


def test_a_chat_completion_has_its_thought_apart(oai):
    r = _chat(oai, max_tokens=20)
    message = r.choices[0].message
    assert message.content == FINAL
    extra = message.model_extra or {}
    assert extra["reasoning_content"] == REASONING and extra["reasoning"] == REASONING
    assert r.usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    assert r.choices[0].finish_reason == "stop"


def test_a_streamed_chat_completion_has_its_thought_apart(oai):
    deltas = list(_chat(oai, max_tokens=20, stream=True, stream_options={"include_usage": True}))
    reasoning = "".join(
        (d.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for d in deltas
        if d.choices
    )
    content = "".join(d.choices[0].delta.content or "" for d in deltas if d.choices)
    assert (reasoning, content) == (REASONING, FINAL)
    assert deltas[-1].usage.completion_tokens_details.reasoning_tokens == THOUGHT_TOKENS


def test_a_thought_cut_short_ends_with_length_and_no_answer(oai):
    r = _chat(oai, max_tokens=2)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert (message.model_extra or {})["reasoning_content"] == "Count apples"
    assert not message.content


def test_a_messages_reply_has_a_thinking_block(engine):
    client = anthropic.Anthropic(base_url=engine.http, api_key="x", max_retries=0, timeout=30)
    msg = client.messages.create(model="m", max_tokens=20, messages=ASK, **GREEDY)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == REASONING and msg.content[1].text == FINAL
    with client.messages.stream(model="m", max_tokens=20, messages=ASK, **GREEDY) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[0].thinking == REASONING and streamed.content[1].text == FINAL


def test_a_response_has_a_reasoning_item(oai):
    r = oai.responses.create(model="m", input=ASK, max_output_tokens=20, temperature=0.0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == FINAL
    events = list(
        oai.responses.create(
            model="m", input=ASK, max_output_tokens=20, temperature=0.0, stream=True
        )
    )
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == REASONING
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"]


def test_thinking_turned_off_renders_the_templates_empty_thought(engine, oai):
    """`chat_template_kwargs` (and Anthropic's `thinking: disabled`) reach the template: the
    prompt closes the thought, so nothing of the reply is reasoning."""
    on = post_json(engine, "/tokenize", {"messages": ASK})[1]["tokens"]
    off_body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    off = post_json(engine, "/tokenize", off_body)[1]["tokens"]
    # NOTE: the same prompt up to the opened thought, which the template now closes at once
    assert off[: len(on) - 1] == on[:-1] and len(off) > len(on)
    r = _chat(oai, max_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    client = anthropic.Anthropic(base_url=engine.http, api_key="x", max_retries=0, timeout=30)
    msg = client.messages.create(
        model="m", max_tokens=4, messages=ASK, thinking={"type": "disabled"}, **GREEDY
    )
    assert all(b.type != "thinking" for b in msg.content)
    count = client.messages.count_tokens(model="m", messages=ASK, thinking={"type": "disabled"})
    assert count.input_tokens == len(off)


def test_a_thinking_budget_ends_the_thought_and_the_answer_follows(engine):
    """`thinking: {type: enabled, budget_tokens: 2}`: after two tokens of thought the engine
    forces the end marker (the next sampled token is replaced), and the model answers."""
    client = anthropic.Anthropic(base_url=engine.http, api_key="x", max_retries=0, timeout=30)
    thinking = {"type": "enabled", "budget_tokens": 2}
    for _ in range(2):  # NOTE: the second reads the first's prompt from the prefix cache
        msg = client.messages.create(
            model="m", max_tokens=20, messages=ASK, thinking=thinking, **GREEDY
        )
        assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
        assert msg.content[0].thinking == "Count apples" and msg.content[1].text == FINAL
    for bad in ({"type": "enabled", "budget_tokens": 20}, {"type": "enabled"}, {"type": "x"}):
        status, body = post_json(
            engine,
            "/v1/messages",
            {"model": "m", "max_tokens": 20, "messages": ASK, "thinking": bad},
        )
        assert status == 400 and body["error"]["message"].startswith("thinking"), body


def test_bad_template_kwargs_are_refused_by_name(engine):
    for bad in ([1], {"add_generation_prompt": False}):
        status, body = post_json(
            engine, "/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": bad}
        )
        assert status == 400 and body["error"]["param"] == "chat_template_kwargs", body


def test_with_the_parser_off_the_thought_stays_in_the_text(tiny_think_model_dir, tmp_path):
    launched = LaunchedEngine(
        tiny_think_model_dir, tmp_path / "launch.log", "--reasoning-parser", "none"
    ).wait_ready()
    try:
        client = openai.OpenAI(base_url=launched.http + "/v1", api_key="x", max_retries=0)
        message = _chat(client, max_tokens=20).choices[0].message
        assert message.content == f"{REASONING}</think>{FINAL}"
        assert "reasoning_content" not in (message.model_extra or {})
        budget = {"type": "enabled", "budget_tokens": 2}
        body = {"model": "m", "max_tokens": 20, "messages": ASK, "thinking": budget}
        status, reply = post_json(launched, "/v1/messages", body)
        assert status == 400 and "thinking.budget_tokens" in reply["error"]["message"], reply
    finally:
        launched.stop()


def test_a_reasoning_effort_sets_the_budget_and_the_templates_switch(engine, oai):
    """`reasoning_effort` / `reasoning.effort`: `none` renders the template's empty thought;
    where the request keeps the thought on, `none`'s one-token budget ends it at once; a larger
    effort's budget is past `max_tokens` and changes nothing; Responses count reasoning tokens."""
    r = _chat(oai, max_tokens=4, reasoning_effort="none")
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    kept_on = {"chat_template_kwargs": {"enable_thinking": True}}
    r = _chat(oai, max_tokens=20, reasoning_effort="none", extra_body=kept_on)
    assert (r.choices[0].message.model_extra or {})["reasoning_content"] == "Count"
    assert r.choices[0].message.content == FINAL
    r = _chat(oai, max_tokens=20, reasoning_effort="high")
    assert (r.choices[0].message.model_extra or {})["reasoning_content"] == REASONING
    resp = oai.responses.create(
        model="m", input=ASK, max_output_tokens=20, temperature=0.0, reasoning={"effort": "low"}
    )
    assert resp.output[0].content[0].text == REASONING and resp.output_text == FINAL
    assert resp.usage.output_tokens_details.reasoning_tokens == THOUGHT_TOKENS
    assert resp.reasoning.effort == "low"
    none = {"model": "m", "input": ASK, "max_output_tokens": 4, "reasoning": {"effort": "none"}}
    status, body = post_json(engine, "/v1/responses", none)
    assert status == 200 and [item["type"] for item in body["output"]] == ["message"], body
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_a_bad_reasoning_effort_is_refused_by_name(engine):
    chat = {"messages": ASK, "reasoning_effort": "max"}
    status, body = post_json(engine, "/v1/chat/completions", chat)
    assert status == 400 and body["error"]["param"] == "reasoning_effort", body
    for bad, param in (({"effort": "max"}, "reasoning.effort"), ({"x": 1}, "reasoning")):
        status, body = post_json(engine, "/v1/responses", {"input": ASK, "reasoning": bad})
        assert status == 400 and body["error"]["param"] == param, body


def test_a_model_that_does_not_think_takes_any_effort(tiny_model_dir):
    """Clients send an effort without knowing the model: one without think markers ignores it
    (the SDK's keyword, through the in-process engine); a misspelt one is still refused."""
    from engine.client import EngineClient
    from engine.errors import InvalidRequest
    from mlx_engine.inprocess import InProcessEngine

    transport = InProcessEngine(str(tiny_model_dir), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=30.0) as client:
        kw = {"messages": ASK, "max_tokens": 3, "temperature": 0.0}
        plain = client.generate(**kw)
        assert client.generate(**kw, reasoning_effort="high").token_ids == plain.token_ids
        with pytest.raises(InvalidRequest, match="reasoning_effort"):
            client.generate(**kw, reasoning_effort="max")
