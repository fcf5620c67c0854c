"""Which prompt chunks one prefill step runs: rows, their widths, within the step's budgets.

Every row of a prefill forward is padded to one width, so the planner picks the width that runs
the most tokens within `--max-prefill-tokens`, then keeps the step's attention scores (rows x heads
x width x keys) within `PREFILL_SCORES_MAX`. Prompts whose rest fits one chunk go first.

With `long_chunk` (`prefill_attention.long_chunk`), a later chunk that starts on a multiple of it
runs alone, that many tokens, by the causal kernel: no scores held, so no score bound. Other
later chunks end on such a multiple, so the next one starts there. While requests decode, a long
prompt's first chunk (its rest more than one chunk) runs alone too, that many tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from scheduler_proc.prefill_attention import aligned
from scheduler_proc.request import Req
from scheduler_proc.shapes import Ladders

# NOTE: attention scores one prefill step may hold (elements; float32: 1 GiB), `_fit_scores`.
PREFILL_SCORES_MAX = 1 << 28


@dataclass(frozen=True)
class PrefillPlanner:
    chunk_size: int  # --chunked-prefill-size: most tokens of one request per step
    budget: int  # --max-prefill-tokens: most padded tokens per step
    heads: int  # the model's query heads (attention scores per token pair)
    uniform: bool = False  # equal unpadded chunks (a model whose state absorbs padding)
    beside_decode: int | None = None  # --long-prefill-scores (None: no cap)
    long_chunk: int | None = None  # --long-prefill-chunk (None: off)

    @property
    def scores_limit(self) -> int:
        """Most rows x width x keys of one prefill step (`PREFILL_SCORES_MAX` over the heads)."""
        return PREFILL_SCORES_MAX // self.heads

    def plan(
        self, todo: list[Req], ladders: Ladders, decoding: bool = False
    ) -> list[tuple[Req, int]]:
        """(request, tokens) for one step, from the prefilling requests with a body left;
        `decoding`: requests are decoding, and wait for this step."""
        plan = self._plan(todo, ladders)
        if self.long_chunk is not None:
            plan = self._lone_or_aligned(plan, self.long_chunk, decoding)
            if len(plan) == 1 and aligned(plan[0][0].prefilled, plan[0][1], self.long_chunk):
                return plan
        if decoding and self.beside_decode is not None:
            return self._beside_decode(plan, ladders, self.beside_decode)
        return plan

    def _lone_or_aligned(
        self, plan: list[tuple[Req, int]], w: int, decoding: bool = False
    ) -> list[tuple[Req, int]]:
        """The chunks that are not lone causal ones, each ending by the next multiple of `w`;
        with none, the first lone one alone. `decoding`: a long prompt's first chunk (its rest
        more than one chunk) is a lone one too, `w` tokens, so no step beside decode runs more.

        NOTE: H200, 32/8 heads, 32k keys: a 512-query chunk by the causal kernel 0.47 ms a layer
        against 2.9 ms by ops (whose 64-query chunks, within the score bound, cost 0.86 ms)."""
        rest = []
        for req, n in plan:
            start = req.prefilled
            if decoding and start == 0 and room(req) > self.chunk_size:
                continue
            if not aligned(start, 1, w):
                rest.append((req, min(n, w - start % w) if start % w else n))
        if rest:
            return rest
        req = plan[0][0]
        return [(req, min(room(req), w))]

    def _plan(self, todo: list[Req], ladders: Ladders) -> list[tuple[Req, int]]:
        # NOTE: prompts whose rest fits one chunk first (in arrival order), then longer ones: 4
        # prompts of 30k tokens ahead of 64 chats on an H200 held the chats' first tokens 27 s.
        todo = sorted(todo, key=lambda r: room(r) > self.chunk_size)
        if self.uniform:
            natural = lambda r: self._natural_chunk(r, ladders)  # noqa: E731
            return self._fit_scores(_uniform_chunks(todo, natural, self.budget), ladders)

        def rows(width: int) -> list[Req]:
            return todo[: max(1, self.budget // width)]

        def tokens(width: int) -> tuple[int, int]:  # most tokens, then the narrowest
            return sum(min(room(r), width) for r in rows(width)), -width

        width = max(ladders.widths, key=tokens)
        plan = [(req, min(room(req), width)) for req in rows(width)]
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


def long_prefill_scores(config: EngineConfig, on_cpu: bool) -> int | None:
    """`--long-prefill-scores`, 0 meaning by backend: a GPU's decode steps are short (ms) beside
    a long prompt's chunk; on the CPU a prompt's chunks already cost more than any decode step,
    and splitting them further would only delay its first token."""
    if config.long_prefill_scores:
        return config.long_prefill_scores
    return None if on_cpu else 1 << 21


def prefill_sizes(config: EngineConfig, on_cpu: bool) -> tuple[int, int]:
    """(tokens per request, padded tokens per prefill step); 0 in the config means by backend.

    NOTE: on an H200 (Llama-3.2-1B shape, 128 requests of 32-1024 prompt tokens) the prefill
    steps took 2.2 s at 512/2048 and 0.8 s at 2048/8192. On the CPU a step's cost grows with its
    tokens (no idle compute to fill): 16 completions at once (default model, 2 cores) got their
    first token at p50 1.61-1.64 s with 512-token steps vs 1.93 s with 2048 (one step for all),
    throughput unchanged (128.7 / 119.6 vs 118.3 tok/s).
    """
    chunk = config.chunked_prefill_size or (512 if on_cpu else 2048)
    budget = config.max_prefill_tokens or (512 if on_cpu else 8192)
    return min(chunk, budget), budget


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


def body_left(req: Req) -> int:
    """Fill tokens still to prefill before the last one (which runs in a decode step)."""
    return req.fill_len - 1 - req.prefilled


def due(req: Req) -> bool:
    """A prefilling request whose last prompt token runs in the next decode step."""
    return body_left(req) == 0
