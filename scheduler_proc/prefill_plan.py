"""Which prompt chunks one prefill step runs: rows, their widths, within the step's budgets.

Every row of a prefill forward is padded to one width, so the planner picks the width that runs
the most tokens within `--max-prefill-tokens`, then keeps the step's attention scores (rows x heads
x width x keys) within `PREFILL_SCORES_MAX`. Prompts whose rest fits one chunk go first.

With `long_chunk` (`prefill_attention.long_chunk`), a chunk that starts on a multiple of it is a
lone chunk: that many tokens, padded, attending by the causal kernel over its own row's keys (no
scores held, so no score bound). A step of lone chunks carries up to `lone_rows` of them, each row
attending on its own (`decode_attention.by_groups`). Other later chunks end on such a multiple, so
the next one starts there. While requests decode, a long prompt's first chunk (its rest more than
one chunk) is a lone one too. Steps of lone chunks and steps of the others take turns
(`lone_first`), so neither kind waits behind a stream of the other.

NOTE: one lone chunk a step was the rule until 2026-12-04, and under 128 agents on an H200 it was
the whole engine's bottleneck: a prefix hit leaves each request's rest one short step from a
multiple, then every chunk of it ran alone, so each request took two prefill steps of its own
(1,688 of 1,696 prefill steps carried one request; a burst's TTFT p50 11 s, and with every turn
arriving behind the last the backlog never drained).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from scheduler_proc.request import Req
from scheduler_proc.shapes import Ladders

# NOTE: attention scores one prefill step may hold (elements; float32: 1 GiB), `_fit_scores`.
PREFILL_SCORES_MAX = 1 << 28
# NOTE: while requests decode, a step of lone chunks reads at most this many keys over its rows
# (its attention's cost): one 30k-token prompt's chunk alone, as before, or 8 agents' chunks over
# 4k keys. H200, 4 prompts of 30k tokens beside 64 chats: a lone chunk's step ~10 ms, and two of
# them a step would double the chats' wait (benchmarks.md).
LONE_KEYS_BESIDE_DECODE = 1 << 15


class StepPlan(NamedTuple):
    """One prefill step's chunks: (request, tokens) from its `prefilled`; `lone`: lone chunks,
    each padded to `long_chunk` and attending over its own row's keys."""

    chunks: list[tuple[Req, int]]
    lone: bool = False


