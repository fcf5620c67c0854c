"""Builds a step's one lazy forward on the paged KV pool and queues it with `mx.async_eval`.

Every forward has a bucketed shape (`scheduler_proc.shapes`): rows, query width and keys read are
rounded up, and padding rows and positions write only to the pool's scratch page and slot. Row i
of a decode forward is the batch's i-th request (`Batch.rows`), whatever its slot and pages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.progress import Progress
from engine.sampling_params import SamplingParams
from scheduler_proc import decode_attention, prefill_attention
from scheduler_proc.batch import Batch, PromptSlice
from scheduler_proc.kv_cache import EntryCache, KVPool, StepRows
from scheduler_proc.request import Req
from scheduler_proc.sampling import (
    RowParams,
    SamplerState,
    build_state,
    sample,
    sample_ahead,
    token_logprobs,
)
from scheduler_proc.shapes import Ladders
from scheduler_proc.state_padding import padding_keeps_state

log = logging.getLogger(__name__)

_PAD_PARAMS = SamplingParams(temperature=0.0)
# NOTE: the keys of a step of several lone chunks (`PromptSlice.lone`): each row attends over
# its own, and each row's shape is counted as a lone chunk's `(1, width, keys)`.
ROW_KEYS = -2
# NOTE: cuDNN keeps 256 attention graphs (MLX_CUDA_SDPA_CACHE_SIZE); 128 chunk shapes of 512 fit
# beside the rest. Longer prompts' chunks build when first seen.
LONG_WARM_KEYS = 65536
_PAD_ROW = RowParams(_PAD_PARAMS, 0, 0, [], [])


def row_params(req: Req) -> RowParams:
    return RowParams(req.params, req.seed, len(req.output_ids), req.input_ids, req.output_ids)


class Runner:
    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        vocab: int,
        ladders: Ladders,
        fused: str = "auto",
        prefill: str = "auto",
        long_chunk: int = -1,
    ) -> None:
        """`fused`: `--fused-decode`; `prefill`: `--prefill-attention`; `long_chunk`:
        `--long-prefill-chunk`."""
        self.model, self.pool, self.vocab, self.ladders = model, pool, vocab, ladders
        # NOTE: when padding inside a row reaches a recurrent state (`state_padding`), a prefill
        # step's chunks are all equally long and run unpadded (`prefill_plan._uniform_chunks`).
        self.uniform_prefill = not padding_keeps_state(model, pool.layout)
        if pool.layout.states:
            how = "equal unpadded chunks" if self.uniform_prefill else "padded chunks"
            log.info("recurrent state layers: prefill steps run %s", how)
        self.shapes_seen: set[tuple[int, ...]] = set()
        self.shapes_warmed = 0  # of those, run by the warm-up
        self.warmed = False  # set after warm-up: later first-seen shapes are logged
        self._windows = any(s.window is not None for s in pool.shapes)
        # NOTE: "on" off CUDA runs the kernel's masked twin: the same plumbing, for tests.
        want = fused == "on" or (fused == "auto" and decode_attention.available())
        self.fused_decode = want and self._check_fused()
        # NOTE: a chained step's KV writes reuse their layer's buffer only if nothing still holds
        # it. Metal keeps every input of a command buffer alive until the buffer completes, so a
        # step queued while the one before it still runs (the device, not the host, sets the
        # pace) would copy each layer's whole buffer. Its graph is built meanwhile; only the
        # queueing waits, and MLX commits work as it is queued, so the device idles for one
        # command buffer's encoding. On this project's CPU runs the wait cost nothing measurable
        # (MLX already holds the encoding back to ~10 tasks in flight); CUDA keeps the full
        # overlap: its host sets the pace, and 256 rows x 4,000 tokens chained showed no copy.
        self.queue_after_previous = not decode_attention.available()
        # NOTE: a model whose attention is not mlx-lm's keeps its own (nothing rebound).
        self.prefill_by_ops = prefill_attention.by_ops(prefill) and bool(
            decode_attention.install(model)
        )
        # NOTE: without the fused kernel a decode gathers its rows' keys; rows of very different
        # lengths then attend in groups (`kv_cache.SPLIT_RATIO`), which needs our attention.
        self.split_decode = not self.fused_decode and bool(decode_attention.install(model))
        if self.prefill_by_ops:
            log.info("prefill attention: MLX ops (no per-shape build)")
        self.long_chunk = prefill_attention.long_chunk(long_chunk, pool.layout, self.prefill_by_ops)
        # NOTE: several lone chunks a step need each row to attend on its own, which only the
        # attention `decode_attention.install` routes can do; otherwise one a step.
        self.lone_rows = 1
        if self.long_chunk and decode_attention.install(model):
            self.lone_rows = ladders.rows[-1]
        if self.long_chunk:
            many = "several" if self.lone_rows > 1 else "one"
            log.info("lone chunks: %d tokens, causal kernel, %s a step", self.long_chunk, many)

    def _kernel_cases(self) -> list[dict[str, Any]]:
        """The kernel's start-up checks: its own case, and each full-attention layer shape of
        this model (which of the kernel's variants runs depends on the shape)."""
        args = getattr(self.model, "args", None)
        heads = getattr(args, "num_attention_heads", None)
        kv = getattr(args, "num_key_value_heads", None) or heads
        cases: list[dict[str, Any]] = [{}]
        if not isinstance(heads, int) or not isinstance(kv, int) or heads % kv:
            return cases
        full = {(s.kv_heads, s.k_dim, s.dtype) for s in self.pool.shapes if s.window is None}
        quant = self.pool.quant
        for kv_heads, dim, dtype in sorted(full, key=str):
            case = dict(heads=heads // kv * kv_heads, kv_heads=kv_heads, dim=dim, dtype=dtype)
            cases.append(dict(case, page_size=self.pool.page_size))
            if quant is not None:  # NOTE: the quantized kernel reads the pages
                cases.append(dict(cases[-1], quant=(quant.bits, quant.group)))
        return cases

    def _check_fused(self) -> bool:
        """One fused decode forward (scratch writes only): did every full-attention layer run
        the kernel? A model whose attention bypasses mlx-lm's function keeps the masked path,
        and so does a kernel whose results differ from MLX's attention (`self_check`)."""
        if not all(decode_attention.self_check(**case) for case in self._kernel_cases()):
            log.warning("decode attention: masked (the fused kernel failed its self-check)")
            return False
        if not decode_attention.install(self.model):
            log.info("decode attention: masked (the model's attention is not mlx-lm's)")
            return False
        full = sum(s.window is None for s in self.pool.shapes)
        before = (decode_attention.counts.calls, decode_attention.counts.masked)
        tokens, plan, kv_len = self._warm_decode(2, self.ladders.kv[0])
        # NOTE: a kernel that fails to build, or a layer handed whole buffers without asking for
        # lengths (KV shared across layers: MLX refuses the shapes), keeps the masked path.
        try:
            mx.eval(self.model(tokens, cache=self.pool.ragged_view(plan, kv_len, fused=True)))
        except Exception as e:
            log.warning("decode attention: masked (the fused forward failed: %s)", e)
            return False
        calls = decode_attention.counts.calls - before[0]
        masked = decode_attention.counts.masked - before[1]
        if calls != full or masked:
            log.info("decode attention: masked (%d of %d layers fused)", calls - masked, full)
            return False
        log.info("decode attention: fused kernel, rows of any length, no mask")
        return True

    def launch(
        self,
        batch: Batch,
        decode_inputs: mx.array | None,
        defer_sample: bool = False,
        after: Batch | None = None,
    ) -> None:
        """Build the batch's one forward and queue it. `defer_sample`: the forward only, its
        sampling left to `sample_deferred` (its token masks are not known yet). `after`: the
        step still in flight that this chained one follows; off CUDA the new step is queued
        once `after` has run (`queue_after_previous`), elsewhere nothing here blocks."""
        if batch.is_prefill:
            self._prefill(batch, batch.slices)
            # NOTE: the KV buffers too: a first chunk's writes are read by nothing in its step
            mx.async_eval(*_outputs(batch), *self.pool.state())
            return
        assert decode_inputs is not None, "a decode step has input tokens"
        logits = self._decode_logits(batch, decode_inputs)
        # NOTE: not the KV buffers: every layer's write is read by its attention, so the outputs
        # need them anyway, and MLX's CPU backend holds whatever `async_eval` is given until the
        # whole step has run; the next step, built meanwhile, then could not write the first
        # layers' buffers in place and copied them (recurrent states are written and not read,
        # so they must be asked for).
        states = self.pool.recurrent_state()
        if after is not None and self.queue_after_previous:
            mx.eval(*_outputs(after))  # NOTE: its graph is built: only the queueing waits
        if defer_sample:
            batch.logits = logits
            mx.async_eval(logits, *states)
            return
        assert batch.sampler is not None
        batch.decode_out = sample(logits, batch.sampler)
        mx.async_eval(*_outputs(batch), *states)

    def sample_deferred(self, batch: Batch, allowed: np.ndarray | None) -> None:
        """Queue the sampling of a forward launched with `defer_sample`, under `allowed`."""
        assert batch.logits is not None and batch.sampler is not None, "no deferred sampling"
        n = batch.logits.shape[0]
        batch.allowed = allowed
        packed = None if allowed is None else mx.array(_pad_masks(allowed, n))
        batch.sampler = replace(batch.sampler, allowed=packed)
        batch.decode_out = sample(batch.logits, batch.sampler)
        batch.logits = None
        mx.async_eval(*_outputs(batch))

    def decode_rows(self, batch: Batch) -> int:
        """Forward rows of a decode step: its requests, bucketed."""
        return self.ladders.pad_rows(len(batch.rows))

    def chained_inputs(self, prev: Batch, batch: Batch) -> mx.array:
        """A chained step whose rows are some of `prev`'s (`batch.decode`: those that go on)
        then prompts joining (`batch.joined`): each row's input (`prev`'s lazy tokens, the
        prompts' last fill tokens), and `batch.sampler` built for these rows, `prev`'s one token
        further (its tokens are in flight). Only for rows without penalties: their counts would
        need `prev`'s tokens on the host."""
        assert prev.decode_out is not None, "a launched decode step"
        n = self.decode_rows(batch)
        rows = [replace(row_params(r), generated=len(r.output_ids) + 1) for r in batch.decode]
        rows += [row_params(r) for r in batch.joined]
        batch.sampler = build_state(rows + [_PAD_ROW] * (n - len(rows)), self.vocab)
        assert not batch.sampler.any_penalty, "penalties need the host's counts"
        host = [r.fill_ids[-1] for r in batch.joined] + [0] * (n - len(rows))
        at = {id(r): i for i, r in enumerate(prev.rows)}
        return _picked(prev.decode_out.tokens, [at[id(r)] for r in batch.decode], host)

    def decode_inputs(self, batch: Batch) -> mx.array:
        """Each row's input token: its last output, or a joined request's last fill token."""
        tokens = [r.output_ids[-1] for r in batch.decode] + [r.fill_ids[-1] for r in batch.joined]
        tokens += [0] * (self.decode_rows(batch) - len(tokens))
        return mx.array(tokens, dtype=mx.int32)

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, batch: Batch, chunks: list[PromptSlice]) -> None:
        """Prompt chunks of several rows in one padded forward; only the KV writes are used.

        NOTE: the logits are never evaluated, so the LM head (and the last layer's MLP) never
        runs: `mx.async_eval` asks only for the KV buffers.
        """
        longest = max(c.end - c.start for c in chunks)
        width = longest if self.uniform_prefill else self.ladders.pad_width(longest)
        first = chunks[0]
        # NOTE: a lone chunk from position 0 alone is a first chunk like any (its own keys)
        lone = first.lone and self.long_chunk is not None and (len(chunks) > 1 or first.start > 0)
        if lone:  # NOTE: padded to the width, its keys end on a multiple of it (one shape each)
            width = self.long_chunk or width
        n = self.ladders.pad_rows(len(chunks))
        pad = n - len(chunks)
        plan = StepRows(
            slots=[_slot(c.req) for c in chunks] + [self.pool.scratch_slot] * pad,
            tables=[c.req.pages for c in chunks] + [[]] * pad,
            starts=[c.start for c in chunks] + [0] * pad,
            lengths=[c.end - c.start for c in chunks] + [0] * pad,
            width=width,
        )
        kv_len = (
            max(plan.starts) + width if lone else self.ladders.pad_kv(max(c.end for c in chunks))
        )
        tokens = [c.req.fill_ids[c.start : c.end] for c in chunks]
        grid = [t + [0] * (width - len(t)) for t in tokens] + [[0] * width] * pad
        for c in chunks:
            c.req.kv_len = c.end
        view = self.pool.ragged_view(plan, kv_len, by_ops=self.prefill_by_ops, causal=lone)
        keys = kv_len
        if lone and n > 1:  # NOTE: each row attends on its own: a shape per row's keys
            keys = ROW_KEYS
            for start in plan.starts:
                self._seen((1, width, start + width), batch)
        logits = self._forward(mx.array(grid, dtype=mx.int32), view, keys, batch)
        for i, c in enumerate(chunks):
            if c.req.wants_prompt_logprobs:
                batch.prompt_lps += _prompt_logprobs(logits[i], c)

    # -- decode --------------------------------------------------------------------------------
    def _decode_logits(self, batch: Batch, inputs: mx.array) -> mx.array:
        """The decode forward's logits at each row's input token (B, V), lazy. A speculating
        row's proposal runs after its input in the same row (`speculate.py`): the tokens drawn
        at its positions (`sample_ahead`) go to `batch.spec_out`."""
        n = inputs.shape[0]
        if batch.sampler is None:
            batch.sampler = self._sampler(batch, n)
        rows = batch.rows
        proposals = [p or [] for p in batch.proposals or []]
        proposals += [[]] * (len(rows) - len(proposals))
        width = 1 + max((len(p) for p in proposals), default=0)
        starts = [r.kv_len for r in rows]
        lengths = [1 + len(p) for p in proposals]
        for r, k in zip(rows, lengths, strict=True):
            r.kv_len += k
        cache, kv_len = self._decode_cache(rows, starts, n, lengths, width)
        grid = inputs[:, None]
        if width > 1:
            pad = [p + [0] * (width - 1 - len(p)) for p in proposals]
            pad += [[0] * (width - 1)] * (n - len(rows))
            grid = mx.concatenate([grid, mx.array(pad, dtype=mx.int32)], axis=1)
        logits = self._forward(grid, cache, kv_len, batch)
        if width > 1:
            ahead = batch.spec_allowed
            allowed = None if ahead is None else mx.array(_pad_masks(ahead, n * (width - 1)))
            batch.spec_out = sample_ahead(logits[:, 1:, :], batch.sampler, proposals, allowed)
        return logits[:, 0, :]

    def _sampler(self, batch: Batch, n: int) -> SamplerState:
        rows = [row_params(r) for r in batch.rows]
        allowed = None if batch.allowed is None else _pad_masks(batch.allowed, n)
        return build_state(rows + [_PAD_ROW] * (n - len(rows)), self.vocab, allowed)

    def _decode_cache(
        self, rows: list[Req], starts: list[int], n: int, lengths: list[int], width: int
    ) -> tuple[list[EntryCache], int]:
        """The decode forward's view: `lengths` real tokens of each row (1, or a speculating
        row's input and proposal), `width` query positions."""
        # NOTE: a lone row takes mlx-lm's own single-stream path (int offset, slice write, no
        # mask): cheaper than the padded batch's scatter and mask.
        if n == 1:
            r = rows[0]
            return self.pool.row_view(_slot(r), r.pages, starts[0], width), -1
        pad = n - len(rows)
        plan = StepRows(
            slots=[_slot(r) for r in rows] + [self.pool.scratch_slot] * pad,
            tables=[r.pages for r in rows] + [[]] * pad,
            starts=starts + [0] * pad,
            lengths=lengths + [0] * pad,
            width=width,
        )
        ends = max(s + k for s, k in zip(starts, lengths, strict=True))
        kv_len = self.ladders.pad_decode_kv(ends)
        if width > 1:  # NOTE: speculating rows: chunks of a prompt's kind, every position's logits
            return self.pool.ragged_view(plan, kv_len, by_ops=self.prefill_by_ops), kv_len
        view = self.pool.ragged_view(plan, kv_len, fused=self.fused_decode, split=self.split_decode)
        return view, kv_len

    def _forward(
        self, tokens: mx.array, cache: list[EntryCache], kv_len: int, batch: Batch | None = None
    ) -> mx.array:
        # NOTE: a fused decode over full-attention layers only has no key-length dimension.
        fused = tokens.shape[1] == 1 and self.fused_decode and kv_len > 0
        keys = -1 if fused and not self._windows else kv_len
        shape = (*tokens.shape, keys)
        if batch is not None:
            batch.shape = shape
        self._seen(shape, batch)
        return self.model(tokens, cache=cache)

    def _seen(self, shape: tuple[int, ...], batch: Batch | None) -> None:
        """Count a shape; first seen after the warm-up, it marks the step (`new_shape`)."""
        if shape not in self.shapes_seen:
            self.shapes_seen.add(shape)
            # NOTE: exact shapes (CPU) are new all the time and cost nothing to build.
            if self.warmed and batch is not None and not self.ladders.exact:
                batch.new_shape = True

    # -- warm-up -------------------------------------------------------------------------------
    def warm_up(
        self,
        budget_tokens: int,
        deadline_s: float,
        minimal: bool = False,
        scores_limit: int | None = None,
    ) -> tuple[int, float]:
        """Run every decode and prefill shape once, writing only scratch space.

        Prefill shapes: every (rows, width) within `budget_tokens`, at every key length a later
        chunk may read (rows x width x keys within `scores_limit`, the planner's bound; None:
        first chunks only). `minimal`: one small shape of each kind. Returns (forwards run,
        seconds). Stops at `deadline_s`; later shapes then build when first seen (and are
        logged).
        """
        t0 = time.monotonic()
        self._warm_lone_row()
        done = 1
        shapes = list(self._warm_shapes(budget_tokens, minimal, scores_limit))
        # NOTE: closed even when a shape fails: the bar leaves the terminal, its filter the log
        with Progress(log, "warm-up", len(shapes) + 1, "step shapes") as progress:
            for tokens, plan, kv_len in shapes:
                if time.monotonic() - t0 > deadline_s:
                    log.warning("warm-up stopped after %.1f s (%d shapes)", deadline_s, done)
                    break
                decode = tokens.shape[1] == 1
                lone = len(plan.slots) == 1 and prefill_attention.aligned(
                    plan.starts[0], plan.width, self.long_chunk
                )
                keys = kv_len
                if kv_len == ROW_KEYS:  # NOTE: several lone chunks (`_warm_lone_rows`)
                    lone, kv_len = True, max(plan.starts) + plan.width
                    for start in plan.starts:
                        self._seen((1, plan.width, start + plan.width), None)
                view = self.pool.ragged_view(
                    plan,
                    kv_len,
                    fused=decode and self.fused_decode,
                    by_ops=self.prefill_by_ops,
                    causal=lone,
                )
                logits = self._forward(tokens, view, keys)
                state = build_state([_PAD_ROW] * tokens.shape[0], self.vocab)
                mx.eval(sample(logits[:, -1, :], state).tokens, self.pool.state())
                done += 1
                progress.step()
        self.shapes_warmed = len(self.shapes_seen)
        self.warmed = True
        return done, time.monotonic() - t0

    def _warm_lone_row(self) -> None:
        """The lone decode row's path (mlx-lm's own: int offset, no mask), on the scratch page.

        NOTE: left out, its first use after READY took 3.9 s on a fresh H200 (kernels built on
        first use), and every request of the level waited behind it."""
        view = self.pool.row_view(self.pool.scratch_slot, [self.pool.scratch_page], 0)
        logits = self._forward(mx.zeros((1, 1), mx.int32), view, -1)
        # NOTE: with a token mask: the masked sampler's fused kernel is built here, not by the
        # first constrained request (1.4 s on this CPU the first time a machine builds it).
        everything = np.full((1, (self.vocab + 31) // 32), -1, dtype=np.int32)
        state = build_state([_PAD_ROW], self.vocab, everything)
        tokens = sample(logits[:, -1, :], state).tokens
        # NOTE: and the pick of the rows that go on after others left a chained step (a gather):
        # on a fresh H200 the step after the first row left took 3.0-3.8 s in each of three runs
        # (the host blocked launching it; no forward shape was new), as kernels built on first
        # use do.
        mx.eval(_picked(tokens, [0, 0], [0]), self.pool.state())

    def _warm_shapes(self, budget_tokens: int, minimal: bool, scores_limit: int | None):
        lad = self.ladders
        if minimal:
            yield self._warm_decode(2, lad.kv[0])
            yield self._warm_prefill(1, lad.widths[0], lad.pad_kv(lad.widths[0]))
            return
        # NOTE: a fused decode's keys are no dimension of its shape (`_keyless`): one per rows.
        keyless = self.fused_decode and not self._windows
        keys = lad.kv[:1] if keyless else lad.kv
        held = self.pool.capacity * self.pool.page_size
        if keyless and len(lad.rows) > 1:
            yield from self._warm_split_decode(lad.rows[1])
        for n in lad.rows[1:]:  # NOTE: one row decodes on mlx-lm's own path, no shape to warm
            for kv_len in keys:
                # NOTE: a batch reading more keys than the pages hold is rare (one long row
                # beside many short ones); it compiles when first seen, and is logged.
                if kv_len == keys[0] or n * kv_len <= held:
                    yield self._warm_decode(n, kv_len)
        pairs = [
            (n, width)
            for width in lad.widths
            for n in lad.rows
            if n == 1 or n * width <= budget_tokens
        ]
        for n, width in pairs:
            yield self._warm_prefill(n, width, lad.pad_kv(width))
        yield from self._warm_long_chunks(held)
        yield from self._warm_lone_rows(budget_tokens)
        # NOTE: later chunks read more keys: each (rows, width, keys) built on its first use
        # after READY (H200: 20-140 ms steps, every decoding row waiting). Shortest keys first.
        if scores_limit is None:
            return
        for kv_len in lad.kv:
            for n, width in pairs:
                longer = kv_len > lad.pad_kv(width)
                if longer and n * width * kv_len <= scores_limit and n * kv_len <= held:
                    yield self._warm_prefill(n, width, kv_len, start=kv_len - width)

    def _warm_long_chunks(self, held: int):
        """Lone causal chunks (`prefill_attention.long_chunk`): keys at every multiple of the
        width a request may reach, up to `LONG_WARM_KEYS`; longer ones build when first seen
        (H200: ~62 ms each, logged)."""
        w = self.long_chunk
        if w is None:
            return
        top = min(self.ladders.row_len, held, LONG_WARM_KEYS)
        for kv_len in range(2 * w, -(-top // w) * w + 1, w):
            plan = StepRows([self.pool.scratch_slot], [[]], [kv_len - w], [0], width=w)
            yield mx.zeros((1, w), mx.int32), plan, kv_len

    def _warm_lone_rows(self, budget_tokens: int):
        """Steps of several lone chunks (`PromptSlice.lone`), each row count the budget holds;
        each row's attention is a lone chunk's, whose keys `_warm_long_chunks` ran.

        NOTE: rows from position 0 read the width's keys, the one lone shape not run there."""
        w = self.long_chunk
        if w is None or self.lone_rows == 1:
            return
        for n in self.ladders.rows[1:]:
            if n * w <= budget_tokens:
                yield mx.zeros((n, w), mx.int32), self._pad_plan(n, w), ROW_KEYS

    def _warm_split_decode(self, n: int):
        """A fused decode over rows long enough to split (`decode_attention.split_count`).

        NOTE: the split path's kernels are others than the one-pass kernel; left out, they were
        built on the first step over 1,024 keys after READY (H200: a 3.9 s step, 16 users of a
        multi-turn run waiting)."""
        long = [k for k in self.ladders.kv if k >= decode_attention.SPLIT_MIN_KEYS]
        if long:
            yield self._warm_decode(n, long[0])

    def _warm_decode(self, n: int, kv_len: int) -> tuple[mx.array, StepRows, int]:
        # NOTE: no real token, so every write goes to the scratch page and slot, and every read
        # gathers the scratch page: nothing in use changes.
        return mx.zeros((n, 1), mx.int32), self._pad_plan(n, 1), kv_len

    def _warm_prefill(
        self, n: int, width: int, kv_len: int, start: int = 0
    ) -> tuple[mx.array, StepRows, int]:
        """A prompt chunk's shape: a first chunk (`start` 0: its own keys, `_RaggedView.fresh`)
        or a later one, reading `kv_len` keys from the pages."""
        return mx.zeros((n, width), mx.int32), self._pad_plan(n, width, start), kv_len

    def _pad_plan(self, n: int, width: int, start: int = 0) -> StepRows:
        slot = self.pool.scratch_slot
        return StepRows([slot] * n, [[]] * n, [start] * n, [0] * n, width=width)


def _pad_masks(allowed: np.ndarray, n: int) -> np.ndarray:
    """Packed masks for `n` forward rows: pad rows may take any token."""
    if n == len(allowed):
        return allowed
    pad = np.full((n - len(allowed), allowed.shape[1]), -1, dtype=np.int32)
    return np.concatenate([allowed, pad])


def _slot(req: Req) -> int:
    assert req.slot is not None, f"{req.rid}: launched without a slot"
    return req.slot


def _prompt_logprobs(logits: mx.array, c: PromptSlice) -> list[mx.array]:
    """The logprobs of the prompt tokens this chunk's positions predict, lazy, kept on the
    request: tokens [j0, j1) from positions j - 1, those no earlier chunk covered."""
    req = c.req
    j0, j1 = max(c.start + 1, req.prompt_lp_upto), min(c.end + 1, req.prompt_len)
    if j1 <= j0:
        return []
    targets = mx.array(req.input_ids[j0:j1], dtype=mx.int32)
    arrays = token_logprobs(logits[j0 - 1 - c.start : j1 - 1 - c.start], targets, _top(req))
    req.prompt_lps.append(arrays)
    req.prompt_lp_upto = j1
    return arrays


def _top(req: Req) -> int:
    return req.params.prompt_logprobs or 0


def _outputs(batch: Batch) -> list[mx.array]:
    s = batch.decode_out
    if s is None:
        return batch.prompt_lps
    out = [s.tokens, s.logprob, s.top_ids, s.top_logprobs]
    if (ahead := batch.spec_out) is not None:
        out += [ahead.tokens, ahead.logprob, ahead.top_ids, ahead.top_logprobs]
    return [a for a in out if a is not None]


def _picked(tokens: mx.array, index: list[int], host: list[int]) -> mx.array:
    """The lazy `tokens` of the rows at `index` (a gather only where some row left), then the
    `host` tokens."""
    identity = index == list(range(len(index)))
    ahead = tokens[: len(index)] if identity else tokens[mx.array(index, dtype=mx.int32)]
    return mx.concatenate([ahead, mx.array(host, dtype=mx.int32)])
