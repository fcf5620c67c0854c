"""Prompt-lookup speculation (`--spec ngram`, scheduler_proc/speculate.py): proposals, greedy
and seeded sampled output identical with and without it (beside rows that do not speculate,
across preemption and prefix hits, both loops), and rollback leaving the KV as if the rejected
tokens were never written."""

from __future__ import annotations

import json
import random
import re

import mlx.core as mx
import numpy as np
import pytest
from scheduler_util import (
    assert_pages_balanced,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.sampling_params import SamplingParams
from scheduler_proc import spec_pace, speculate
from scheduler_proc.kv_cache import token_slots
from scheduler_proc.ngram import NgramIndex
from scheduler_proc.scheduler import Scheduler


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def test_a_proposal_is_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(3)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], [])
    # NOTE: the 3-gram (1, 2, 3) occurred once before, at 0: what followed it
    assert index.propose(3) == [4, 5, 9]
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], [8, 2, 3])
    # NOTE: (8, 2, 3) never occurred: the 2-gram (2, 3), latest at 10, followed by 8, 2, 3
    # and then, past the end, by what a repetition of those three would bring
    assert index.propose(4) == [8, 2, 3, 8]
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3], [8, 2, 3, 6])
    assert index.propose(4) == []  # NOTE: (3, 6) never occurred, and one token is too few
    assert index.propose(0) == []


def test_a_loop_proposes_k_tokens_of_its_repetition():
    """A model caught in a loop of p tokens (a random model soon is; a real one writing a table
    or a list nearly is) gets k tokens proposed, not the p up to the end: on a GPU a proposal of
    one token a step cost more than it gained (the step loses the overlap loop's chain)."""
    index = NgramIndex(3)
    index.extend([5, 6], [7, 7, 7, 7])
    assert index.propose(8) == [7] * 8
    index.extend([5, 6], [7, 7, 7, 7, 1, 2, 1, 2])
    assert index.propose(5) == [1, 2, 1, 2, 1]


@pytest.fixture
def oracle(llama, monkeypatch):
    """Proposals from mlx-lm's own greedy continuation (a random model copies nothing from its
    prompt), one token in each proposal wrong at a position that cycles: steps accept all, some
    or none of a proposal, by design. Returns the dict to register prompts in (prompt -> tokens);
    an unregistered request proposes nothing."""
    refs: dict[tuple[int, ...], list[int]] = {}

    def propose(self: NgramIndex, k: int) -> list[int]:
        for prompt, ref in refs.items():
            if tuple(self.tokens[: len(prompt)]) == prompt:
                done = len(self.tokens) - len(prompt)
                out = list(ref[done : done + k])
                wrong = done % (k + 2)
                if wrong < len(out):
                    out[wrong] = (out[wrong] + 1) % 1000
                return out
        return []

    monkeypatch.setattr(NgramIndex, "propose", propose)
    return refs


