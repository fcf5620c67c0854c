"""OfflineEngine: the in-process API over the scheduler (tiny model; one slow real-model check)."""

from __future__ import annotations

import random

import pytest
from scheduler_util import reference_greedy, tiny_model

from engine.errors import InvalidRequest
from mlx_engine.offline import OfflineEngine


def _prompts(n: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_generate_with_one_dict_and_per_prompt_dicts(tiny_weights_dir):
    prompts = _prompts(5)
    with OfflineEngine(str(tiny_weights_dir), max_total_tokens=8 * 512, context_length=512) as eng:
        same = eng.generate(prompts, dict(max_tokens=6, temperature=0.0, ignore_eos=True))
        model = tiny_model(tiny_weights_dir)
        assert [r.token_ids for r in same] == [reference_greedy(model, p, 6) for p in prompts]
        assert all(r.finish_reason == "length" and r.usage.completion_tokens == 6 for r in same)
        per = eng.generate(prompts[:2], [dict(max_tokens=2), dict(max_tokens=3, prompt_logprobs=0)])
        assert [len(r.token_ids) for r in per] == [2, 3]
        assert not per[0].prompt_logprobs and len(per[1].prompt_logprobs) == len(prompts[1])
        stats = eng.stats()
        assert stats["generated_tokens"] == 5 * 6 + 5
        assert stats["requests_finished"] == 7 and stats["kv_tokens_in_use"] == 0
        assert stats["steps_launched"] == stats["steps_fresh"] + stats["steps_chained"]
        with pytest.raises(InvalidRequest) as err:
            eng.generate([[1, 2], [3]], [dict(max_tokens=4), dict(top_p=0.0)])
        assert err.value.field == "top_p"
        assert not eng.scheduler.has_work() and eng.stats()["requests_aborted"] == 1
        with pytest.raises(InvalidRequest) as err:  # NOTE: named as the SDK names it
            eng.generate([[1]], dict(max_tokenz=3))
        assert err.value.field == "max_tokenz"


@pytest.mark.parametrize(
    ("params", "field", "option"),
    [
        (dict(stop=["a"] * 5), "stop", "max_stop_strings"),
        (dict(stop_token_ids=[1] * 5), "stop_token_ids", "max_stop_strings"),
        (dict(stop=["a" * 17]), "stop", "max_stop_chars"),
        (dict(stop=[[[[[["a"]]]]]]), "params", "max_nesting_depth"),
    ],
)
def test_the_launched_engines_limits_apply(tiny_weights_dir, params, field, option):
    limited = dict(max_stop_strings=4, max_stop_chars=16, max_nesting_depth=4)
    with OfflineEngine(str(tiny_weights_dir), max_total_tokens=4096, **limited) as eng:
        with pytest.raises(InvalidRequest) as err:
            eng.generate([[1, 2], [3]], [dict(max_tokens=2), dict(max_tokens=2, **params)])
        assert err.value.field == field and option in err.value.message, err.value
        assert not eng.scheduler.has_work()
        assert len(eng.generate([[1, 2]], dict(max_tokens=2))[0].token_ids) == 2


@pytest.mark.slow
def test_default_model_greedy_parity():
    from scheduler_proc.model_loader import load_for_scheduler

    prompts = [list(range(100, 100 + n)) for n in (1, 7, 130)]
    with OfflineEngine(chunked_prefill_size=32, context_length=512) as eng:
        results = eng.generate(prompts, dict(max_tokens=8, temperature=0.0, ignore_eos=True))
    model, _ = load_for_scheduler(None, eng.config)
    assert [r.token_ids for r in results] == [reference_greedy(model, p, 8) for p in prompts]


def test_eos_ids_from_config_one_parser():
    """config.json's eos_token_id, read the same way for the scheduler and the tokenizer."""
    from engine.tokenizer_loader import eos_ids

    assert eos_ids(None) is None and eos_ids(2) == [2] and eos_ids([0, 2]) == [0, 2]