@dataclass(frozen=True)
class PrefillPlanner:
    chunk_size: int  # --chunked-prefill-size: most tokens of one request per step
    budget: int  # --max-prefill-tokens: most padded tokens per step
    heads: int  # the model's query heads (attention scores per token pair)
    uniform: bool = False  # equal unpadded chunks (a model whose state absorbs padding)
    beside_decode: int | None = None  # --long-prefill-scores (None: no cap)
    long_chunk: int | None = None  # --long-prefill-chunk (None: off)
    lone_rows: int = 1  # most lone chunks in one step (1: the model's attention is not ours)
    scores_held: bool = True  # False: fused attention holds only the mask (`backend.py`)

    @property
    def scores_limit(self) -> int:
        """Most rows x width x keys of one prefill step: `PREFILL_SCORES_MAX` over the heads, or
        whole when the attention holds only its one-byte mask, shared by the heads."""
        return PREFILL_SCORES_MAX // self.heads if self.scores_held else PREFILL_SCORES_MAX

    def plan(
        self, todo: list[Req], ladders: Ladders, decoding: bool = False, lone_first: bool = False
    ) -> StepPlan:
        """(request, tokens) for one step, from the prefilling requests with a body left;
        `decoding`: requests are decoding, and wait for this step; `lone_first`: lone chunks
        go before the others (the step before ran the others)."""
        cap = None
        if self.long_chunk is not None:
            w = self.long_chunk
            lone = [r for r in todo if self._lone(r, w, decoding)]
            rest = [r for r in todo if not self._lone(r, w, decoding)]
            if lone and (lone_first or not rest):
                return StepPlan(self._lone_step(lone, w, decoding), lone=True)
            todo, cap = rest, lambda r: to_multiple(r, w)
        plan = self._plan(todo, ladders, cap)
        if decoding and self.beside_decode is not None:
            plan = self._beside_decode(plan, ladders, self.beside_decode)
        return StepPlan(plan)

    def _lone(self, req: Req, w: int, decoding: bool) -> bool:
        """Whether the request's next chunk is a lone one: it starts on a multiple of `w` past
        0, or, while requests decode, it is a long prompt's first (its rest more than a chunk)."""
        start = req.prefilled
        if start == 0:
            return decoding and room(req) > self.chunk_size
        return start % w == 0

    def _lone_step(self, lone: list[Req], w: int, decoding: bool) -> list[tuple[Req, int]]:
        """Lone chunks in seating order, as many as the budget holds (`lone_rows`); beside
        decode, within `LONE_KEYS_BESIDE_DECODE` keys read (the first always runs)."""
        most = max(1, min(self.lone_rows, self.budget // w))
        plan: list[tuple[Req, int]] = []
        keys = 0
        for req in sorted(lone, key=lambda r: r.seated)[:most]:
            keys += req.prefilled + w
            if plan and decoding and keys > LONE_KEYS_BESIDE_DECODE:
                break
            plan.append((req, min(room(req), w)))
        return plan

    def _plan(
        self, todo: list[Req], ladders: Ladders, cap: Callable[[Req], int] | None = None
    ) -> list[tuple[Req, int]]:
        """`cap`: most tokens of a request's chunk (default `room`; or up to the next lone
        boundary)."""
        cap = cap or room
        # NOTE: prompts whose rest fits one chunk first (in arrival order), then longer ones: 4
        # prompts of 30k tokens ahead of 64 chats on an H200 held the chats' first tokens 27 s.
        todo = sorted(todo, key=lambda r: room(r) > self.chunk_size)
        if self.uniform:
            natural = lambda r: self._natural_chunk(r, ladders)  # noqa: E731
            return self._fit_scores(_uniform_chunks(todo, natural, self.budget), ladders)

        def rows(width: int) -> list[Req]:
            return todo[: max(1, self.budget // width)]

        def tokens(width: int) -> tuple[int, int]:  # most tokens, then the narrowest
            return sum(min(cap(r), width) for r in rows(width)), -width

        width = max(ladders.widths, key=tokens)
        plan = [(req, min(cap(req), width)) for req in rows(width)]
        return self._fit_scores(plan, ladders)

    def _beside_decode(
        self, plan: list[tuple[Req, int]], ladders: Ladders, limit: int
    ) -> list[tuple[Req, int]]:
        """While requests decode: chunks reading more keys than one chunk (a long prompt's later
        chunks) only in steps of their own, within `limit` scores.

        NOTE: H200, 4 prompts of 32k tokens beside 64 chats: their later chunks at the step
        bound (8.4M scores a head) cost ~70 ms a step, each after one 8-10 ms decode step, so
        the chats' inter-token p50 went from 7 to 50 ms (p99 8 to 75 ms).
        """
        short = [(r, n) for r, n in plan if ladders.pad_kv(r.prefilled + n) <= self.chunk_size]
        return short or self._fit_scores(plan, ladders, limit)

    def _fit_scores(
        self, plan: list[tuple[Req, int]], ladders: Ladders, limit: int | None = None
    ) -> list[tuple[Req, int]]:
        """Fewer rows, then a narrower chunk, until the step's attention scores (rows x heads x
        width x keys) fit `PREFILL_SCORES_MAX`.

        NOTE: a prefill chunk's attention (with its mask) materialises its scores: 4 rows of
        2048 tokens over 32k keys with 32 heads wanted 34 GB on an H200 beside the KV pool
        (out of memory); long prompts' late chunks get narrower instead.
        """
        limit = min(limit or self.scores_limit, self.scores_limit)
        while True:
            width = max(n for _, n in plan)
            keys = ladders.pad_kv(max(r.prefilled + n for r, n in plan))
            if len(plan) * width * keys <= limit or (len(plan) == 1 and width <= 16):
                return plan
            if len(plan) > 1:
                plan = plan[:-1]
            else:
                plan = [(plan[0][0], max(16, width // 2))]

    def _natural_chunk(self, req: Req, ladders: Ladders) -> int:
        """A row's chunk in a step without padding: the most it may run, down to a ladder width
        (a bucketed shape) when there is one, else its whole rest."""
        n = min(room(req), self.chunk_size)
        if ladders.exact:
            return n
        fits = [w for w in ladders.widths if w <= n]
        return fits[-1] if fits else n


def _uniform_chunks(
    todo: list[Req], natural: Callable[[Req], int], budget: int
) -> list[tuple[Req, int]]:
    """Rows that all run the same number of tokens: the group that runs the most of them.

    NOTE: for models whose recurrent state absorbs padding (`state_padding`: nemotron_h's Mamba
    scan takes no lengths): their prefill steps have no padding inside a row.
    """
    groups: dict[int, list[Req]] = {}
    for req in todo:
        groups.setdefault(natural(req), []).append(req)

    def fit(n: int) -> int:  # NOTE: rows x width stays within --max-prefill-tokens
        return max(1, budget // n)

    n, reqs = max(groups.items(), key=lambda g: (g[0] * min(len(g[1]), fit(g[0])), g[0]))
    return [(r, n) for r in reqs[: fit(n)]]


def room(req: Req) -> int:
    """Fill tokens the request's next chunk may run: up to its snapshot point, if it has one."""
    left = body_left(req)
    if req.snap_at is not None and req.prefilled < req.snap_at:
        return min(left, req.snap_at - req.prefilled)
    return left


def to_multiple(req: Req, w: int) -> int:
    """`room`, up to the next multiple of `w` for a later chunk (its next chunk a lone one)."""
    start = req.prefilled
    return min(room(req), w - start % w) if start % w else room(req)


def body_left(req: Req) -> int:
    """Fill tokens still to prefill before the last one (which runs in a decode step)."""
    return req.fill_len - 1 - req.prefilled


def due(req: Req) -> bool:
    """A prefilling request whose last prompt token runs in the next decode step."""
    return body_left(req) == 0
