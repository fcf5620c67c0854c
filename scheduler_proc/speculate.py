"""Speculative decoding inside the decode step: proposals by prompt lookup or a draft model.

A speculating row runs its input token and its proposal (`ngram.NgramIndex`, or a draft model's:
`draft.Draft`) as one chunk of the decode step, through the path prompt chunks take: every
position's logits, each position's KV written. Each position's token is drawn as plain decoding
would draw it there (greedy: the argmax; sampled: the row's filters and its own noise counter;
`sampling.sample_ahead`). The row keeps the longest prefix of the proposal that its own tokens
reproduce, plus the token after it, so its output is the one it would have decoded token by token,
seeded or not (for a proposal of single tokens this is speculative sampling's rejection rule); the
KV of what it rejected is rolled back (its `kv_len` set back, whole pages past it returned).

Position j's draw counts the proposal's tokens up to it for the row's penalties, and its logprobs
are reported for every token kept; a constrained row proposes only what its grammar takes, and each
position is drawn under its own mask (the matcher advanced through the proposal,
`Grammars.fill_ahead`). A token a thinking budget forces replaces the drawn one, as without
speculation. A model with recurrent state or window rings does not speculate: their writes cannot be
taken back by setting a length. A row's k adapts: up after a proposal accepted whole, down to what
was accepted after a partial one, and off for a while after steps that did not pay: a step pays
when it emits more tokens than a speculating step costs in plain steps (`spec_pace.Pace`,
measured as the engine runs: 1.75 plain steps on a CPU, ~8 on a GPU, where it loses the chain).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine.config import EngineConfig
from scheduler_proc.batch import Batch
from scheduler_proc.draft import Draft
from scheduler_proc.kv_layout import Layout
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.ngram import NgramIndex
from scheduler_proc.request import Req
from scheduler_proc.spec_pace import Pace

log = logging.getLogger(__name__)

# NOTE: steps in a row that did not pay (no proposal, or too little of it accepted) before a row
# stops speculating; while it speculates it breaks the overlap loop's chain (its next input
# depends on what is accepted), which costs a chained step's overlap on CUDA.
MISSES_OFF = 3
# NOTE: tokens a row decodes plainly before trying again; doubled each time it goes off again,
# up to `OFF_MAX`, and back to this once a proposal is accepted.
OFF_TOKENS = 16
OFF_MAX = 512


@dataclass
class RowSpec:
    """One request's speculation state (`Req.spec`)."""

    index: NgramIndex | None  # prompt lookup's (None: a draft model proposes)
    k: int
    misses: int = 0
    off: int = OFF_TOKENS  # the next off period, in tokens
    resume_at: int = 0  # output length at which an off row speculates again
    history: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted), tests


