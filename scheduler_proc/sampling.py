"""Per-request sampling inside the MLX graph: one batched op chain, no host round trip per token.

Each row carries its own temperature, top-k, top-p, min-p, penalties and seed. Random numbers come
from a counter-based hash of (seed, token position, vocabulary id), so a row's tokens depend only
on its own seed and logits, never on the batch around it, and a chained step needs no host state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import mlx.core as mx
import numpy as np

from engine.sampling_params import SamplingParams

_EPS = 1e-6


@dataclass(frozen=True)
class RowParams:
    """What sampling needs of one request: its parameters, seed and token history."""

    params: SamplingParams
    seed: int
    generated: int  # tokens generated so far (the noise counter)
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(frozen=True)
class SamplerState:
    """Per-row sampling arrays for one batch composition; `advance` makes the chained step's."""

    greedy: mx.array
    temperature: mx.array
    top_k: mx.array
    top_p: mx.array
    min_p: mx.array
    repetition: mx.array
    presence: mx.array
    frequency: mx.array
    seed: mx.array
    position: mx.array
    counts: mx.array | None  # (B, V) generated-token counts, when a penalty needs them
    prompt_seen: mx.array | None  # (B, V) prompt tokens, for the repetition penalty
    any_sampled: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    top_logprobs: int  # largest top-n asked for in the batch; 0: none
    want_logprobs: bool
    allowed: mx.array | None = None  # (B, ceil(V / 32)) int32 packed token masks (grammar.py)


def build_state(
    rows: list[RowParams], vocab: int, allowed: np.ndarray | None = None
) -> SamplerState:
    """`allowed`: packed token masks of the rows (None: no row constrained)."""
    ps = [r.params for r in rows]
    f32 = _column_f32
    any_penalty = any(has_penalty(p) for p in ps)
    return SamplerState(
        greedy=mx.array([p.greedy for p in ps]),
        temperature=f32([max(p.temperature, _EPS) for p in ps]),
        top_k=mx.array([p.top_k if 0 < p.top_k < vocab else vocab for p in ps], mx.int32),
        top_p=f32([p.top_p for p in ps]),
        min_p=f32([p.min_p for p in ps]),
        repetition=f32([p.repetition_penalty for p in ps]),
        presence=f32([p.presence_penalty for p in ps]),
        frequency=f32([p.frequency_penalty for p in ps]),
        seed=mx.array([_fold_seed(r.seed) for r in rows], mx.uint32),
        position=mx.array([r.generated for r in rows], mx.uint32),
        counts=_counts([r.output_ids for r in rows], vocab) if any_penalty else None,
        prompt_seen=_counts([r.prompt_ids for r in rows], vocab) > 0 if any_penalty else None,
        any_sampled=any(not p.greedy for p in ps),
        any_top_k=any(not p.greedy and 0 < p.top_k < vocab for p in ps),
        any_top_p=any(not p.greedy and p.top_p < 1.0 for p in ps),
        any_min_p=any(not p.greedy and p.min_p > 0.0 for p in ps),
        any_penalty=any_penalty,
        top_logprobs=max(p.logprobs for p in ps),
        want_logprobs=any(p.logprobs > 0 for p in ps),
        allowed=None if allowed is None else mx.array(allowed),
    )


def advance(state: SamplerState, tokens: mx.array) -> SamplerState:
    """The state of the next decode step, built on this step's still-lazy tokens."""
    counts = state.counts
    if counts is not None:
        counts = counts.at[mx.arange(tokens.size), tokens].add(1.0)
    # NOTE: a chained step's masks come later (`Runner.sample_deferred`), never this step's.
    return replace(state, position=state.position + 1, counts=counts, allowed=None)


@dataclass(frozen=True)
class Sampled:
    tokens: mx.array  # (B,) int32
    logprob: mx.array | None  # (B,) chosen token's logprob
    top_ids: mx.array | None  # (B, n)
    top_logprobs: mx.array | None  # (B, n)


def sample(logits: mx.array, state: SamplerState) -> Sampled:
    logits = logits.astype(mx.float32)
    scores = _apply_penalties(logits, state) if state.any_penalty else logits
    if state.allowed is not None:
        scores = _masked(scores, state.allowed)
    tokens = mx.argmax(scores, axis=-1)
    if state.any_sampled:
        drawn = mx.argmax(_filtered(scores, state) + _gumbel(state, logits.shape[-1]), axis=-1)
        tokens = mx.where(state.greedy, tokens, drawn)
    tokens = tokens.astype(mx.int32)
    if not state.want_logprobs:
        return Sampled(tokens, None, None, None)
    return _with_logprobs(logits, tokens, state.top_logprobs)


