"""The reasoning split (tokenizer_proc/reasoning.py): a thought apart from the answer, however
the text is cut into deltas, whether the prompt opened the thought or the model did."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenizer_proc.reasoning import Markers, ReasoningStream, markers_of, opens_inside

THINK = Markers("<think>", "</think>", (7,), (8,))


def _split(text: str, cut: int, inside: bool = False) -> tuple[str, str]:
    """`text` fed in pieces of `cut` characters, then finished: (reasoning, answer)."""
    stream = ReasoningStream(THINK, inside)
    reasoning, answer = "", ""
    for i in range(0, len(text), cut):
        r, a = stream.feed(text[i : i + cut])
        reasoning, answer = reasoning + r, answer + a
    r, a = stream.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 100])
def test_a_thought_is_apart_from_the_answer_however_the_text_is_cut(cut):
    text = "<think>first, 2 < 3; then </thin</think>\n\nThe answer: <b>4</b>\n"
    assert _split(text, cut) == ("first, 2 < 3; then </thin", "The answer: <b>4</b>\n")


@pytest.mark.parametrize("cut", [1, 4, 100])
def test_a_prompt_that_opened_the_thought_starts_inside_it(cut):
    assert _split("weigh it</think>\n\nyes", cut, inside=True) == ("weigh it", "yes")


def test_a_thought_cut_short_is_all_reasoning():
    """max_tokens inside the thought: what came is reasoning, the answer is empty."""
    assert _split("<think>still think", 3) == ("still think", "")
    assert _split("<think>still </thi", 1) == ("still </thi", "")


def test_text_without_markers_is_the_answer():
    assert _split("plain <thinking> text <", 2) == ("", "plain <thinking> text <")


def test_an_answer_keeps_its_own_leading_blank_lines_without_a_thought():
    assert _split("\n\nhello", 1) == ("", "\n\nhello")


def test_the_prompts_last_marker_says_where_generation_starts():
    assert opens_inside([1, 2, 7], THINK)
    assert opens_inside([1, 7, 5, 6], THINK)
    assert not opens_inside([1, 7, 5, 8, 9], THINK)  # NOTE: the template closed it (thinking off)
    assert not opens_inside([1, 2, 3], THINK)
    assert not opens_inside([1, 7], None)
    # NOTE: only the prompt's tail is searched: a long prompt costs the same
    assert opens_inside(list(range(20, 100_000)) + [7, 5], THINK)
    assert not opens_inside([7] + [5] * 100_000, THINK)


def test_the_markers_come_from_the_tokenizer_unless_turned_off():
    tok = SimpleNamespace(
        has_thinking=True,
        think_start="<think>",
        think_end="</think>",
        think_start_tokens=(7,),
        think_end_tokens=(8,),
    )
    assert markers_of(tok, "auto") == THINK
    assert markers_of(tok, "none") is None
    assert markers_of(SimpleNamespace(has_thinking=False), "auto") is None


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_the_scheduler_ends_a_thought_at_its_budget(tiny_think_model_dir, overlap):
    """The token after the budget's last is replaced by the end marker, in the overlap loop
    (the chain stops for it: the next step takes the marker as its input) and the sync loop."""
    from scheduler_util import drive, make_scheduler, tiny_model
    from think_model import FINAL

    from engine.sampling_params import SamplingParams
    from engine.tokenizer_loader import load_tokenizer

    tok = load_tokenizer(tiny_think_model_dir)
    model = tiny_model(tiny_think_model_dir)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    (start,), (end,) = tok.think_start_tokens, tok.think_end_tokens
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    sched = make_scheduler(model, disable_overlap=not overlap)
    for budget, thought in ((2, "Count apples"), (1, "Count"), (9, "Count apples then add")):
        params = SamplingParams(
            max_tokens=12,
            temperature=0.0,
            think_budget=budget,
            think_start_id=start,
            think_end_id=end,
            think_inside=True,
            stop_token_ids=[im_end],
        )
        outs = drive(sched, {0: [(f"b{budget}", list(prompt), params)]})
        ids = [t for o in outs[f"b{budget}"] for t in o.token_ids]
        assert tok.decode(ids[:-1]) == f"{thought}</think>{FINAL}", (budget, tok.decode(ids))


def test_the_in_process_engine_counts_a_thought_the_prompt_opened(tiny_think_model_dir):
    """The budget's count starts inside the thought the template opened on every front door
    (`Admission.for_prompt`), the in-process engine's as the launched one's."""
    from think_model import FINAL

    from engine.client import EngineClient
    from mlx_engine.inprocess import InProcessEngine

    transport = InProcessEngine(str(tiny_think_model_dir), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=30.0) as client:
        r = client.generate(
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            temperature=0.0,
            think_budget=2,
        )
    assert (r.reasoning, r.text) == ("Count apples", FINAL), r


def test_sdk_chats_have_their_thought_apart_as_the_chat_route(tiny_think_model_dir):
    """An SDK chat's thought comes in `reasoning`, out of `text` (whole and streamed, a marker
    cut between chunks held back); `--reasoning-parser none` and prompts that are no chat keep
    the text as written."""
    from think_model import FINAL, REASONING

    from engine.client import EngineClient
    from engine.tokenizer_loader import load_tokenizer
    from mlx_engine.inprocess import InProcessEngine

    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0.0}
    transport = InProcessEngine(str(tiny_think_model_dir), max_total_tokens=4096)
    with EngineClient(transport=transport, timeout=30.0) as client:
        r = client.generate(**ask)
        assert (r.reasoning, r.text) == (REASONING, FINAL), r
        chunks = list(client.stream(**ask))
        assert "".join(c.reasoning for c in chunks) == REASONING
        assert "".join(c.text for c in chunks) == FINAL
        ids = load_tokenizer(tiny_think_model_dir).apply_chat_template(
            ask["messages"], add_generation_prompt=True
        )
        plain = client.generate(input_ids=ids, max_tokens=20, temperature=0.0)
        assert (plain.reasoning, plain.text) == ("", f"{REASONING}</think>{FINAL}")
    transport = InProcessEngine(
        str(tiny_think_model_dir), max_total_tokens=4096, reasoning_parser="none"
    )
    with EngineClient(transport=transport, timeout=30.0) as client:
        r = client.generate(**ask)
        assert (r.reasoning, r.text) == ("", f"{REASONING}</think>{FINAL}"), r


@pytest.mark.parametrize("cut", [1, 3, 7, 100])
def test_a_marker_after_the_thought_or_inside_the_answer_is_text(cut):
    """One thought, where the reply starts: a tool call's argument or an answer about this
    markup may spell the markers, and stays answer text (it was read as a second thought,
    which swallowed the rest of the reply)."""
    text = '<think>plan</think>\n\n<tool_call>{"code": "<think>x</think> y"}</tool_call>'
    assert _split(text, cut) == ("plan", '<tool_call>{"code": "<think>x</think> y"}</tool_call>')
    assert _split("see <think>tags</think> here", cut) == ("", "see <think>tags</think> here")
    assert _split("done</think>ok <think>no", cut, inside=True) == ("done", "ok <think>no")
    assert _split("\n\n<think>a</think>b", cut)[0] == "a", "blank lines before a thought"
