"""Sampling inside the graph: seeds, greedy equivalences, top-p / min-p sets, penalties, logprobs."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from scheduler_util import drive, make_scheduler, reference_greedy, tiny_model, tokens

from engine.sampling_params import SamplingParams
from scheduler_proc.sampling import RowParams, build_state, sample, sample_ahead

VOCAB = 49152


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _run(model, prompts, params_list, **overrides) -> list[list[int]]:
    sched = make_scheduler(model, **overrides)
    reqs = [(f"r{i}", p, params_list[i]) for i, p in enumerate(prompts)]
    outs = drive(sched, {0: reqs})
    return [tokens(outs[f"r{i}"]) for i in range(len(prompts))]


def test_seeded_sampling_is_reproducible(llama):
    prompts = _prompts(6)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=100 + i) for i in range(6)]
    first = _run(llama, prompts, params)
    assert first == _run(llama, prompts, params)
    assert first == _run(llama, prompts, params, disable_overlap=True)
    # NOTE: noise depends on the row's seed only, so a request alone gets the same tokens.
    assert first[2] == _run(llama, prompts[2:3], params[2:3])[0]
    other = [SamplingParams(max_tokens=16, temperature=1.0, seed=7) for _ in range(6)]
    assert _run(llama, prompts, other) != first


def test_top_k_one_and_tiny_temperature_equal_greedy(llama):
    prompts = _prompts(5, seed=1)
    ref = [reference_greedy(llama, p, 10) for p in prompts]
    top1 = SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True)
    cold = SamplingParams(max_tokens=10, temperature=1e-4, seed=3, ignore_eos=True)
    mixed = [top1, cold, SamplingParams(max_tokens=10, temperature=0.0), top1, cold]
    assert _run(llama, prompts, mixed) == ref


def _filtered_set(logits: mx.array, top_p: float, min_p: float) -> set[int]:
    probs = mx.softmax(logits, axis=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.add(i)
        mass += probs[i]
    peak = probs[order[0]]
    return {i for i in keep if probs[i] >= min_p * peak}


@pytest.mark.parametrize("top_p,min_p", [(0.5, 0.0), (1.0, 0.2), (0.8, 0.05)])
def test_top_p_min_p_never_sample_outside_their_set(top_p, min_p):
    vocab = 64
    logits = mx.random.normal((vocab,), key=mx.random.key(5)) * 2.0
    allowed = _filtered_set(logits, top_p, min_p)
    assert 1 < len(allowed) < vocab
    params = SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p)
    rows = [RowParams(params, seed, 0, [], []) for seed in range(256)]
    seen: set[int] = set()
    for position in range(8):
        rows = [RowParams(params, r.seed, position, [], []) for r in rows]
        state = build_state(rows, vocab)
        seen |= set(sample(mx.broadcast_to(logits, (len(rows), vocab)), state).tokens.tolist())
    assert seen <= allowed
    assert len(seen) > 1  # it does sample, not argmax


def test_top_k_samples_only_the_k_largest():
    vocab = 50
    logits = mx.arange(vocab, dtype=mx.float32) * 0.1
    params = SamplingParams(temperature=2.0, top_k=5)
    rows = [RowParams(params, seed, 0, [], []) for seed in range(300)]
    seen = set(
        sample(mx.broadcast_to(logits, (300, vocab)), build_state(rows, vocab)).tokens.tolist()
    )
    assert seen == set(range(vocab - 5, vocab))


AHEAD_LOGITS = [
    [0.0, 0.5, 1.0, -0.3, 0.2, 0.8],
    [1.0, 0.0, 0.3, 0.6, -0.2, 0.4],
    [0.2, 0.9, -0.1, 0.0, 0.7, 0.3],
]


def _chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.1, top_k=3),
        SamplingParams(temperature=0.9, top_p=0.7, min_p=0.1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=0.7, presence_penalty=0.6, frequency_penalty=0.9),
        SamplingParams(temperature=0.0, logprobs=3),
    ],
    ids=["t", "top-k", "top-p-min-p", "greedy", "repetition", "presence-frequency", "logprobs"],
)
def test_tokens_drawn_ahead_are_the_ones_plain_decoding_draws(params):
    """A speculating row's proposal positions (`sample_ahead`): position j is the token (and
    logprobs) that sampling one at a time draws there, at `generated + 1 + j` with the proposal's
    tokens up to j emitted, for every seed, filter and penalty. The proposals are the likeliest
    tokens, so a penalty that missed them would change the draw."""
    vocab, n = 6, 64
    logits = mx.array(AHEAD_LOGITS)
    prompt, out = [5], [1, 2]
    proposals = [[2, 0, 2] if seed % 2 else [5, 1, 0] for seed in range(n)]
    rows = [RowParams(params, seed, len(out), prompt, out) for seed in range(n)]
    ahead = sample_ahead(
        mx.broadcast_to(logits, (n, 3, vocab)), build_state(rows, vocab), proposals
    )
    for j in range(3):
        rows = [
            RowParams(params, s, len(out) + 1 + j, prompt, out + proposals[s][: j + 1])
            for s in range(n)
        ]
        plain = sample(mx.broadcast_to(logits[j], (n, vocab)), build_state(rows, vocab))
        assert ahead.tokens[:, j].tolist() == plain.tokens.tolist(), j
        if params.logprobs:
            assert ahead.logprob is not None and plain.logprob is not None
            assert mx.allclose(ahead.logprob[:, j], plain.logprob).item()
            assert ahead.top_ids[:, j].tolist() == plain.top_ids.tolist()


def test_tokens_drawn_ahead_follow_their_distribution_independently():
    """Over 20,000 seeds on a 6-token vocabulary: each proposal position's draws follow
    softmax(logits / T) (chi-square, 5 degrees of freedom), and two positions' draws are
    independent (their joint against the product, 35): speculative sampling's distribution,
    never one noise shared by two positions. Critical values at p = 0.001."""
    vocab, n, temperature = 6, 20_000, 0.8
    logits = mx.array(AHEAD_LOGITS)
    rows = [
        RowParams(SamplingParams(temperature=temperature), seed, 7, [], []) for seed in range(n)
    ]
    state = build_state(rows, vocab)
    drawn = np.array(sample_ahead(mx.broadcast_to(logits, (n, 3, vocab)), state, [[]] * n).tokens)
    probs = np.array(mx.softmax(logits / temperature, axis=-1))
    for j in range(3):
        assert _chi_square(np.bincount(drawn[:, j], minlength=vocab), n * probs[j]) < 20.52, j
    joint = np.bincount(drawn[:, 1] * vocab + drawn[:, 2], minlength=vocab * vocab)
    assert _chi_square(joint, n * np.outer(probs[1], probs[2]).ravel()) < 66.62


def test_penalties_discourage_repeats():
    vocab = 16
    logits = mx.zeros((1, vocab)) + mx.arange(vocab, dtype=mx.float32)[None] * 0.01
    history = [vocab - 1] * 3
    for params in (
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, repetition_penalty=100.0),
    ):
        state = build_state([RowParams(params, 0, 3, [1], history)], vocab)
        assert sample(logits, state).tokens.item() == vocab - 2, params


def test_logprobs_match_log_softmax(llama):
    prompt = _prompts(1, seed=4)[0]
    sched = make_scheduler(llama)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = drive(sched, {0: [("a", prompt, params), ("b", prompt, plain)]})
    lps = [lp for o in outs["a"] for lp in o.logprobs]
    toks = tokens(outs["a"])
    assert len(lps) == 4 and not any(o.logprobs for o in outs["b"])
    logits = llama(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    ref = (logits - mx.logsumexp(logits)).tolist()
    assert lps[0].logprob == pytest.approx(ref[toks[0]], abs=1e-4)
    assert [t for t, _ in lps[0].top][0] == toks[0] and len(lps[0].top) == 3
    assert lps[0].top[0][1] >= lps[0].top[1][1] >= lps[0].top[2][1]


def test_the_noise_is_finite_for_every_hash():
    """A hash mapped to u = 1.0 gave +inf noise, and a filtered or masked token (-inf) then won
    the draw as NaN (a grammar's forbidden token, about once in 300 row-steps)."""
    from scheduler_proc.sampling import uniform

    h = mx.array([0, 1, 0x7FFFFFFF, 0xFFFFFF00, 0xFFFFFFFF], dtype=mx.uint32)
    u = uniform(h)
    assert mx.all((u > 0) & (u < 1)).item(), u
    assert mx.all(mx.isfinite(-mx.log(-mx.log(u)))).item()


def _reference_prompt_logprobs(model, prompt: list[int]) -> list[list[float]]:
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()


@pytest.mark.parametrize("chunk", [8, 512])
def test_prompt_logprobs_cover_every_prompt_token_as_one_forward(llama, chunk):
    """`prompt_logprobs`: each prompt token's logprob given those before it, on the first chunk,
    as one forward over the whole prompt computes them, across prefill chunks and beside other
    rows; a cached prefix (the same prompt served before) is computed again, not skipped."""
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(45)]
    sched = make_scheduler(llama, chunked_prefill_size=chunk, max_prefill_tokens=chunk)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    drive(sched, {0: [("warm", prompt, greedy)]})  # NOTE: the prompt is cached now
    one = [rng.randrange(VOCAB)]
    outs = drive(
        sched,
        {0: [("a", prompt, scored), ("other", _prompts(1, 9)[0], greedy), ("one", one, scored)]},
    )
    first = outs["a"][0]
    assert all(not o.prompt_logprobs for o in outs["a"][1:] + outs["other"])
    ref = _reference_prompt_logprobs(llama, prompt)
    got = first.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        assert got[j].logprob == pytest.approx(row[prompt[j]], abs=1e-4), j
        best = sorted(range(VOCAB), key=lambda t: -row[t])[:2]
        assert [t for t, _ in got[j].top] == best, j
    assert outs["a"][-1].cached_tokens == 0
    assert outs["one"][0].prompt_logprobs == [None] and first.prompt_ids == prompt
