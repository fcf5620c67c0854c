"""Sampling penalties through the scheduler, against a reference written out token by token:
the repetition penalty over prompt and output tokens, presence once per seen token, frequency per
occurrence, in the overlap loop (chained steps update the counts) and the synchronous one.

The model is a tiny llama with a tied head, which mostly reads back its last token, so greedy
output repeats tokens and penalties change it; each prompt ends with the token greedy would say
next, so a penalty over the prompt changes the first token. The test also checks the reference
tells the slips apart (a penalty that ignores the prompt, presence times the count, counts that
stop after the first step), so a passing run is evidence the scheduler has none of them."""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from scheduler_util import drive, make_scheduler, tiny_model, tokens

from engine.random_model import TINY_LLAMA, make_random_model
from engine.sampling_params import SamplingParams

VOCAB = 49152
STEPS = 10
# (repetition, presence, frequency)
CASES = [(1.8, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 1.2), (1.4, 0.8, 0.6)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("tied-llama")
    return tiny_model(make_random_model(out, {**TINY_LLAMA, "tie_word_embeddings": True}))


def reference(model, prompt, rep, pres, freq, slip: str = "") -> list[int]:
    """Greedy decoding with the penalties applied to one full forward per token."""
    out: list[int] = []
    for step in range(STEPS):
        x = np.array(model(mx.array(prompt + out)[None])[0, -1].astype(mx.float32))
        counted = out[:1] if slip == "counts stop" and step > 1 else out
        seen = set(counted) if slip == "no prompt" else set(prompt) | set(counted)
        for t in seen:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t, c in Counter(counted).items():
            x[t] -= pres * (c if slip == "presence count" else 1) + freq * c
        out.append(int(np.argmax(x)))
    return out


def _prompts(model) -> list[list[int]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 12, 20, 30)]
    return [p + reference(model, p, 1.0, 0.0, 0.0)[:1] for p in prompts]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_penalties_match_the_reference_in_both_loops(llama, overlap):
    prompts = _prompts(llama)
    sched = make_scheduler(llama, disable_overlap=not overlap)
    reqs = []
    for i, (rep, pres, freq) in enumerate(CASES):
        for j, prompt in enumerate(prompts):
            params = SamplingParams(
                max_tokens=STEPS,
                temperature=0.0,
                ignore_eos=True,
                repetition_penalty=rep,
                presence_penalty=pres,
                frequency_penalty=freq,
            )
            reqs.append((f"c{i}p{j}", prompt, params))
    plain = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    reqs.append(("plain", prompts[0], plain))  # NOTE: a row without penalties beside them
    outs = drive(sched, {0: reqs})
    slips = {"no prompt": 0, "presence count": 0, "counts stop": 0}
    for i, (rep, pres, freq) in enumerate(CASES):
        for j, prompt in enumerate(prompts):
            want = reference(llama, prompt, rep, pres, freq)
            assert tokens(outs[f"c{i}p{j}"]) == want, (CASES[i], j)
            for slip in slips:
                slips[slip] += reference(llama, prompt, rep, pres, freq, slip) != want
    assert tokens(outs["plain"]) == reference(llama, prompts[0], 1.0, 0.0, 0.0)
    assert all(slips.values()), f"the cases cannot tell a slip apart: {slips}"