def _spec(model, **overrides) -> Scheduler:
    return make_scheduler(model, spec="ngram", spec_k=4, **overrides)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_rows_are_identical_beside_rows_that_do_not_speculate(llama, oracle, overlap):
    """Greedy rows speculate beside sampled, penalised and logprob rows that propose nothing,
    in the same steps. Every greedy stream is mlx-lm's, every other stream as without
    speculation."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, 20 + 9 * i) for i in range(4)]
    for p in prompts:
        oracle[tuple(p)] = reference_greedy(llama, p, 40)
    others = {
        "sampled": SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True),
        "penalised": SamplingParams(
            max_tokens=24, temperature=0.0, repetition_penalty=1.3, ignore_eos=True
        ),
        "logprobs": SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
    }
    other_prompt = random_prompt(rng, 25)
    arrivals = {0: [(f"g{i}", p, greedy(40)) for i, p in enumerate(prompts)]}
    arrivals[1] = [(rid, other_prompt, p) for rid, p in others.items()]
    outs = {}
    for spec in ("off", "ngram"):
        sched = make_scheduler(llama, spec=spec, spec_k=4, page_size=4, disable_overlap=not overlap)
        outs[spec] = drive(sched, arrivals)
        assert_pages_balanced(sched)
    stats = sched.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    for i, prompt in enumerate(prompts):
        assert tokens(outs["ngram"][f"g{i}"]) == oracle[tuple(prompt)], i
    for rid in others:
        assert tokens(outs["ngram"][rid]) == tokens(outs["off"][rid]), rid
    lps = [lp for o in outs["ngram"]["logprobs"] for lp in o.logprobs]
    assert len(lps) == 24 and all(len(lp.top) == 2 for lp in lps)


@pytest.fixture
def _count_accepted(monkeypatch):
    """Proposal tokens accepted per request id (`Speculator.verified`); `.steps[rid]`: each
    verifying step's (proposed, accepted)."""

    class Accepted(dict):
        steps: dict[str, list[tuple[int, int]]]

    def start(rids) -> Accepted:
        accepted = Accepted.fromkeys(rids, 0)
        accepted.steps = {}
        verified = speculate.Speculator.verified

        def counted(self, req, proposal, n, share=1.0):
            accepted[req.rid] = accepted.get(req.rid, 0) + n
            if proposal:
                accepted.steps.setdefault(req.rid, []).append((len(proposal), n))
            verified(self, req, proposal, n, share)

        monkeypatch.setattr(speculate.Speculator, "verified", counted)
        return accepted

    return start


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 32, "ignore_eos": True, **kw})


SAMPLED = {
    "t0.9": _params(temperature=0.9, seed=5),
    "top-p": _params(temperature=0.7, top_p=0.9, seed=6),
    "top-k": _params(temperature=1.2, top_k=20, seed=7),
    "min-p": _params(temperature=0.8, min_p=0.05, seed=8),
    "repetition": _params(temperature=0.0, repetition_penalty=1.3),
    "presence": _params(temperature=0.8, presence_penalty=0.8, frequency_penalty=0.5, seed=9),
    "logprobs": _params(temperature=0.0, logprobs=2),
    "sampled-logprobs": _params(temperature=0.9, logprobs=3, frequency_penalty=0.4, seed=10),
    # NOTE: in a thought from the start; its 7th token is followed by the end marker, forced
    "think-budget": _params(
        temperature=0.8,
        seed=11,
        think_budget=7,
        think_start_id=1,
        think_end_id=2,
        think_inside=True,
    ),
}


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_every_unconstrained_row_speculates_and_streams_what_it_would_without(
    llama, oracle, overlap, _count_accepted
):
    """Sampled (temperature, top-p, top-k, min-p; seeded), penalised, logprob and thinking-budget
    rows speculate: proposals from each row's stream without speculation, one token wrong at a
    cycling position, so steps accept all, some or none. Each stream is token for token the one
    without speculation (every position drawn as plain decoding would draw it, penalties
    counting the proposal before it, the budget's end marker forced where it was), with the same
    logprobs."""
    accepted = _count_accepted(SAMPLED)
    rng = random.Random(3)
    prompts = [random_prompt(rng, 18 + 5 * i) for i in range(len(SAMPLED))]
    arrivals = {0: [(rid, p, ps) for p, (rid, ps) in zip(prompts, SAMPLED.items(), strict=True)]}
    plain = drive(make_scheduler(llama, page_size=4), arrivals)
    for rid, prompt, _ in arrivals[0]:
        oracle[tuple(prompt)] = tokens(plain[rid])
    sched = _spec(llama, page_size=4, spec_max_rows=16, disable_overlap=not overlap)
    outs = drive(sched, arrivals)
    for rid in SAMPLED:
        assert tokens(outs[rid]) == tokens(plain[rid]), rid
        assert accepted[rid] > 0, rid
    assert tokens(plain["think-budget"])[7] == 2  # NOTE: the budget did force the marker
    for rid in ("logprobs", "sampled-logprobs"):
        got = [lp for o in outs[rid] for lp in o.logprobs]
        want = [lp for o in plain[rid] for lp in o.logprobs]
        assert len(got) == len(want) == 32
        for a, b in zip(got, want, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-3)
    stats = sched.stats()
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"], stats
    assert_pages_balanced(sched)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}
