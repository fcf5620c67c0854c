"""The prefill planner's rules at the H200's launch sizes, without a model (pure planning)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from scheduler_proc.kv_manager import lone_start
from scheduler_proc.prefill_plan import LONE_KEYS_BESIDE_DECODE, PrefillPlanner
from scheduler_proc.request import Req
from scheduler_proc.shapes import Ladders

CHUNK, BUDGET, LONG = 2048, 8192, 512
LADDERS = Ladders.for_pool(slots=256, context=131072, chunk=CHUNK)
PLANNER = PrefillPlanner(CHUNK, BUDGET, heads=32, beside_decode=1 << 21, long_chunk=LONG)


def _req(rid: str, n: int, prefilled: int = 0) -> Req:
    req = Req(rid, list(range(n)), SamplingParams(max_tokens=8), 0, 8, frozenset())
    req.prefilled = prefilled
    return req


def _plan(reqs: list[Req], decoding: bool) -> list[tuple[str, int, int]]:
    return [(r.rid, r.prefilled, n) for r, n in PLANNER.plan(reqs, LADDERS, decoding).chunks]


def test_beside_decode_a_long_prompts_first_chunk_runs_alone_and_short():
    """While rows decode, a long prompt's first chunk is one lone chunk of --long-prefill-chunk
    tokens, like its later ones: 4 prompts of 30k tokens beside 64 chats on an H200 ran their
    first chunks as 2 rows x 2048 tokens, steps several times a decode step's."""
    longs = [_req(f"long{i}", 30002) for i in range(4)]
    assert _plan(longs, decoding=True) == [("long0", 0, LONG)]
    assert _plan([_req("long0", 30002, LONG), *longs[1:]], decoding=True) == [("long0", LONG, LONG)]


def test_short_prompts_go_first_and_nothing_decoding_keeps_the_full_bound():
    """A chat's prompt beside the long ones runs without them; with nothing decoding the long
    prompts' first chunks fill the step as before (fastest to their first token)."""
    longs = [_req(f"long{i}", 30002) for i in range(4)]
    chat = _req("chat", 300)
    assert _plan([*longs, chat], decoding=True) == [("chat", 0, 299)]
    alone = _plan(longs, decoding=False)
    assert len(alone) > 1 and all(n == CHUNK for _, _, n in alone), alone


def test_a_prompt_of_one_chunk_is_not_long():
    """A prompt whose rest fits one chunk keeps its whole first chunk beside decode."""
    assert _plan([_req("mid", 1500)], decoding=True) == [("mid", 0, 1499)]


MANY = PrefillPlanner(CHUNK, BUDGET, heads=32, beside_decode=1 << 21, long_chunk=LONG, lone_rows=64)


def _seated(reqs: list[Req]) -> list[Req]:
    for i, r in enumerate(reqs):
        r.seated = i + 1
    return reqs


def test_lone_chunks_fill_a_step_up_to_the_budget_or_the_keys_beside_decode():
    """Agents after a prefix hit: every rest a lone chunk, many a step (one a step, the rule
    before, was a burst of 128 agents' whole bottleneck on an H200); beside decode the step
    reads at most LONE_KEYS_BESIDE_DECODE keys, the first row always runs."""
    agents = _seated([_req(f"a{i}", 3000, 2560) for i in range(40)])
    alone = MANY.plan(agents, LADDERS, decoding=False)
    assert alone.lone and [r.rid for r, _ in alone.chunks] == [f"a{i}" for i in range(16)]
    beside = MANY.plan(agents, LADDERS, decoding=True)
    assert len(beside.chunks) == LONE_KEYS_BESIDE_DECODE // (2560 + LONG)
    huge = _seated([_req("long", 90000, 65536)])
    assert MANY.plan(huge, LADDERS, decoding=True).chunks == [(huge[0], LONG)]


def test_lone_steps_and_the_others_take_turns():
    """A chunk up to the next multiple (after a hit) and lone chunks: the others first, then
    lone ones when the step before ran the others, so neither waits behind a stream of the
    other."""
    reqs = _seated([_req("lone", 3000, 2560), _req("hit", 3000, 2100), _req("chat", 300)])
    first = MANY.plan(reqs, LADDERS, decoding=False)
    assert not first.lone and {(r.rid, n) for r, n in first.chunks} == {
        ("hit", 5 * LONG - 2100),
        ("chat", 299),
    }
    turn = MANY.plan(reqs, LADDERS, decoding=False, lone_first=True)
    assert turn.lone and [(r.rid, n) for r, n in turn.chunks] == [("lone", 2999 - 2560)]


def test_a_hit_is_cut_back_to_a_multiple_when_its_rest_crosses_one():
    """Its chunks are then lone ones only; a rest that ends before the next multiple (a warm
    turn's few tokens) keeps its whole hit, and so does a hit under the width."""
    assert lone_start(2100, 2999, LONG) == 2048  # NOTE: the rest runs to 2999
    assert lone_start(2100, 2110, LONG) == 2100  # NOTE: 10 tokens, before 2560
    assert lone_start(2048, 2999, LONG) == 2048
    assert lone_start(300, 2999, LONG) == 300  # NOTE: a hit under the width is kept whole