def sample_ahead(
    logits: mx.array,
    state: SamplerState,
    proposals: list[list[int]],
    allowed: mx.array | None = None,
) -> Sampled:
    """Speculating rows' tokens at their proposal's positions: (B, W, V) logits -> (B, W), with
    their logprobs (B, W) and top alternatives (B, W, n) when the batch asks for them.

    Position j of a row (its logits after proposal[j]) is drawn as the row would draw its token
    decoding one at a time, had it emitted proposal[: j + 1]: its penalties counting those
    tokens too, its temperature, top-k, top-p and min-p, and the noise of its own counter at
    `position + 1 + j`. So a row whose proposal matched up to j emits exactly the token plain
    decoding would have, seeded or not. For a proposal of single tokens (prompt lookup proposes,
    it does not sample) this is the rejection rule of speculative sampling: the proposed token d
    is kept with probability p(d), and otherwise the token is drawn from p without d,
    renormalised, which is what a draw from p that is not d is. `allowed`: the packed masks of
    each row's positions, `(B * W, words)` (`Grammars.fill_ahead`), None: no row constrained."""
    b, w, v = logits.shape
    scores = logits.reshape(b * w, v)
    if not (state.any_sampled or state.any_penalty or state.want_logprobs or allowed is not None):
        return Sampled(mx.argmax(scores, axis=-1).astype(mx.int32).reshape(b, w), None, None, None)

    def each(a: mx.array) -> mx.array:
        return mx.repeat(a, w, axis=0)

    steps = mx.tile(mx.arange(1, w + 1, dtype=mx.uint32), b)
    ahead = replace(
        state,
        greedy=each(state.greedy),
        temperature=each(state.temperature),
        top_k=each(state.top_k),
        top_p=each(state.top_p),
        min_p=each(state.min_p),
        repetition=each(state.repetition),
        presence=each(state.presence),
        frequency=each(state.frequency),
        seed=each(state.seed),
        position=each(state.position) + steps,
        counts=None if state.counts is None else _counts_ahead(state.counts, proposals, w),
        prompt_seen=None if state.prompt_seen is None else each(state.prompt_seen),
        allowed=allowed,
    )
    s = sample(scores, ahead)

    def rows(a: mx.array | None, *shape: int) -> mx.array | None:
        return None if a is None else a.reshape(b, w, *shape)

    return Sampled(
        s.tokens.reshape(b, w), rows(s.logprob), rows(s.top_ids, -1), rows(s.top_logprobs, -1)
    )


def _counts_ahead(counts: mx.array, proposals: list[list[int]], w: int) -> mx.array:
    """(B, V) generated-token counts -> (B * W, V): position j of row i also counts the row's
    proposal[: j + 1], the tokens before it that it would have emitted."""
    rows = [i * w + j for i, p in enumerate(proposals) for j in range(len(p)) for _ in range(j + 1)]
    cols = [t for p in proposals for j in range(len(p)) for t in p[: j + 1]]
    out = mx.repeat(counts, w, axis=0)
    if not cols:
        return out
    return out.at[mx.array(rows), mx.array(cols)].add(1.0)