CONSTRAINED = {
    "schema": _params(json_schema=SCHEMA, temperature=0.0, max_tokens=120, ignore_eos=False),
    "schema-sampled": _params(
        json_schema=SCHEMA, temperature=0.8, seed=3, max_tokens=120, ignore_eos=False
    ),
    "regex": _params(regex="([a-z][0-9]){10}", temperature=0.9, seed=4, ignore_eos=False),
}


def test_constrained_rows_speculate_under_each_positions_mask(
    llama, tiny_model_dir, oracle, _count_accepted
):
    """A constrained row proposes only what its grammar takes, and each proposal position is
    drawn under the mask after the proposal before it: its stream is the one without
    speculation (valid, ended by "stop"), with proposals accepted. A free greedy row beside."""
    from engine.tokenizer_loader import load_tokenizer

    model = tiny_model(tiny_model_dir)  # NOTE: the tokenizer's model, for its grammar
    accepted = _count_accepted(CONSTRAINED)
    rng = random.Random(5)
    arrivals = {
        0: [(rid, random_prompt(rng, 20 + i), p) for i, (rid, p) in enumerate(CONSTRAINED.items())]
    }
    free = random_prompt(rng, 30)
    arrivals[0].append(("free", free, greedy(24)))
    oracle[tuple(free)] = reference_greedy(model, free, 24)
    tokenizer = tiny_model_dir / "tokenizer.json"
    plain = drive(make_scheduler(model, (0, 2), tokenizer, page_size=4), arrivals)
    for rid, prompt, _ in arrivals[0][:-1]:
        oracle[tuple(prompt)] = tokens(plain[rid])
    sched = _spec(model, eos=(0, 2), tokenizer_file=tokenizer, page_size=4)
    outs = drive(sched, arrivals)
    tok = load_tokenizer(tiny_model_dir)
    for rid in CONSTRAINED:
        assert tokens(outs[rid]) == tokens(plain[rid]), rid
        assert outs[rid][-1].finish_reason == "stop", rid
        assert accepted[rid] > 0, rid
    assert re.fullmatch("([a-z][0-9]){10}", tok.decode(tokens(outs["regex"])))
    assert json.loads(tok.decode(tokens(outs["schema"])))
    assert tokens(outs["free"]) == oracle[tuple(free)]
    assert_pages_balanced(sched)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_speculating_streams_survive_preemption(llama, oracle, overlap):
    """Too few pages for every stream: speculating rows are preempted and recomputed, and their
    proposals never take a page another row needs; each stream is still mlx-lm's."""
    rng = random.Random(7)
    reqs = [(f"r{i}", random_prompt(rng, 20 + 3 * i), 40) for i in range(6)]
    for _, p, n in reqs:
        oracle[tuple(p)] = reference_greedy(llama, p, n)
    sched = _spec(
        llama,
        page_size=4,
        max_total_tokens=160,
        context_length=160,
        max_running_requests=6,
        disable_overlap=not overlap,
    )
    outs = drive(sched, {0: [(rid, p, greedy(n)) for rid, p, n in reqs]})
    for rid, prompt, _ in reqs:
        assert tokens(outs[rid]) == oracle[tuple(prompt)], rid
    stats = sched.stats()
    assert stats["requests_preempted"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert_pages_balanced(sched)


def test_a_batch_past_spec_max_rows_keeps_its_chain_and_does_not_speculate(
    llama, oracle, monkeypatch
):
    """More decoding rows than `--spec-max-rows`: no row speculates and the overlap loop chains
    as without speculation (at 128 agents on a GPU every row speculating cost 4x the step
    time); once the batch is small again, the rows speculate; every stream is mlx-lm's."""
    rng = random.Random(5)
    short = [random_prompt(rng, 20 + i) for i in range(4)]
    long = random_prompt(rng, 24)
    for p in short:
        oracle[tuple(p)] = reference_greedy(llama, p, 8)
    oracle[tuple(long)] = reference_greedy(llama, long, 40)
    sched = _spec(llama, page_size=4, spec_max_rows=2)
    planned: list[int] = []  # NOTE: the decode rows of each step that speculated
    plan = speculate.Speculator.plan

    def recorded(self, rows, kv):
        out = plan(self, rows, kv)
        planned.extend([len(rows)] if out is not None else [])
        return out

    monkeypatch.setattr(speculate.Speculator, "plan", recorded)
    arrivals = [(f"s{i}", p, greedy(8)) for i, p in enumerate(short)] + [("l", long, greedy(40))]
    outs = drive(sched, {0: arrivals})
    for rid, prompt, params in arrivals:
        assert tokens(outs[rid]) == oracle[tuple(prompt)][: params.max_tokens], rid
    stats = sched.stats()
    assert stats["steps_chained"] > 0 and stats["spec_accepted_tokens"] > 0, stats
    assert planned and max(planned) <= 2, planned
    assert_pages_balanced(sched)


def test_speculating_streams_after_prefix_hits(llama, oracle):
    """A turn that hits the cached prefix of the one before (its prompt and output) speculates;
    its stream is mlx-lm's."""
    rng = random.Random(3)
    first = random_prompt(rng, 50)
    oracle[tuple(first)] = reference_greedy(llama, first, 30)
    sched = _spec(llama, page_size=4)
    out1 = tokens(drive(sched, {0: [("t1", first, greedy(30))]})["t1"])
    second = first + out1 + random_prompt(rng, 3)
    oracle.clear()
    oracle[tuple(second)] = reference_greedy(llama, second, 30)
    out2 = drive(sched, {0: [("t2", second, greedy(30))]})["t2"]
    assert out2[-1].cached_tokens > 0
    assert tokens(out2) == oracle[tuple(second)]
    assert sched.stats()["spec_accepted_tokens"] > 0
    assert_pages_balanced(sched)


def _kv(sched: Scheduler, rid: str) -> tuple[int, list[np.ndarray]]:
    """A running request's kv_len and every layer's keys and values at positions [0, kv_len)."""
    req = sched._reqs[rid]
    slots = mx.array(token_slots(req.pages, 0, req.kv_len, sched.pool.page_size))
    bufs = sched.pool.keys + sched.pool.values
    return req.kv_len, [np.array(b[:, slots].astype(mx.float32)) for b in bufs]


def test_rollback_leaves_the_kv_as_if_rejected_tokens_were_never_written(llama, oracle):
    """After steps that rejected proposals, the request's KV (length, pages, contents) is the
    one a run without speculation holds at the same output length, and the pages its proposals
    took are free again."""
    prompt = random_prompt(random.Random(11), 45)
    params = greedy(200)
    oracle[tuple(prompt)] = reference_greedy(llama, prompt, 200)
    spec = _spec(llama, page_size=4, disable_overlap=True)
    spec.submit("r", prompt, params)
    req = spec._reqs["r"]
    while not (req.spec and any(a < p for p, a in req.spec.history) and len(req.output_ids) > 20):
        spec.step()
        assert len(req.output_ids) < 150, "no proposal was rejected"
        # NOTE: the pages a step took for its proposal past what it kept are back already
        if req.output_ids:
            assert len(req.pages) == spec.pool.pages_for(req.kv_len), "pages kept past kv_len"
    plain = make_scheduler(llama, page_size=4, disable_overlap=True)
    plain.submit("r", prompt, params)
    while len(plain._reqs["r"].output_ids) < len(req.output_ids):
        plain.step()
    assert plain._reqs["r"].output_ids == req.output_ids
    (n_spec, kv_spec), (n_plain, kv_plain) = _kv(spec, "r"), _kv(plain, "r")
    assert n_spec == n_plain == len(prompt) + len(req.output_ids) - 1
    assert len(req.pages) == len(plain._reqs["r"].pages)
    assert spec.kv.pages.available == plain.kv.pages.available
    for a, b in zip(kv_spec, kv_plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_row_that_accepts_nothing_stops_speculating(llama, monkeypatch):
    """Proposals that are always wrong: the row stops speculating after `MISSES_OFF` steps
    (its chain no longer broken), tries again later, and its stream is mlx-lm's throughout."""
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k: [0, 1, 2][: max(k, 0)])
    prompt = random_prompt(random.Random(2), 30)
    sched = _spec(llama, page_size=4)
    outs = drive(sched, {0: [("r", prompt, greedy(60))]})
    assert tokens(outs["r"]) == reference_greedy(llama, prompt, 60)
    stats = sched.stats()
    assert stats["spec_accepted_tokens"] == 0
    rows = stats["spec_rows_verified"]
    assert speculate.MISSES_OFF <= rows < 20, rows
    assert stats["steps_chained"] > 0


def test_a_row_that_gains_less_than_its_step_costs_stops_speculating(llama, monkeypatch):
    """Each proposal right in its first token only: a step emits two tokens. Where a speculating
    step costs three plain ones (a GPU, whose chain it breaks) the row stops speculating after
    `MISSES_OFF` steps; where it costs one it goes on. Both paces are measured as it runs (plain
    steps are taken to measure theirs), and the stream is mlx-lm's either way."""
    prompt = random_prompt(random.Random(4), 30)
    ref = reference_greedy(llama, prompt, 100)

    def propose(self: NgramIndex, k: int) -> list[int]:
        done = len(self.tokens) - len(prompt)
        return ref[done : done + 1] + [(ref[done + 1] + 1) % 1000] if done + 1 < len(ref) else []

    monkeypatch.setattr(NgramIndex, "propose", propose)
    verified = {}
    for cost in (1.0, 3.0):
        monkeypatch.setattr(spec_pace.Pace, "break_even", lambda self, c=cost: c)
        sched = _spec(llama, page_size=4)
        outs = drive(sched, {0: [("r", prompt, greedy(100))]})
        assert tokens(outs["r"]) == ref, cost
        stats = sched.stats()
        verified[cost] = stats["spec_rows_verified"]
        assert stats["spec_step_ms"] > 0 and stats["spec_plain_step_ms"] > 0, stats
    assert verified[3.0] < 15 < 30 < verified[1.0], verified


def test_the_paces_of_speculating_and_plain_steps_set_the_break_even():
    """A speculating step of 30 ms against chained plain ones of 10 ms: a row must emit more
    than 3 tokens a step. Plain steps are taken when none were measured for a while; a fresh
    plain step (the first after a speculating one) is not a chained one's pace."""
    pace = spec_pace.Pace()
    assert pace.break_even() == 1.0
    for _ in range(spec_pace.PROBE_FIRST - 1):
        pace.stepped(0.03, speculated=True, chained=False)
    assert not pace.probing
    pace.stepped(0.03, speculated=True, chained=False)
    assert pace.probing
    pace.stepped(0.02, speculated=False, chained=False)
    assert pace.plain_s is None and pace.break_even() == 1.0
    for _ in range(spec_pace.PROBE_STEPS - 1):
        pace.stepped(0.01, speculated=False, chained=True)
    assert not pace.probing
    assert pace.break_even() == pytest.approx(3.0)
    for _ in range(spec_pace.PROBE_EVERY - 1):
        pace.stepped(None, speculated=True, chained=False)
    assert not pace.probing
    pace.stepped(None, speculated=True, chained=False)
    assert pace.probing


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A draft of another shape (1 layer, 4 KV heads of 8) and other random weights."""
    from engine.random_model import TINY_LLAMA, make_random_model

    shape = {**TINY_LLAMA, "num_hidden_layers": 1, "num_key_value_heads": 4, "head_dim": 8}
    return tiny_model(make_random_model(tmp_path_factory.mktemp("draft"), shape, seed=3))


def _drafting(model, draft, **overrides) -> Scheduler:
    spec = dict(spec="draft", draft_model="(in memory)", spec_k=4, page_size=4)
    return make_scheduler(model, draft=draft, **spec, **overrides)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("pool", ["roomy", "tight"])
def test_a_draft_that_is_the_model_has_every_proposal_accepted(
    llama, overlap, pool, _count_accepted
):
    """The mechanism's ceiling: a draft with the model's own weights proposes exactly the
    model's greedy tokens, so a greedy row accepts every proposal whole (k + 1 tokens a step)
    and streams mlx-lm's tokens, so long as the draft's KV is right: caught up lazily, in the
    row's own pages, computed again after a preemption (a tight pool), over a prefix hit (a
    later request sharing a prompt) and beside a long row (one-token forwards in length
    groups). A sampled row beside them streams what it would without speculation."""
    accepted = _count_accepted([])
    rng = random.Random(4)
    prompts = [random_prompt(rng, 20 + 7 * i) for i in range(4)]
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=2, ignore_eos=True)
    arrivals = {0: [(f"g{i}", p, greedy(30)) for i, p in enumerate(prompts)]}
    arrivals[2] = [("sampled", random_prompt(rng, 25), sampled)]
    arrivals[12] = [("hit", prompts[0] + random_prompt(rng, 5), greedy(30))]
    tight = dict(max_total_tokens=192, context_length=192, max_running_requests=6)
    extra = tight if pool == "tight" else {}
    if pool == "roomy":  # NOTE: a long row: the short ones' draft forwards attend apart from it
        arrivals[0].append(("long", random_prompt(rng, 400), greedy(30)))
    plain = drive(make_scheduler(llama, page_size=4, **extra), arrivals)
    sched = _drafting(llama, llama, disable_overlap=not overlap, **extra)
    outs = drive(sched, arrivals)
    for rid, prompt, _ in arrivals[0] + arrivals[12]:
        assert tokens(outs[rid]) == reference_greedy(llama, prompt, 30), rid
        steps = accepted.steps[rid]
        assert all(n == k for k, n in steps), (rid, steps)
        assert sum(n for _, n in steps) >= 20, (rid, steps)
    assert tokens(outs["sampled"]) == tokens(plain["sampled"])
    stats = sched.stats()
    assert (stats["requests_preempted"] > 0) == (pool == "tight"), stats
    assert stats["spec_draft_caught_up_tokens"] > 0
    assert_pages_balanced(sched)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_smaller_draft_keeps_every_stream_and_survives_preemption(llama, small_draft, overlap):
    """A draft of another shape and weights proposes mostly wrong tokens: every greedy stream
    is still mlx-lm's, across preemption (a preempted row's draft KV is computed again in its
    new pages) and prefix hits (a later request sharing a prompt)."""
    rng = random.Random(8)
    reqs = [(f"r{i}", random_prompt(rng, 20 + 3 * i), 40) for i in range(6)]
    shared = reqs[0][1] + random_prompt(rng, 6)
    sched = _drafting(
        llama,
        small_draft,
        max_total_tokens=160,
        context_length=160,
        max_running_requests=6,
        disable_overlap=not overlap,
    )
    arrivals = {0: [(rid, p, greedy(n)) for rid, p, n in reqs], 60: [("hit", shared, greedy(20))]}
    outs = drive(sched, arrivals)
    for rid, prompt, n in reqs:
        assert tokens(outs[rid]) == reference_greedy(llama, prompt, n), rid
    assert tokens(outs["hit"]) == reference_greedy(llama, shared, 20)
    stats = sched.stats()
    assert stats["requests_preempted"] > 0 and stats["spec_proposed_tokens"] > 0, stats
    assert_pages_balanced(sched)


EDIT_TEXT = (
    "The keeper climbed the one hundred and twelve steps to the lamp room every evening, "
    "trimmed the wick, polished the great lens with a soft cloth and wrote the state of the "
    "sea in a leather book. In the spring the fishing boats came back from the south."
)


def test_the_default_model_repeating_a_text_accepts_most_proposals(default_model_dir):
    """The issue's workload in small: asked to repeat a text with one change, the default model
    re-emits it; prompt lookup proposes from it, most proposals are accepted, and the output of
    a greedy and a sampled row speculating side by side is the one without speculation, token
    for token."""
    from engine.models import load

    model, tokenizer = load(str(default_model_dir))
    ask = "Repeat this text exactly, but write 'winter' instead of 'spring':\n\n" + EDIT_TEXT
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": ask}], add_generation_prompt=True
    )
    sampled = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.95, seed=2, ignore_eos=True)
    asks = [("greedy", prompt, greedy(40)), ("sampled", prompt, sampled)]
    outs, stats = {}, {}
    for spec in ("off", "ngram"):
        sched = make_scheduler(model, spec=spec)
        got = drive(sched, {0: asks})
        outs[spec] = {rid: tokens(got[rid]) for rid, _, _ in asks}
        stats[spec] = sched.stats()
    assert outs["ngram"] == outs["off"]
    s = stats["ngram"]
    assert s["spec_accepted_tokens"] > 40 and s["steps_decode"] < stats["off"]["steps_decode"] / 2


def test_a_launched_engine_counts_proposals_on_metrics(tiny_think_model_dir, tmp_path):
    """Prompt lookup (`--spec auto`) and `--spec draft` (the model as its own draft) through
    `mlx-engine launch`: a greedy request whose prompt holds what the model goes on to write
    gets proposals, accepted and counted on /metrics; its tokens equal those of the engine
    without speculation (the default). (The scripted model writes its answer token by token,
    so a prompt of the answer's start, twice, is continued by the rest: found in the prompt.)
    Each counts under its own proposer."""
    import urllib.request

    from engine_harness import LaunchedEngine
    from think_model import ANSWER

    from engine.client import EngineClient
    from engine.tokenizer_loader import load_tokenizer

    script = load_tokenizer(tiny_think_model_dir).encode(ANSWER, add_special_tokens=False)
    prompt = script[:6] + script[:2]
    kw = {"input_ids": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    outs, counts = [], []
    draft = ("--spec", "draft", "--draft-model", str(tiny_think_model_dir))
    for i, args in enumerate(((), ("--spec", "auto"), draft)):
        engine = LaunchedEngine(tiny_think_model_dir, tmp_path / f"{i}.log", *args)
        try:
            engine.wait_ready()
            with EngineClient(engine.address, timeout=60) as client:
                outs.append(client.generate(**kw).token_ids)
            with urllib.request.urlopen(engine.http + "/metrics", timeout=30) as r:
                lines = r.read().decode().splitlines()
        finally:
            engine.stop()
        spec = [ln.split() for ln in lines if ln.startswith("mlx_engine_spec")]
        counts.append({name: float(value) for name, value in spec})
    assert outs[0] == outs[1] == outs[2] == script[2:6]
    for n, (proposer, other) in zip(
        counts[1:], [("ngram", "draft"), ("draft", "ngram")], strict=True
    ):
        for what in ("proposed", "accepted"):
            name = f"mlx_engine_spec_{what}_tokens_total"
            assert n[f'{name}{{proposer="{proposer}"}}'] > 0, n
            assert n[f'{name}{{proposer="{other}"}}'] == 0, n


def test_a_draft_with_another_tokenizer_is_refused_at_start(
    tiny_think_model_dir, tiny_tool_model_dir, tmp_path
):
    """A draft whose tokens mean other text (another tokenizer) would only ever be rejected:
    the engine does not start, and says why; nor with a draft that is not there."""
    from engine_harness import LaunchedEngine

    args = ("--spec", "draft", "--draft-model", str(tiny_tool_model_dir))
    engine = LaunchedEngine(tiny_think_model_dir, tmp_path / "launch.log", *args)
    with pytest.raises(RuntimeError, match="another tokenizer than the model"):
        engine.wait_ready()
    args = ("--spec", "draft", "--draft-model", str(tmp_path / "nothing-here"))
    engine = LaunchedEngine(tiny_think_model_dir, tmp_path / "missing.log", *args)
    with pytest.raises(RuntimeError, match="--draft-model: .*nothing-here: no such model"):
        engine.wait_ready()


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculation_is_refused_with_tensor_parallel_and_says_why(spec, tmp_path):
    """Which rows speculate follows each rank's own step times, so ranks would disagree on a
    step's rows: `--tp 2 --spec ngram` stalled a rank in a collective and the engine died. The
    configuration is refused, naming both flags, before any process starts."""
    from engine.config import EngineConfig

    draft = {"draft_model": str(tmp_path)} if spec == "draft" else {}
    with pytest.raises(ValueError, match=f"--spec {spec} runs on one device: not with --tp"):
        EngineConfig(spec=spec, tp=2, **draft).validate()
    EngineConfig(spec=spec, tp=1, **draft).validate()  # NOTE: one device: fine


def test_spec_auto_is_prompt_lookup_where_it_can_run(caplog):
    """`--spec auto` is prompt lookup on one device for a model whose KV can be rolled back;
    with --tp, or a sliding window, it is off without a warning (it asked for speculation only
    where it runs); `--spec off`, the default, is off."""
    import logging

    from engine.config import EngineConfig
    from scheduler_proc.kv_layout import LayerShape, Layout

    full = Layout.attention_only([LayerShape(2, 16, 16, mx.float32)] * 2)
    windowed = Layout.attention_only([LayerShape(2, 16, 16, mx.float32, window=8)] * 2)
    auto = EngineConfig(spec="auto")
    assert speculate.Speculator(auto, full).on
    assert not speculate.Speculator(EngineConfig(), full).on
    two = EngineConfig(spec="auto", tp=2)
    two.validate()
    assert not speculate.Speculator(two, full).on
    with caplog.at_level(logging.INFO, logger=speculate.log.name):
        assert not speculate.Speculator(auto, windowed).on
        assert not speculate.Speculator(EngineConfig(spec="ngram"), windowed).on
    levels = [r.levelname for r in caplog.records if "cannot be rolled back" in r.message]
    assert levels == ["INFO", "WARNING"]


def test_a_row_pays_for_the_rows_its_speculating_step_holds_back(monkeypatch):
    """A speculating step costing 1.5 plain ones: a row accepting one token a step gains alone
    (1 > 0.5 tokens lost), but as the only proposing row of four it must make up the half step
    all four lost (2 tokens), so it stops after `MISSES_OFF` steps; shared by four proposing
    rows, it gains again."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from scheduler_proc.kv_layout import LayerShape, Layout

    monkeypatch.setattr(spec_pace.Pace, "break_even", lambda self: 1.5)
    full = Layout.attention_only([LayerShape(2, 16, 16, mx.float32)] * 2)
    spec = speculate.Speculator(EngineConfig(spec="ngram"), full)
    for share, stops in ((1.0, False), (4.0, True), (1.0, False)):
        req = SimpleNamespace(spec=speculate.RowSpec(None, 8), output_ids=[0] * 10)
        for _ in range(speculate.MISSES_OFF):
            spec.verified(req, [1, 2, 3], 1, share)
        assert (req.spec.resume_at > len(req.output_ids)) == stops, share
