"""Forced tool calls on a model that speaks gpt-oss's harmony format
(tokenizer_proc/harmony_calls.py): an optional thought, then one call in harmony's syntax, and
nothing the engine's reader of the reply (`reply_split.ReplySplit`, so `harmony.HarmonyStream`)
would not read back as that call with arguments valid for the tool's schema, the thought as
reasoning. Checked on texts, on random walks of the grammar's token masks, and on replies sampled
at temperature 1 through the scheduler from tiny models with gpt-oss's own template (its
generation prompt stops after the role) and with tests/harmony_model.py's (its prompt opens the
analysis message). Through a launched engine: tests/test_harmony.py."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import numpy as np
import pytest
import tool_formats as tf
from harmony_model import make_call_model
from template_models import EOS, make_template_tokenizer

from engine.messages.to_client import Chunk
from engine.messages.to_tokenizer import Generate
from engine.random_model import TINY_LLAMA, TOKENIZER_FILES, make_random_model
from tokenizer_proc import harmony_calls, tool_choice
from tokenizer_proc.harmony import CALL, CHANNEL, END, MESSAGE, START
from tokenizer_proc.prepare import token_ids
from tokenizer_proc.reasoning import markers_of, opens_inside
from tokenizer_proc.reply_split import Piece, ReplySplit

# NOTE: tool_formats' tools, each with the description gpt-oss's template writes
TOOLS = [
    {"type": "function", "function": {**t["function"], "description": "a tool"}} for t in tf.TOOLS
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
THINK = f"{CHANNEL}analysis{MESSAGE}"
SPLIT = "\x00"  # NOTE: where a text is tokenized apart (`_accepts`)


def _request(choice: Any = "required", parallel: bool = False, chat: bool = True) -> Generate:
    ask = {"messages": tf.ASK} if chat else {"prompt": "What should I do?"}
    return Generate(rid="r", tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, **ask)


def _call(name: str, args: str) -> str:
    return f"{harmony_calls.call_header(name)}{args}{CALL}"


def _thought(text: str) -> str:
    return f"{THINK}{text}{END}{START}assistant"


# --- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, default_model_dir: Path) -> Path:
    """A tiny random llama with gpt-oss's template and its harmony markers, special added
    tokens as in gpt-oss's tokenizer (tests/template_models.py); `<|return|>` its eos."""
    out = tmp_path_factory.mktemp("gpt-oss")
    make_random_model(out, TINY_LLAMA, tokenizer_from=default_model_dir)
    tokenizer = make_template_tokenizer(
        "gpt_oss", tmp_path_factory.mktemp("gpt-oss-tokenizer"), default_model_dir
    )
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return out


@pytest.fixture(scope="module")
def opened(tmp_path_factory, default_model_dir: Path) -> Path:
    """tests/harmony_model.py's call model: its generation prompt opens the analysis message."""
    return make_call_model(tmp_path_factory.mktemp("harmony-opened"), default_model_dir)


_tok, _llg_tokenizer = tf.tokenizer_of, tf.llg_tokenizer


# --- reading a reply back as the engine does ---------------------------------------------------


def _read(tok: Any, msg: Generate, text: str, inside: bool, parser: str = "auto") -> Piece:
    """`text`, a whole reply, as the engine splits it (`inside`: the prompt opened a thought)."""
    split = ReplySplit(msg, tok, markers_of(tok, parser))
    split.begin(inside)
    return split.piece(Chunk(msg.rid, text=text, token_ids=[0], finish_reason="stop"))


