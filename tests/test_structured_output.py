"""Structured output in the scheduler: JSON schemas, regexes and Lark grammars through llguidance
token masks inside the step's graph, beside unconstrained rows that stay untouched."""

from __future__ import annotations

import json
import random
import re

import pytest
from scheduler_util import drive, make_scheduler, reference_greedy, tiny_model, tokens

from engine import constraints
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from engine.tokenizer_loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PHONE = r"\+[0-9]{2} [0-9]{3}-[0-9]{4}"
LARK = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]+/'


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _sched(model, tiny_model_dir, **overrides):
    return make_scheduler(model, (0, 2), tiny_model_dir / "tokenizer.json", **overrides)


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def _check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int)
    assert isinstance(value["tags"], list) and set(value["tags"]) <= {"a", "b"}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_constrained_rows_follow_their_grammar_beside_free_ones(
    model, tok, tiny_model_dir, overlap
):
    """A random model's output matches each row's schema, regex or grammar and ends when it is
    complete ("stop"); the unconstrained rows in the same steps are token for token mlx-lm's."""
    sched = _sched(model, tiny_model_dir, disable_overlap=not overlap)
    greedy = dict(max_tokens=200, temperature=0.0)
    reqs = [
        ("json", _prompt(1), SamplingParams(json_schema=SCHEMA, **greedy)),
        ("regex", _prompt(2), SamplingParams(regex=PHONE, **greedy)),
        ("lark", _prompt(3), SamplingParams(grammar=LARK, **greedy)),
        ("sampled", _prompt(4), SamplingParams(json_schema=SCHEMA, max_tokens=200, seed=5)),
        ("object", _prompt(5), SamplingParams(json_schema={"type": "object"}, **greedy)),
    ]
    free = [(f"free{i}", _prompt(10 + i, 30), SamplingParams(max_tokens=24, temperature=0.0))
            for i in range(3)]  # fmt: skip
    outs = drive(sched, {0: reqs[:3] + free[:2], 3: reqs[3:] + free[2:]})
    text = {rid: tok.decode(tokens(outs[rid])) for rid, _, _ in reqs}
    for rid in ("json", "sampled"):
        _check_schema(text[rid])
    assert re.fullmatch(PHONE, text["regex"]), text["regex"]
    assert re.fullmatch(r"yes|no|maybe [0-9]+", text["lark"]), text["lark"]
    assert isinstance(json.loads(text["object"]), dict)
    assert all(outs[rid][-1].finish_reason == "stop" for rid in ("json", "regex", "sampled"))
    for rid, prompt, _ in free:
        assert tokens(outs[rid]) == reference_greedy(model, prompt, 24), rid
    stats = sched.stats()
    assert stats["grammar_masked_rows"] > 0


def test_constrained_rows_chain_with_each_steps_own_mask(model, tok, tiny_model_dir):
    """Overlap: a chained step's forward goes before the previous token is on the host; its
    sampling waits for the masks that token decides. A mask one step stale would let a letter
    through where this pattern needs a digit."""
    sched = _sched(model, tiny_model_dir)
    pattern = "([a-z][0-9]){12}"
    reqs = [(f"c{i}", _prompt(20 + i), SamplingParams(regex=pattern, max_tokens=60, seed=i))
            for i in range(3)]  # fmt: skip
    reqs.append(("free", _prompt(30), SamplingParams(max_tokens=30, temperature=0.0)))
    outs = drive(sched, {0: reqs})
    for rid, _, _ in reqs[:3]:
        text = tok.decode(tokens(outs[rid]))
        assert re.fullmatch(pattern, text), (rid, text)
        assert outs[rid][-1].finish_reason == "stop"
    assert tokens(outs["free"]) == reference_greedy(model, reqs[3][1], 30)
    assert sched.stats()["steps_chained"] > 5


def test_a_grammar_that_cannot_compile_is_refused_naming_its_field(model, tiny_model_dir):
    for raw, field in [
        ({"regex": "a(b"}, "regex"),
        ({"json_schema": {"type": "nonsense"}}, "json_schema"),
        ({"grammar": "start: missing_rule"}, "grammar"),
        ({"regex": "a", "grammar": 'start: "a"'}, "grammar"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            constraints.check(SamplingParams.parse(raw))
        assert e.value.field == field, (raw, e.value)
    sched = _sched(model, tiny_model_dir)
    with pytest.raises(InvalidRequest, match="regex"):
        sched.submit("bad", [1, 2, 3], SamplingParams(regex="a(b"))
    assert not sched.has_work()


def test_without_a_tokenizer_a_constrained_request_is_refused(model):
    sched = make_scheduler(model, (0, 2))
    with pytest.raises(InvalidRequest, match="tokenizer.json"):
        sched.submit("r", [1, 2, 3], SamplingParams(regex="[0-9]+"))
    assert not sched.has_work()


def test_a_slow_grammar_build_holds_no_one_else(model, tiny_model_dir, monkeypatch):
    """Matchers are built on the grammar thread: on the scheduler's own, a 190 KB schema held
    every decoding row 0.67 s. While one build is stuck, the other requests finish; then it runs."""
    import threading

    from scheduler_proc.grammar import Grammars

    release = threading.Event()
    real = Grammars.matcher

    def slow(self, params):
        assert release.wait(30), "never released"
        return real(self, params)

    monkeypatch.setattr(Grammars, "matcher", slow)
    sched = _sched(model, tiny_model_dir)
    sched.submit("slow", _prompt(40), SamplingParams(regex="[0-9]{4}", max_tokens=8))
    sched.submit("free", _prompt(41), SamplingParams(max_tokens=6, temperature=0.0))
    done: dict[str, str] = {}
    for _ in range(200):
        done |= {c.rid: c.finish_reason for c in sched.step() if c.finish_reason}
        if "free" in done:
            break
    assert done == {"free": "length"}, done
    release.set()
    outs = drive(sched, {})
    assert outs["slow"][-1].finish_reason == "stop" and len(tokens(outs["slow"])) <= 8


def test_a_grammar_that_gives_out_ends_its_request_alone(model, tiny_model_dir):
    """`start: "a" start` compiles but has no end: llguidance runs out of items mid-output. The
    request ends with an error naming its field (a 400 over HTTP, not a 500); others go on."""
    sched = _sched(model, tiny_model_dir)
    bad = SamplingParams(grammar='start: "a" start', max_tokens=40)
    outs = drive(
        sched,
        {0: [("bad", _prompt(50), bad), ("free", _prompt(51), SamplingParams(max_tokens=8))]},
    )
    last = outs["bad"][-1]
    assert last.finish_reason == "error" and last.invalid == "grammar", last
    assert "gave out" in last.error and "<state>" not in last.error
    assert outs["free"][-1].finish_reason == "length"


def test_unconstrained_requests_never_import_llguidance(monkeypatch):
    """Every long prompt passes the front door's check: a missing or broken llguidance may fail
    only requests that asked for a constraint (on an H200 without it, every pooled request
    failed "tokenization failed" before the import moved behind the constraint)."""
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)  # NOTE: import fails
    free = SamplingParams(max_tokens=4)
    constraints.check(free)
    assert constraints.grammar_of(free) is None
    with pytest.raises(ImportError):
        constraints.check(SamplingParams(max_tokens=4, regex="[ab]+"))