@partial(mx.compile, shapeless=True)
def _masked(scores: mx.array, packed: mx.array) -> mx.array:
    """-inf where (B, ceil(V / 32)) packed words forbid: token t is bit t % 32 of word t // 32.

    NOTE: one fused kernel for any batch (shapeless): as separate ops (a gather of the words, the
    shifts, the select) the 32 x 49152 expansion took 21 ms a step on this CPU, 3-4 ms fused."""
    bits = (packed.astype(mx.uint32)[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = mx.flatten(bits, 1, 2)[:, : scores.shape[-1]]
    return mx.where(allowed == 1, scores, -mx.inf)


def _filtered(scores: mx.array, state: SamplerState) -> mx.array:
    x = scores / state.temperature[:, None]
    if state.any_top_k:
        ascending = mx.sort(x, axis=-1)
        kth = mx.take_along_axis(ascending, (x.shape[-1] - state.top_k)[:, None], axis=-1)
        x = mx.where(x >= kth, x, -mx.inf)
    if state.any_top_p or state.any_min_p:
        probs = mx.softmax(x, axis=-1)
        keep = mx.ones(x.shape, mx.bool_)
        if state.any_top_p:
            keep = keep & (probs >= _top_p_threshold(probs, state.top_p))
        if state.any_min_p:
            peak = mx.max(probs, axis=-1, keepdims=True)
            keep = keep & (probs >= state.min_p[:, None] * peak)
        x = mx.where(keep, x, -mx.inf)
    return x


def _top_p_threshold(probs: mx.array, top_p: mx.array) -> mx.array:
    """Smallest probability inside the nucleus: the fewest top tokens whose mass reaches top_p."""
    ascending = mx.sort(probs, axis=-1)
    mass_above = 1.0 - mx.cumsum(ascending, axis=-1)  # mass of strictly larger entries
    inside = mass_above < top_p[:, None]
    return mx.min(mx.where(inside, ascending, mx.inf), axis=-1, keepdims=True)


def _apply_penalties(logits: mx.array, state: SamplerState) -> mx.array:
    counts, prompt_seen = state.counts, state.prompt_seen
    assert counts is not None and prompt_seen is not None, "penalties without their counts"
    seen = prompt_seen | (counts > 0)
    rep = state.repetition[:, None]
    penalised = mx.where(logits > 0, logits / rep, logits * rep)
    x = mx.where(seen, penalised, logits)
    x = x - state.presence[:, None] * (counts > 0)
    return x - state.frequency[:, None] * counts


def token_logprobs(logits: mx.array, tokens: mx.array, n: int) -> list[mx.array]:
    """Each row's `tokens` logprob under `logits` (float32), and its top `n` (ids, logprobs)
    when n > 0: a prompt's logprobs, position by position."""
    x = logits.astype(mx.float32)
    if n == 0:
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        return [mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]]
    s = _with_logprobs(x, tokens, n)
    assert s.logprob is not None and s.top_ids is not None and s.top_logprobs is not None
    return [s.logprob, s.top_ids, s.top_logprobs]


def _with_logprobs(logits: mx.array, tokens: mx.array, n: int) -> Sampled:
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top = mx.argpartition(-lp, n - 1, axis=-1)[:, :n]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    return Sampled(tokens, chosen, top, mx.take_along_axis(top_lp, order, axis=-1))


def _u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def _gumbel(state: SamplerState, vocab: int) -> mx.array:
    u32 = _u32
    row = _mix(state.seed * u32(0x9E3779B1) + state.position * u32(0x85EBCA77))
    h = _mix(row[:, None] ^ (mx.arange(vocab, dtype=mx.uint32)[None] * u32(0xC2B2AE3D)))
    return -mx.log(-mx.log(uniform(h)))


def uniform(h: mx.array) -> mx.array:
    """uint32 hashes as float32 strictly inside (0, 1).

    NOTE: from 24 bits, the largest hash rounded to 1.0 in float32 (2^24 - 0.5 is not a float32),
    its Gumbel noise was +inf, and -inf (a token filtered out or masked) + inf is NaN, which
    argmax takes: about one row-step in 300 at a 49k vocabulary drew a forbidden token. 23 bits
    keep the largest below 1."""
    return ((h >> _u32(9)).astype(mx.float32) + 0.5) * (1.0 / (1 << 23))


def _mix(x: mx.array) -> mx.array:
    """murmur3's 32-bit finaliser: a cheap, well-spread integer hash."""
    u32 = _u32
    x = x ^ (x >> u32(16))
    x = x * u32(0x85EBCA6B)
    x = x ^ (x >> u32(13))
    x = x * u32(0xC2B2AE35)
    return x ^ (x >> u32(16))


def _counts(token_lists: list[list[int]], vocab: int) -> mx.array:
    rows = [i for i, ids in enumerate(token_lists) for _ in ids]
    cols = [t for ids in token_lists for t in ids]
    out = mx.zeros((len(token_lists), vocab), mx.float32)
    if not cols:
        return out
    return out.at[mx.array(rows), mx.array(cols)].add(1.0)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _column_f32(values: list[float]) -> mx.array:
    return mx.array(values, mx.float32)


def _fold_seed(seed: int) -> int:
    return (seed ^ (seed >> 32)) & 0xFFFFFFFF