def _wrong(tok: Any, msg: Generate, text: str, inside: bool) -> str | None:
    """None when `text` reads back as one call to one of `msg`'s chosen tools, its arguments
    valid for the tool's schema, its thought (if any) the reasoning; else what is wrong."""
    piece = _read(tok, msg, text, inside)
    if piece.text or len(piece.calls) != 1:
        return f"not one call: text {piece.text!r}, {len(piece.calls)} calls"
    thought = text.partition(THINK)[2].partition(END)[0] if text.startswith(THINK) else ""
    if piece.reasoning != thought:
        return f"reasoning {piece.reasoning!r}, thought {thought!r}"
    fn = piece.calls[0]["function"]
    choice = tool_choice.normalize(msg.tool_choice)
    schemas = {
        t["function"]["name"]: t["function"]["parameters"]
        for t in msg.tools or []
        if not isinstance(choice, tuple) or t["function"]["name"] == choice[1]
    }
    if fn["name"] not in schemas:
        return f"a call to {fn['name']!r}, not a chosen tool"
    try:
        jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{fn['name']}: {str(e).splitlines()[0]}"
    return None


def _accepts(model_dir: Path, lark: str, text: str) -> bool:
    from llguidance import LLMatcher

    tok = _llg_tokenizer(model_dir)
    matcher = LLMatcher(tok, LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    # NOTE: each piece tokenized alone: a marker's text split in two is ordinary tokens
    ids = [i for piece in text.split(SPLIT) for i in tok.tokenize_str(piece)]
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


# --- which form a forced call takes ------------------------------------------------------------


def test_a_harmony_chat_is_forced_into_harmony_and_read_by_channel(gpt_oss, opened):
    for model in (gpt_oss, opened):
        tok = _tok(model)
        for choice in ("required", NAMED):
            assert not tool_choice.generic_form(_request(choice), tok)
            lark = tool_choice.grammar(tok, TOOLS, tool_choice.normalize(choice), False)
            assert lark is not None and lark.startswith("start: thought? call"), lark[:80]
        # NOTE: parallel calls or not, one call: `<|call|>` stops the reply
        assert tool_choice.grammar(tok, TOOLS, "required", True) == (
            tool_choice.grammar(tok, TOOLS, "required", False)
        )
    # NOTE: a prompt's reply is not read by channel (`reply_split.for_sdk`): the generic form
    tok = _tok(gpt_oss)
    assert tool_choice.generic_form(_request(chat=False), tok)
    assert tool_choice.grammar(tok, TOOLS, "required", False, chat=False).startswith("start: calls")


@pytest.mark.parametrize(
    "name",
    ["two words", "a<b", "new\nline", "x" * 300],
    ids=["space", "angle", "newline", "too-long"],
)
def test_a_name_the_parser_would_not_read_back_takes_the_generic_form(gpt_oss, name):
    tools = [*TOOLS, {"type": "function", "function": {"name": name}}]
    msg = Generate(rid="r", messages=tf.ASK, tools=tools, tool_choice="required")
    assert tool_choice.generic_form(msg, _tok(gpt_oss))
    assert harmony_calls.grammar(_tok(gpt_oss), tools) is None


def test_a_tokenizer_whose_markers_are_not_one_token_takes_the_generic_form(gpt_oss):
    tok = _tok(gpt_oss)

    def encode(text: str, add_special_tokens: bool = False) -> list[int]:
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        return [*ids, *ids] if text == CALL else ids

    spelled = SimpleNamespace(chat_template=tok.chat_template, encode=encode)
    assert harmony_calls.grammar(spelled, TOOLS) is None
    assert tool_choice.generic_form(_request(), spelled)


# --- what the grammar takes and what it refuses ------------------------------------------------

WEATHER_ARGS = '{"city": "Paris", "days": 3}'
GOOD = [
    _call("now", "{}"),
    _call("get_weather", WEATHER_ARGS),
    _thought("") + _call("now", "{}"),
    _thought("Need the weather: < | end |> is no marker.\n") + _call("get_weather", WEATHER_ARGS),
    _call("place_order", '{"item": "tea", "quantity": 2.5, "address": {"street": "Main"}}'),
    # NOTE: a marker's text spelled in ordinary tokens reads the same as its token
    f"<{SPLIT}|channel|>{SPLIT}" + _call("now", "{}").removeprefix(CHANNEL),
]
BAD = [
    _call("now", '{"x": 1}'),  # NOTE: off the schema
    _call("get_weather", '{"city": "Paris"}'),  # NOTE: a required parameter left out
    _call("get_weather", '{"city": "Paris", "days": 30}'),
    _call("nope", "{}"),
    _call("now", "[]"),
    _call("now", "{}") + _call("now", "{}"),  # NOTE: one call, parallel or not
    _thought("two") + _thought("thoughts") + _call("now", "{}"),
    _thought("a marker spelled: <" + SPLIT + "|end|>" + SPLIT + " in it") + _call("now", "{}"),
    _thought("no call"),
    "Sure." + _call("now", "{}"),
    f"{CHANNEL}final{MESSAGE}No call.<|return|>",
    f"{CHANNEL}commentary to=functions.now json{MESSAGE}{{}}{CALL}",
    f" to=functions.now{CHANNEL}commentary json{MESSAGE}{{}}{CALL}",  # NOTE: see harmony_calls
    _call("now", "{}").replace(CALL, END),
    _call("now", " {}"),
    _call("now", "{}") + "\n",
]


@pytest.mark.parametrize("model", ["gpt_oss", "opened"])
def test_the_grammar_takes_calls_the_parser_reads_back_and_refuses_the_rest(request, model):
    model_dir = request.getfixturevalue(model)
    tok = _tok(model_dir)
    inside = model == "opened"
    for parallel in (False, True):
        msg = _request(parallel=parallel)
        lark = tool_choice.grammar(tok, TOOLS, "required", parallel)
        assert lark is not None
        for text in GOOD:
            assert _accepts(model_dir, lark, text), text
            assert _wrong(tok, msg, text.replace(SPLIT, ""), inside) is None, text
            # NOTE: the stop token dropped (a tokenizer that names it special): the same call
            cut = text.replace(SPLIT, "").removesuffix(CALL)
            assert _read(tok, msg, cut, inside).calls[0]["function"]["name"] in text
        for text in BAD:
            assert not _accepts(model_dir, lark, text), text
    named = tool_choice.grammar(tok, TOOLS, ("function", "get_weather"), False)
    assert named is not None
    assert _accepts(model_dir, named, _call("get_weather", WEATHER_ARGS))
    assert not _accepts(model_dir, named, _call("now", "{}"))


def test_the_thought_and_the_arguments_hold_no_marker_token(gpt_oss):
    """llguidance's mask lets no special token into the thought's text or a JSON string: in
    the thought only `<|end|>` may come of harmony's markers, in the arguments none, after them
    only `<|call|>`."""
    tok = _tok(gpt_oss)
    lark = tool_choice.grammar(tok, TOOLS, "required", False)
    markers = {m: tok.encode(m, add_special_tokens=False)[0] for m in harmony_calls.MARKERS}
    markers["<|return|>"] = EOS
    think = THINK + "Need"
    args = harmony_calls.call_header("get_weather") + '{"city": "Pa'
    done = harmony_calls.call_header("now") + "{}"
    expect = {think: {END}, args: set(), done: {CALL}}
    for prefix, allowed in expect.items():
        mask = _mask(gpt_oss, lark, prefix)
        assert {m for m, i in markers.items() if mask[i]} == allowed, prefix


def _mask(model_dir: Path, lark: str, prefix: str) -> np.ndarray:
    """Which tokens the grammar lets come after `prefix`, one bool a token."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    llg = _llg_tokenizer(model_dir)
    matcher = LLMatcher(llg, LLMatcher.grammar_from_lark(lark), log_level=0)
    ids = llg.tokenize_str(prefix)
    assert matcher.try_consume_tokens(ids) == len(ids), matcher.get_error()
    bits = allocate_token_bitmask(1, llg.vocab_size)
    fill_next_token_bitmask(matcher, bits, 0)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[: llg.vocab_size].astype(bool)


# --- random walks of the grammar's masks -------------------------------------------------------

WALKS, WALK_STEPS = 80, 300


def _walk(model_dir: Path, lark: str, rng: random.Random, end: int) -> list[int] | None:
    """A reply made of tokens drawn at random from each step's mask, `<|end|>` taken a tenth
    of the times it may come (a thought then ends, as a random model's seldom does); None
    where it does not end within WALK_STEPS."""
    from llguidance import LLMatcher
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    llg = _llg_tokenizer(model_dir)
    matcher = LLMatcher(llg, LLMatcher.grammar_from_lark(lark), log_level=0)
    bits = allocate_token_bitmask(1, llg.vocab_size)
    ids: list[int] = []
    while not matcher.is_stopped():
        if len(ids) == WALK_STEPS:
            return None
        fill_next_token_bitmask(matcher, bits, 0)
        mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[: llg.vocab_size]
        allowed = np.flatnonzero(mask)
        token = end if mask[end] and rng.random() < 0.1 else int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        ids.append(token)
    return ids


@pytest.mark.parametrize("model", ["gpt_oss", "opened"])
def test_random_walks_of_the_grammar_read_back_as_one_valid_call(request, model):
    model_dir = request.getfixturevalue(model)
    tok = _tok(model_dir)
    end = tok.encode(END, add_special_tokens=False)[0]
    rng = random.Random(7)
    for choice in ("required", NAMED):
        msg = _request(choice)
        lark = tool_choice.grammar(tok, TOOLS, tool_choice.normalize(choice), False)
        assert lark is not None
        texts = [tok.decode(ids) for _ in range(WALKS) if (ids := _walk(model_dir, lark, rng, end))]
        bad = [(t, why) for t in texts if (why := _wrong(tok, msg, t, model == "opened"))]
        assert not bad, bad[:3]
        thoughts = sum(t.startswith(THINK) for t in texts)
        assert len(texts) >= WALKS * 0.8 and 0.2 * len(texts) <= thoughts <= 0.8 * len(texts)


# --- sampled at temperature 1 through the scheduler --------------------------------------------

# NOTE: (tool_choice, samples, share that must end): a random model seldom ends a thought (one
# token of 49,152), so the replies that open one run to max_tokens (the walks above end theirs)
RUNS = [("required", 64, 0.2), (NAMED, 24, 0.2)]
MAX_TOKENS = 64


@pytest.mark.parametrize("model", ["gpt_oss", "opened"])
def test_sampled_forced_calls_read_back_as_one_valid_call(request, model):
    """Every reply that ends is one call to a chosen tool, arguments valid for its schema, and
    one cut short in its thought is all reasoning; the sampler runs the grammar alone, as the
    engine does (tests/tool_formats.py)."""
    model_dir = request.getfixturevalue(model)
    sampler = tf.Sampler(model_dir)
    tok = sampler.tokenizer
    for seed, (choice, samples, share) in enumerate(RUNS):
        msg = _request(choice)
        prompt = token_ids(msg, tok, sampler.scheduler.vocab, 1 << 20)
        inside = opens_inside(prompt, markers_of(tok, "auto"))
        assert inside == (model == "opened")
        replies = sampler.sample(msg, samples, MAX_TOKENS, seed)
        ended = [text for end, text in replies if end == "stop"]
        bad = [(t, why) for t in ended if (why := _wrong(tok, msg, t, inside))]
        assert not bad, (model, choice, bad[:3])
        assert len(ended) >= samples * share, (model, choice, len(ended))
        thinking = [t for end, t in replies if end == "length" and t.startswith(THINK)]
        for text in thinking:
            if END not in text:
                piece = _read(tok, msg, text, inside)
                assert not piece.text and not piece.calls and piece.reasoning, text
        if choice == NAMED:
            assert all("functions.get_weather " in t for t in ended)


def test_a_forced_harmony_call_is_read_by_channel_with_the_reasoning_parser_off(gpt_oss):
    """`--reasoning-parser none` (no markers): the forced call, held to harmony's syntax, is
    still read back as the call (its thought then stays out of the answer as reasoning)."""
    tok = _tok(gpt_oss)
    assert markers_of(tok, "none") is None
    text = _thought("check the city") + _call("get_weather", WEATHER_ARGS)
    piece = _read(tok, _request(), text, False, parser="none")
    assert piece.text == "" and len(piece.calls) == 1
    assert json.loads(piece.calls[0]["function"]["arguments"]) == json.loads(WEATHER_ARGS)
