"""A burst of requests sharing an uncached prefix: one prefill of the prefix, then the suffixes
in as few steps as the step budget allows (issue: 128 agents on a fresh engine seated one request
a step, and the backlog never drained)."""

from __future__ import annotations

import math
import random

import pytest
from scheduler_util import bucketed, greedy, make_scheduler, random_prompt, tiny_model

# NOTE: the H200's launch sizes: 2048-token chunks, 8192 tokens a step, lone chunks of 512 and
# the score bound beside decode (a GPU's `--long-prefill-scores`).
GPU = dict(
    chunked_prefill_size=2048,
    max_prefill_tokens=8192,
    long_prefill_chunk=512,
    long_prefill_scores=1 << 21,
)


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _burst(sched, suffixes: list[int], prefix: int = 2000) -> tuple[int, int]:
    """16 chats decoding, then a burst sharing an uncached `prefix`; returns (prefill steps from
    the burst to the last burst request's last prompt token, its suffix tokens)."""
    rng = random.Random(7)
    for i in range(16):
        sched.submit(f"chat{i}", random_prompt(rng, 30), greedy(400))
    while sched.running.n_decode < 16:
        sched.step()
    shared = random_prompt(rng, prefix)
    burst = {f"b{i}": shared + random_prompt(rng, n) for i, n in enumerate(suffixes)}
    for rid, prompt in burst.items():
        sched.submit(rid, prompt, greedy(2))
    before = sched.stats()["steps_prefill"]
    waiting = set(burst)
    while waiting:
        outs = sched.step()
        waiting -= {o.rid for o in outs if o.token_ids}
    return sched.stats()["steps_prefill"] - before, sum(suffixes)


# NOTE: prefill steps over `prefix chunks + suffix tokens / budget + 2`, the bound a step packed
# on one axis would meet. A step pads its rows to one width (the CPU: 1.06x here), and a GPU's
# lone chunks pad each request's last chunk to 512 and, beside decode, read at most
# `LONE_KEYS_BESIDE_DECODE` keys a step (12 rows here): 25 steps for a bound of 8. One lone chunk
# a step, the rule before, took 453.
SLACK = {"cpu": 1.1, "gpu": 3.2}


@pytest.mark.parametrize("shapes", ["cpu", "gpu"])
def test_a_burst_sharing_an_uncached_prefix_is_seated_in_few_steps(llama, shapes):
    """128 requests of one 2,000-token prefix and 20-600 tokens of their own, beside 16 decoding
    chats: the prefix computed once, then many suffixes a step."""
    rng = random.Random(3)
    suffixes = [rng.randint(20, 600) for _ in range(128)]
    sizes = dict(max_running_requests=160, max_total_tokens=600_000, context_length=4096)
    if shapes == "gpu":
        sched = bucketed(make_scheduler(llama, **sizes, **GPU), warm=False)
    else:
        sched = make_scheduler(llama, **sizes)
    steps, tokens = _burst(sched, suffixes)
    chunk, budget = sched.chunk_size, sched.prefill_budget
    bound = math.ceil(2000 / chunk) + math.ceil(tokens / budget) + 2
    assert steps <= SLACK[shapes] * bound, (steps, bound)
    assert sched.stats()["prefill_tokens"] < 2 * 2000 + tokens + 128 * 512  # NOTE: prefix once
