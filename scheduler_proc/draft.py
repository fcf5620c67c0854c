"""A draft model's proposals for speculating rows (`--spec draft --draft-model DIR`).

The draft is a smaller model with the target's tokenizer. Its KV lives in a pool of its own with
the target pool's pages and page size, indexed by the rows' own page tables, so it needs no page
bookkeeping: a row's draft KV sits in the pages its target KV does, and a page's draft values
are those of the tokens its target values are (a shared prefix page holds the same tokens for
every row that shares it). It is written lazily: a row's draft KV is valid up to
`DraftRow.upto`, and a proposing step first computes what the target accepted since (its whole
context the first time, in chunks). Then `k` forwards of one token each, every speculating row
in each: the row's input token, then the draft's own greedy tokens; those are the proposal.

A greedy proposal is a single token per position, so verification (`sampling.sample_ahead`)
keeps the target's output exactly what it would be without speculation, sampled rows included.
A proposal's draft KV past what the target kept is left behind like the target's: the next
catch-up overwrites it before any query reads it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.errors import ModelError
from scheduler_proc import decode_attention
from scheduler_proc.kv_cache import KVPool, StepRows
from scheduler_proc.kv_layout import Layout, bytes_per_token, probe_model
from scheduler_proc.request import Req

log = logging.getLogger(__name__)

# NOTE: tokens a row catches up per draft forward; a row speculating for the first time
# computes its whole context, so the forward's attention is bounded by this many queries.
CATCH_UP = 256
# NOTE: a row at most this many tokens behind catches up inside its first proposing forward
FOLD = 8


@dataclass
class DraftRow:
    """Where a row's draft KV is valid: positions `[0, upto)`, while the row kept its pages
    (`preemptions` unchanged: a preempted row recomputes into new ones)."""

    upto: int = 0
    preemptions: int = 0


def draft_layout(model: Any, vocab: int) -> Layout:
    """The draft's cache layout; `ModelError` when it cannot draft for a model of `vocab`
    tokens (its vocabulary is smaller, or it holds windows or recurrent state, which a
    proposal's tokens could not be taken back from)."""
    layout, draft_vocab = probe_model(model)
    if draft_vocab < vocab:
        raise ModelError(f"the draft model has {draft_vocab} tokens, the model {vocab}")
    if layout.states or any(s.window is not None for s in layout.kv):
        raise ModelError("a draft model with window rings or recurrent state cannot draft")
    return layout


class Draft:
    def __init__(
        self, model: Any, layout: Layout, target: KVPool, vocab: int, by_ops: bool, split: bool
    ) -> None:
        """`by_ops`: catch-up chunks attend by MLX's ops, as the target's prompt chunks do;
        `split`: one-token forwards attend in groups of rows by length, as the target's decode
        does off CUDA (a long row beside short ones would have every row read its keys)."""
        self.model, self.vocab, self.target, self.by_ops = model, vocab, target, by_ops
        self.split = split and bool(decode_attention.install(model))
        self.pool = KVPool(
            layout,
            target.pages,
            target.page_size,
            target.slots,
            target.context,
            CATCH_UP,
            capacity=target.capacity,
        )
        self.caught_up = 0  # NOTE: tokens computed to catch rows up, since start (stats)

    @staticmethod
    def token_bytes(layout: Layout) -> int:
        return bytes_per_token(list(layout.kv))

    def propose(self, rows: list[Req], ks: list[int]) -> list[list[int]]:
        """Each row's next `ks[i]` tokens as the draft writes them greedily after its input
        (its last token), computed for every row together; a row's pages must already hold
        positions up to `kv_len + ks[i]`."""
        self._follow_pool()
        behind = [r.kv_len - _row(r).upto for r in rows]
        if max(behind) > FOLD:
            self._catch_up(rows)
            behind = [0] * len(rows)
        # NOTE: the first forward also computes what each row is behind by (the target kept
        # every proposed token last step: one), so the catch-up costs no forward of its own
        # nor a wait for it
        width = max(behind) + 1
        starts = [r.kv_len - m for r, m in zip(rows, behind, strict=True)]
        grid = [_span(r, s, r.kv_len + 1) for r, s in zip(rows, starts, strict=True)]
        tokens = mx.array([g + [0] * (width - len(g)) for g in grid], dtype=mx.int32)
        logits = self._forward(tokens, rows, starts, [m + 1 for m in behind])
        last = logits[mx.arange(len(rows)), mx.array(behind), : self.vocab]
        tokens = mx.argmax(last, axis=-1).astype(mx.int32)[:, None]
        self.caught_up += sum(behind)
        drafted: list[mx.array] = [tokens]
        for i in range(1, max(ks)):
            lengths = [int(i < n) for n in ks]
            logits = self._forward(tokens, rows, [r.kv_len + i for r in rows], lengths)
            tokens = mx.argmax(logits[:, -1, : self.vocab], axis=-1).astype(mx.int32)[:, None]
            drafted.append(tokens)
        out: list[list[int]] = mx.concatenate(drafted, axis=1).tolist()  # type: ignore[assignment]
        for r, n in zip(rows, ks, strict=True):
            _row(r).upto = r.kv_len + n  # NOTE: its input and its first n - 1 drafted tokens
        return [p[:n] for p, n in zip(out, ks, strict=True)]

    def _follow_pool(self) -> None:
        """The draft pool holds the target pool's pages (it grew or shrank since)."""
        if self.pool.pages < self.target.pages:
            self.pool.grow(self.target.pages)
        elif self.pool.pages > self.target.pages:
            self.pool.shrink(self.target.pages)

    def _catch_up(self, rows: list[Req]) -> None:
        """Draft KV for what each row's target KV holds and its draft's does not yet."""
        while True:
            todo = [(r, _row(r).upto) for r in rows]
            todo = [(r, s) for r, s in todo if s < r.kv_len]
            if not todo:
                return
            lengths = [min(r.kv_len - s, CATCH_UP) for r, s in todo]
            width = max(lengths)
            grid = [
                _span(r, s, s + n) + [0] * (width - n)
                for (r, s), n in zip(todo, lengths, strict=True)
            ]
            todo_rows = [r for r, _ in todo]
            self._forward(mx.array(grid, dtype=mx.int32), todo_rows, [s for _, s in todo], lengths)
            # NOTE: the KV alone: the logits (the vocabulary's head, for every position) are
            # never computed
            mx.eval(self.pool.kv_arrays())
            for (r, s), n in zip(todo, lengths, strict=True):
                _row(r).upto = s + n
            self.caught_up += sum(lengths)

    def _forward(
        self, tokens: mx.array, rows: list[Req], starts: list[int], lengths: list[int]
    ) -> mx.array:
        width = tokens.shape[1]
        plan = StepRows(
            slots=[r.slot if r.slot is not None else self.pool.scratch_slot for r in rows],
            tables=[r.pages for r in rows],
            starts=starts,
            lengths=lengths,
            width=width,
        )
        ends = max(s + width for s in starts)
        kv_len = self.pool.pages_for(ends) * self.pool.page_size
        view = self.pool.ragged_view(plan, kv_len, by_ops=self.by_ops, split=self.split)
        return self.model(tokens, cache=view)


def _span(req: Req, start: int, end: int) -> list[int]:
    """The row's tokens at positions `[start, end)` (prompt, then output), without joining
    the whole context."""
    n = len(req.input_ids)
    if start >= n:
        return req.output_ids[start - n : end - n]
    return req.input_ids[start:end] + req.output_ids[: max(0, end - n)]


def _row(req: Req) -> DraftRow:
    """The row's draft state, reset when it was preempted (its pages are new)."""
    row = req.draft
    if row is None or row.preemptions != req.preemptions:
        row = req.draft = DraftRow(0, req.preemptions)
    row.upto = min(row.upto, req.kv_len)
    return row
