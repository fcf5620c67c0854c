"""`n` choices, `best_of` candidates and `echo` with prompt logprobs over HTTP, with the official
`openai` client: each choice its own request (seeded ones reproducible), best_of's ranking by mean
logprob, streamed choices interleaved by index, and the prompt's logprobs as one forward over it
computes them (lm-evaluation-harness's `local-completions` payload)."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from engine_harness import LaunchedEngine, bounded  # noqa: F401
from scheduler_util import tiny_model

pytestmark = pytest.mark.usefixtures("bounded")
HI = [{"role": "user", "content": "Tell me about the sea and the wind"}]
SAMPLED = {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("choices") / "launch.log"
    launched = LaunchedEngine(tiny_model_dir, log, "--max-running-requests", "8").wait_ready()
    yield launched
    launched.stop()


@pytest.fixture
def oai(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.http + "/v1", api_key="unused", max_retries=0)


def test_n_choices_are_requests_of_their_own_seeded_and_reproducible(oai):
    r = oai.chat.completions.create(model="m", messages=HI, n=3, max_tokens=6, **SAMPLED)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    again = oai.chat.completions.create(model="m", messages=HI, n=3, max_tokens=6, **SAMPLED)
    assert [c.message.content for c in again.choices] == texts
    one = oai.chat.completions.create(model="m", messages=HI, max_tokens=6, **SAMPLED)
    assert one.choices[0].message.content == texts[0]  # NOTE: choice i has the seed + i
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 6 == r.usage.total_tokens - r.usage.prompt_tokens


def test_choices_share_the_prompts_kv(oai):
    prompt = " ".join(f"word{i}" for i in range(60))
    r = oai.completions.create(
        model="m",
        prompt=prompt,
        n=4,
        max_tokens=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert len({c.text for c in r.choices}) == 1  # NOTE: greedy: the same text four times
    assert r.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 32


def test_best_of_keeps_the_candidates_most_likely_per_token(oai):
    args = dict(model="m", prompt="Once upon a time", max_tokens=5, **SAMPLED)
    every = oai.completions.create(n=5, logprobs=1, **args)
    means = [sum(c.logprobs.token_logprobs) / 5 for c in every.choices]
    top = sorted(range(5), key=lambda i: -means[i])[:2]
    best = oai.completions.create(n=2, best_of=5, **args)
    assert [c.text for c in best.choices] == [every.choices[i].text for i in top]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 25  # NOTE: every candidate's tokens, as OpenAI bills
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(n=2, best_of=3, stream=True, **args)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(n=3, best_of=2, **args)
    assert e.value.body["param"] == "best_of"


def test_streamed_choices_interleave_by_index_with_one_usage(oai):
    args = dict(model="m", messages=HI, n=3, max_tokens=6, **SAMPLED)
    whole = oai.chat.completions.create(**args)
    texts: dict[int, str] = {}
    usage = []
    for chunk in oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args
    ):
        usage += [chunk.usage] if chunk.usage else []
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len(usage) == 1 and usage[0].completion_tokens == 18


def _reference(tiny_model_dir: Path, ids: list[int]) -> list[list[float]]:
    logits = tiny_model(tiny_model_dir)(mx.array(ids)[None])[0].astype(mx.float32)
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(oai, tiny_model_dir):
    """lm-evaluation-harness's loglikelihood payload: token ids (a batch of one), echo, logprobs
    1, one token out, greedy; the prompt's logprobs as one forward computes them, the first
    null, and a greedy token's logprob the largest of its top."""
    rng = random.Random(3)
    ids = [rng.randrange(49152) for _ in range(40)]
    r = oai.completions.create(
        model="m", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0.0, seed=1
    )
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
    ref = _reference(tiny_model_dir, ids)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(ref[j - 1][ids[j]], abs=1e-3), j
        greedy = max(range(49152), key=lambda t: ref[j - 1][t]) == ids[j]
        assert (lp.token_logprobs[j] == max(lp.top_logprobs[j].values())) == greedy, j
    text = oai.completions.create(model="m", prompt="Hello sea", echo=True, max_tokens=3)
    assert text.choices[0].text.startswith("Hello sea")
    stream = oai.completions.create(
        model="m", prompt="Hello sea", echo=True, max_tokens=3, stream=True
    )
    assert next(iter(stream)).choices[0].text == "Hello sea"
