"""The prefill planner's rules at the H200's launch sizes, without a model (pure planning)."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from scheduler_proc.prefill_plan import PrefillPlanner
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
    return [(r.rid, r.prefilled, n) for r, n in PLANNER.plan(reqs, LADDERS, decoding)]


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