class Speculator:
    def __init__(self, config: EngineConfig, layout: Layout, draft: Draft | None = None) -> None:
        """`draft`: the draft model of `--spec draft` (None: prompt lookup)."""
        self.k_max, self.ngram = config.spec_k, config.spec_ngram
        self.max_rows = config.spec_max_rows
        auto = config.spec == "auto"
        # NOTE: `auto` is prompt lookup on one device: with --tp each rank's own pay rule
        # (its step times) would pick different rows, and the next collective would hang
        self.on = config.spec != "off" and not (auto and config.tp > 1)
        self.draft = draft
        self.proposed = self.accepted = self.steps = 0
        self.pace = Pace()
        if self.on and (layout.states or any(s.window is not None for s in layout.kv)):
            (log.info if auto else log.warning)(
                "speculative decoding off: the model's recurrent state or window rings cannot "
                "be rolled back (only full-attention KV can)"
            )
            self.on = False
        elif self.on and draft is not None:
            log.info("speculative decoding: a draft model (k <= %d)", self.k_max)
        elif self.on:
            log.info(
                "speculative decoding: ngram (n <= %d, k <= %d, --spec %s)",
                self.ngram,
                self.k_max,
                config.spec,
            )

    def active(self, req: Req) -> bool:
        """Whether `req` would speculate at its next fresh step (so its chain breaks). Any row
        may: each of its tokens is drawn from its logits, its tokens before it, its constraint
        and its noise counter, which drawing each proposal position as plain decoding would
        keeps exact; a token its thinking budget forces replaces the drawn one as it would
        (`Scheduler._accept`), and the proposal is kept only while it equals what was emitted."""
        if not self.on:
            return False
        row = req.spec
        return row is None or len(req.output_ids) >= row.resume_at

    def breaks_chain(self, rows: list[Req]) -> bool:
        """Whether a step of `rows` is followed by a fresh step, for a row that speculates."""
        return self.batch_speculates(rows) and any(self.active(r) for r in rows)

    def batch_speculates(self, rows: list[Req]) -> bool:
        """Whether a step of `rows` may speculate at all: not with more than `max_rows` rows.

        NOTE: at 128 agents on a GPU every eligible row speculating cost 4x the step time
        (no chained step, ITL 40 ms vs 9 ms: docs/scheduler.md); a large batch is compute-bound
        and keeps its chain. Nor while plain steps are measured (`Pace.probing`)."""
        return self.on and len(rows) <= self.max_rows and not self.pace.probing

    def stepped(self, batch: Batch, interval: float | None) -> None:
        """A decode step's tokens arrived, `interval` seconds after the previous decode step's
        (`StepTimes.add`): the pace of speculating and plain steps of as many rows as may
        speculate, from steps that carried nothing but decoding."""
        if not self.on or len(batch.rows) > self.max_rows:
            return
        pure = not batch.joined and batch.beside is None
        self.pace.stepped(interval if pure else None, batch.proposals is not None, batch.chained)

    def plan(self, rows: list[Req], kv: KVManager) -> list[list[int] | None] | None:
        """Each decode row's proposal ([]: it speculates but found none; None: it does not
        speculate), its pages taken (free pages only: nothing is evicted or preempted for a
        proposal, which is cut to what fits); None: no row speculates."""
        if not self.batch_speculates(rows):
            return None
        active = [self.active(r) for r in rows]
        if not any(active):
            return None
        if self.draft is None:
            return [
                self._looked_up(r, kv) if a else None for r, a in zip(rows, active, strict=True)
            ]
        found = self._drafted([r for r, a in zip(rows, active, strict=True) if a], kv)
        return [found.get(r.rid, []) if a else None for r, a in zip(rows, active, strict=True)]

    def _row(self, req: Req) -> RowSpec:
        if req.spec is None:
            index = NgramIndex(self.ngram) if self.draft is None else None
            req.spec = RowSpec(index, self.k_max)
        return req.spec

    def _k(self, req: Req) -> int:
        """The most the row proposes now: its k, within its length limit (the step emits at
        most proposal + 1 tokens)."""
        return max(min(self._row(req).k, req.max_new - len(req.output_ids) - 1), 0)

    @staticmethod
    def _fit(req: Req, kv: KVManager, n: int) -> int:
        """Pages for the row's input and `n` proposed tokens, free ones only; how many of the
        `n` fit."""
        if n and not kv.grow(req, ahead=1 + n, evict=False):
            return max(min(n, len(req.pages) * kv.pool.page_size - req.kv_len - 1), 0)
        return n

    @staticmethod
    def _valid(req: Req, proposal: list[int]) -> list[int]:
        """What its grammar takes of the proposal (masks come per position)."""
        if req.matcher is None:
            return proposal
        return proposal[: req.matcher.validate_tokens(proposal)]

    def _looked_up(self, req: Req, kv: KVManager) -> list[int]:
        index = self._row(req).index
        assert index is not None
        index.extend(req.input_ids, req.output_ids)
        proposal = self._valid(req, index.propose(self._k(req)))
        return proposal[: self._fit(req, kv, len(proposal))]

    def _drafted(self, reqs: list[Req], kv: KVManager) -> dict[str, list[int]]:
        """The draft model's proposals for `reqs`, every row in each of its forwards; the pages
        are taken first (the draft writes its KV where the row's goes)."""
        assert self.draft is not None
        ks = [self._fit(r, kv, self._k(r)) for r in reqs]
        drafting = [(r, k) for r, k in zip(reqs, ks, strict=True) if k > 0]
        if not drafting:
            return {}
        proposals = self.draft.propose([r for r, _ in drafting], [k for _, k in drafting])
        return {r.rid: self._valid(r, p) for (r, _), p in zip(drafting, proposals, strict=True)}

    def verified(self, req: Req, proposal: list[int], accepted: int, share: float = 1.0) -> None:
        """Adapt the row's k to a step that proposed `proposal` and accepted `accepted` of it;
        `share`: the step's rows per row that proposed (each such row pays that many rows'
        part of what the speculating step cost beyond a plain one).

        NOTE: a speculating step of n rows costs break_even plain steps, n * (break_even - 1)
        tokens of plain decoding lost, so its proposing rows must gain that between them. Judged
        by its own tokens alone (1 + accepted > break_even), one row of four accepting 13 % of
        its proposals kept speculating and cost the batch: the default model's chat answers ran
        0.95x at c4 (docs/benchmarks.md, session 55)."""
        row = req.spec
        if row is None:
            return
        if proposal:
            self.steps += 1
            self.proposed += len(proposal)
            self.accepted += accepted
            row.history.append((len(proposal), accepted))
        if accepted:
            full = accepted == len(proposal)
            row.k = min(self.k_max, row.k + 1 if full else max(accepted, 1))
        if accepted > (self.pace.break_even() - 1) * share:
            row.misses, row.off = 0, OFF_TOKENS
            return
        row.misses += 1
        if row.misses >= MISSES_OFF:
            row.misses = 0
            row.resume_at = len(req.output_ids) + row.off
            row.off = min(row.off * 2, OFF_MAX)

    def stats(self) -> dict[str, int | float]:
        proposer = "draft" if self.draft is not None else "ngram"
        return {
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            # NOTE: by proposer, for /metrics' `proposer` label (one proposer per engine)
            f"spec_proposed_tokens_{proposer}": self.proposed,
            f"spec_accepted_tokens_{proposer}": self.accepted,
            "spec_rows_verified": self.steps,  # NOTE: row-steps that verified a proposal
            # NOTE: tokens the draft model computed to catch rows up to what they hold
            "spec_draft_caught_up_tokens": 0 if self.draft is None else self.draft.caught_up,
            # NOTE: wall ms of a speculating and of a chained plain step (0: not measured yet)
            "spec_step_ms": round((self.pace.spec_s or 0.0) * 1e3, 2),
            "spec_plain_step_ms": round((self.pace.plain_s or 0.0) * 1e3, 2),
        }
