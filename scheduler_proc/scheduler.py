"""The scheduler core: continuous batching, chunked prefill and the overlap loop, in-process.

`step()` is one loop iteration. With overlap on (docs/scheduler.md), a pure decode step's successor is
built on its still-lazy tokens and queued before the loop blocks on it; the chain breaks on a
prefill to run (unless prompts ride the chain), a request to seat, or shutdown. Rows (KV) move
while nothing is in flight, or, for models whose rows are their pages alone, in flight too
(`_move_in_flight`): finished rows leave the chain and new ones join it.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine import child, constraints, heap
from engine.config import EngineConfig
from engine.errors import InvalidRequest, Overloaded, ShuttingDown
from engine.memory import weights_bytes
from engine.messages.to_client import Chunk, FinishReason, TokenLogprob
from engine.prompt_check import check_prompt
from engine.sampling_params import SamplingParams
from scheduler_proc import backend, decode_attention, memory_limits
from scheduler_proc.batch import Batch, PromptSlice
from scheduler_proc.disk_cache import DiskCache
from scheduler_proc.disk_tier import block_format
from scheduler_proc.draft import Draft, draft_layout
from scheduler_proc.grammar import Grammars
from scheduler_proc.kv_budget import KVPlan, plan_kv
from scheduler_proc.kv_cache import KVPool
from scheduler_proc.kv_layout import Layout, bytes_per_token, probe_model, ring_size
from scheduler_proc.kv_manager import KVManager
from scheduler_proc.kv_quant import KVQuant
from scheduler_proc.model_identity import fingerprint
from scheduler_proc.prefill_plan import PrefillPlanner, body_left, due
from scheduler_proc.request import Req, State
from scheduler_proc.runner import Runner
from scheduler_proc.running import RunningTable
from scheduler_proc.sampling import Sampled, advance, has_penalty
from scheduler_proc.seating import Seating
from scheduler_proc.shapes import Ladders
from scheduler_proc.speculate import Speculator
from scheduler_proc.step_times import StepTimes
from scheduler_proc.waiting import WaitingQueue

log = logging.getLogger(__name__)

# NOTE: a first-seen shape costs ~50-100 ms on a GPU; beyond this the rest compile when first seen.
WARM_UP_DEADLINE_S = 120.0
# NOTE: the disk tier's unit (rounded up to whole pages): a file of 64 tokens is 1.4 MiB of the
# default model's KV, 2 MiB of a Llama-3.2-1B's. A prompt's last partial block is recomputed:
# with 256-token blocks a restart's first token over a 2,000-word system prompt took 0.21x a
# cold start's on the CPU (~250 tokens computed again), with 64 0.07x (scripts/bench_restart.py).
DISK_BLOCK_TOKENS = 64

COUNTERS = (
    "steps_launched",  # fresh + chained, counted by prepare_launch only
    "steps_fresh",
    "steps_chained",
    "batches_finalized",
    "prefill_tokens",
    "generated_tokens",
    "steps_prefill",  # steps whose one forward ran prompt chunks
    "steps_decode",  # steps whose one forward decoded rows (and prompts' last tokens)
    "requests_finished",
    "requests_aborted",
)
# NOTE: why a decode step did not chain (the device waits for the host at each): `_can_chain`
BREAKS = ("seat", "finish", "forced", "spec", "prefill", "pages")


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        eos_token_ids: Iterable[int],
        kv_agree: Callable[[KVPlan], KVPlan] | None = None,
        tokenizer_file: Path | None = None,
        draft: nn.Module | None = None,
    ):
        """`kv_agree`: tensor parallel, the plan every rank can hold (docs/distributed.md);
        `tokenizer_file`: the model's tokenizer.json, for structured output (grammar.py);
        `draft`: `--spec draft`'s model, with the same tokenizer (draft.py)."""
        self.config = config
        layout, self.vocab = probe_model(model)
        max_pos = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        full = [s for s in layout.kv if s.window is None]
        weights = weights_bytes(model)
        # NOTE: the draft's KV sits in its own pool with the same pages: a token costs both
        drafts = None if draft is None else draft_layout(draft, self.vocab)
        draft_bytes = 0 if drafts is None else Draft.token_bytes(drafts)
        weights += 0 if draft is None else weights_bytes(draft)
        dims = [(s.k_dim, s.v_dim) for s in full]
        quant = kv_quant(config, dims)
        self.defaults = backend.step_defaults(config, backend.current(), dims)
        self.chunk_size, self.prefill_budget = self.defaults.chunk, self.defaults.budget
        self.kv_plan = plan_kv(
            config,
            (bytes_per_token(full, quant) or 1) + draft_bytes,
            max_pos,
            weights,
            slot_bytes=_slot_bytes(layout, self.chunk_size, config.context_length or max_pos)
            # NOTE: with the prefix cache, one snapshot per slot is budgeted beside it.
            * (1 if config.disable_radix_cache else 2),
            # NOTE: a CUDA device's memory is the engine's; elsewhere the KV shares it.
            grow=not mx.cuda.is_available(),
        )
        if kv_agree is not None:
            self.kv_plan = kv_agree(self.kv_plan)
        log.info(self.kv_plan.describe())
        if quant is not None:
            plain = bytes_per_token(full)
            log.info(
                "KV pages quantized to %s (--kv-bits): %d bytes a token instead of %d, %.2fx "
                "the tokens in the same memory",
                quant.describe(),
                bytes_per_token(full, quant),
                plain,
                plain / bytes_per_token(full, quant),
            )
        plan = self.kv_plan
        self.pool = KVPool(
            layout,
            plan.start_pages,
            plan.page_size,
            plan.slots,
            plan.context,
            self.chunk_size,
            capacity=plan.pages,
            quant=quant,
        )
        self.running = RunningTable(plan.slots)
        exact = self.defaults.exact_shapes
        self.ladders = Ladders.for_pool(plan.slots, plan.context, self.chunk_size, exact=exact)
        self.runner = Runner(
            model,
            self.pool,
            self.vocab,
            self.ladders,
            config.fused_decode,
            config.prefill_attention,
            config.long_prefill_chunk,
        )
        prefix = not config.disable_radix_cache
        align = self.runner.long_chunk if self.runner.lone_rows > 1 else None
        self.kv = KVManager(self.pool, prefix, snapshots=plan.slots, align=align)
        self.prefix = self.kv.prefix  # NOTE: None when the cache is off
        if config.kv_cache_dir:
            self._attach_disk(config, model)
        heads = int(getattr(getattr(model, "args", None), "num_attention_heads", 0) or 32)
        self.planner = PrefillPlanner(
            self.chunk_size,
            self.prefill_budget,
            heads,
            uniform=self.runner.uniform_prefill,
            beside_decode=self.defaults.beside_decode,
            long_chunk=self.runner.long_chunk,
            lone_rows=self.runner.lone_rows,
            scores_held=self.defaults.scores_held,
        )
        self.eos = frozenset(eos_token_ids)
        self.draft = None
        if drafts is not None:
            by_ops, split = self.runner.prefill_by_ops, not self.runner.fused_decode
            self.draft = Draft(draft, drafts, self.pool, self.vocab, by_ops, split)
        self.spec = Speculator(config, layout, self.draft)  # NOTE: `--spec`; off by default
        self.grammars = Grammars(tokenizer_file, self.vocab, sorted(self.eos))
        self.overlap = not config.disable_overlap
        # NOTE: rows move while a decode step is in flight (`_move_in_flight`) only where a row
        # is its pages alone: no window ring or recurrent state lives in its slot.
        self.moves_in_flight = (
            self.overlap and not layout.states and all(s.window is None for s in layout.kv)
        )
        # NOTE: an operator's pause (scheduler_proc/admin.py): waiting requests stay queued while
        # not seating; running requests keep their rows and take no step while not stepping.
        self.seating = True
        self.stepping = True
        self.on_launch: Callable[[Batch], None] | None = None  # profiler / test hook
        # NOTE: False under tensor parallel: a failed step (a lost peer) must stop the engine.
        self.contain_errors = True
        self._rng = random.Random(config.seed)
        self._waiting = WaitingQueue()
        self._reqs: dict[str, Req] = {}
        self._touched: dict[str, Req] = {}
        self.seats = Seating(self._waiting, self.running, self.kv)
        self._to_free: dict[str, Req] = {}
        self._to_promote: list[Req] = []
        self._to_publish: list[Req] = []  # prompt bodies written by the last prefill step
        self._to_snapshot: list[Req] = []  # requests at their `snap_at` after the last step
        self._current: Batch | None = None
        self._next: Batch | None = None
        self._closed = False
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._breaks = dict.fromkeys(BREAKS, 0)
        self._prefill_last = False  # the last fresh step was a prefill step
        self._lone_next = False  # the last prefill step ran chunks other than lone ones
        self._seat_blocked = False  # a request waits that only a break can seat
        self.step_times = StepTimes()
        self._trim = heap.malloc_trim()
        mx.reset_peak_memory()  # NOTE: the warm-up's peak sizes MLX's cache (memory_limits.py)
        held = mx.get_active_memory()
        # NOTE: replicated ranks (kv_agree) warm up without a time limit: ranks stopping at
        # different shapes would run different collectives; their start-up watchdog bounds it.
        self.warm_up_s = self._warm_up(WARM_UP_DEADLINE_S if kv_agree is None else math.inf)
        peak = mx.get_peak_memory() - held
        self.limits = memory_limits.apply(plan, weights, peak)

    def _attach_disk(self, config: EngineConfig, model: nn.Module) -> None:
        """`--kv-cache-dir`: the prefix cache's disk tier (blocks of pages; with window rings
        or recurrent state, the slots' snapshots beside them)."""
        block = -(-DISK_BLOCK_TOKENS // self.pool.page_size) * self.pool.page_size
        fmt = block_format(self.pool, block)
        if not fmt.arrays:
            log.warning("--kv-cache-dir: off for this model: it has no full-attention layer")
            return
        capacity = int(config.kv_cache_disk_gb * 2**30)
        folder = Path(config.kv_cache_dir or "").expanduser()
        cache = DiskCache(folder, capacity, fmt, fingerprint(model))
        self.kv.attach_disk(cache)

    def model_changed(self) -> None:
        """The weights or adapter changed (admin.py, no step in flight): blocks queued for the
        disk are the old model's, and keys follow the new one's identity."""
        disk = self.kv.disk
        if disk is not None:
            disk.drop_queued()
            disk.cache.set_identity(fingerprint(self.runner.model))

    # -- public interface --------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        checked: bool = False,
        client: str = "",
        shared: int = 0,
    ) -> None:
        """Queue a request of `client` (the unit of fair scheduling, scheduler_proc/waiting.py).
        `checked`: the front door already ran the prompt and parameter rules against this
        scheduler's limits (tokenizer_proc/prepare.py), so they run once. `shared`: tokens of
        the prompt other conversations share (`TokenizedRequest.shared`)."""
        if self._closed:
            raise ShuttingDown("the scheduler is shutting down")
        if rid in self._reqs:
            raise InvalidRequest("rid", f"request id {rid!r} is already in use")
        if not checked:
            params.validate(self.vocab)
            check_prompt(input_ids, self.vocab, self.max_context, "input_ids")
        # NOTE: beyond the running batch: a burst that arrives between two steps waits for rows
        # that are free (the front door admits running rows + queued, and so does this).
        if len(self._waiting) >= self.config.max_queued_requests + self.running.free_slots:
            raise Overloaded(f"{len(self._waiting)} requests already waiting")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        max_new = min(params.max_tokens, self.max_context - len(input_ids))
        req = Req(rid, list(input_ids), params, seed, max_new, frozenset(stop), client)
        req.shared = max(0, min(shared, len(input_ids)))
        req.thinking = params.think_inside
        if params.constrained:
            if not checked:
                constraints.check(params)
            req.building = self.grammars.start(params)
            if not self.contain_errors:
                # NOTE: tensor parallel: every rank must admit it at the same step
                futures.wait([req.building])
        self._reqs[rid] = req
        self._waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self._reqs.get(rid)
        if req is not None and not req.finished:
            self._end(req, "abort")

    def step(self) -> list[Chunk]:
        if not self._closed and self.stepping:
            try:
                self._step_overlap() if self.overlap else self._step_sync()
            except Exception as exc:  # NOTE: one bad step fails its requests, not the engine
                if not self.contain_errors:
                    raise
                log.exception("step failed")
                self._fail_in_flight(exc)
            self._wait_for_grammars()
        return self._emit()

    def _wait_for_grammars(self) -> None:
        """Nothing runs but requests wait for their matchers: wait a little, not spin."""
        if self._current or self._next or self.running.reqs:
            return
        building = [r.building for r in self._waiting if r.building is not None]
        building += [r.disk.future for r in self._waiting if r.disk is not None]
        if building:
            futures.wait(building, timeout=0.005, return_when=futures.FIRST_COMPLETED)

    def has_work(self) -> bool:
        if not self.stepping:
            return bool(self._touched)
        busy = self._current or self._next or self.running.reqs
        flushing = self.kv.disk is not None and self.kv.disk.pending()
        return bool(busy or (self._waiting and self.seating) or self._touched or flushing)

    def quiesce(self) -> None:
        """Finish the step in flight (its tokens go out with the next `step()`), so that rows
        may move and the model may change; nothing is launched."""
        try:
            for batch in (self._current, self._next):
                if batch is not None:
                    self._finalize(batch)
            self._current = self._next = None
            self._settle()
        except Exception as exc:
            if not self.contain_errors:
                raise
            log.exception("step failed")
            self._fail_in_flight(exc)

    def retract_running(self) -> int:
        """Every running request gives its row and pages back and waits at the front of the
        queue, in admission order, to be recomputed (its stream intact); after `quiesce()`."""
        assert self._current is None and self._next is None, "a step is in flight"
        return self.seats.retract()

    def abort_all(self) -> list[str]:
        """End every request in flight, running or waiting (finish_reason "abort")."""
        live = [r for r in self._reqs.values() if not r.finished]
        for req in live:
            self._end(req, "abort")
        return [r.rid for r in live]

    def running_requests(self) -> int:
        """Requests holding a row, or with outputs not yet reported."""
        return len(self.running.reqs) + len(self._touched)

    def unreported(self) -> bool:
        """Whether some output waits for the next `step()` to report it."""
        return bool(self._touched)

    def went_idle(self) -> None:
        """Nothing left to run: the KV pool shrinks back to what its pages in use need
        (`KVManager.shrink`), MLX's cache of freed buffers goes back to the system (a load's
        batches left the scheduler ~70 MiB larger on the CPU, held for good), and so does what
        the C heap keeps of freed memory."""
        if self._current is None and self._next is None:
            released = self.kv.shrink()
            if released:
                log.info("idle: KV pool shrank by %d pages to %d", released, self.pool.pages)
        mx.clear_cache()
        if self._trim is not None:
            self._trim()

    def in_flight(self) -> dict[str, int]:
        """rid -> prompt tokens of every request whose terminal output is not yet reported."""
        return {rid: req.prompt_len for rid, req in self._reqs.items()}

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + generated) of one request."""
        return self.kv_plan.context

    def state_stats(self) -> dict[str, int]:
        """The stats that are pure state (counts, no times), read cheaply: a tensor-parallel rank
        fingerprints them every iteration (`stats()` also walks every frozen object for
        `gc_frozen_objects`: 16-24 ms a call on a rank's core, measured)."""
        prefix = self.kv.prefix
        return {
            **self._counters,
            "requests_preempted": self.seats.preempted,
            "running": len(self.running.reqs),
            "waiting": len(self._waiting),
            "kv_tokens_in_use": self.running.tokens_in_use(),
            "prefix_cache_hit_tokens": prefix.hit_tokens if prefix is not None else 0,
        }

    def stats(self) -> dict[str, int | float]:
        running = self.running.reqs
        used = self.running.tokens_in_use()
        held = len({p for r in running for p in r.pages}) * self.pool.page_size
        return {
            **self._counters,
            **{f"chain_breaks_{k}": v for k, v in self._breaks.items()},
            # NOTE: gave their pages back mid-decode; recomputed when pages free up
            "requests_preempted": self.seats.preempted,
            "running": len(running),
            "decoding": self.running.n_decode,
            "waiting": len(self._waiting),
            "kv_slots_in_use": len(running),
            "kv_slots_total": self.running.slots,
            "kv_context": self.max_context,
            "kv_tokens_in_use": used,
            "kv_tokens_free": self.kv_plan.tokens - used,
            "kv_request_tokens_allocated": held,
            "kv_bytes": self.pool.nbytes,
            **self.kv.stats(),
            "shapes_seen": len(self.runner.shapes_seen),
            "shapes_warmed": self.runner.shapes_warmed,
            "warm_up_s": round(self.warm_up_s, 3),
            "chunked_prefill_size": self.chunk_size,
            "max_prefill_tokens": self.prefill_budget,
            "long_prefill_scores": self.planner.beside_decode or 0,
            "long_prefill_chunk": self.planner.long_chunk or 0,
            **self.step_times.stats(),
            "decode_attention_fused_calls": decode_attention.counts.calls,
            "decode_attention_masked_calls": decode_attention.counts.masked,
            "prefill_attention_ops_calls": decode_attention.counts.prefill_ops,
            "prefill_attention_causal_calls": decode_attention.counts.prefill_causal,
            "decode_attention_split_calls": decode_attention.counts.split,
            "decode_attention_grouped_calls": decode_attention.counts.grouped,
            "gc_frozen_objects": child.frozen_objects,  # NOTE: start-up's, out of the collector's way
            "grammar_masked_rows": self.grammars.masks,
            "grammar_mask_s": round(self.grammars.mask_s, 4),
            **self.spec.stats(),
        }

    def shutdown(self) -> None:
        """Drop in-flight work, abort every request (a later `step()` reports them), drain."""
        self._closed = True
        self.grammars.close()
        mx.synchronize()
        self._current = self._next = None
        for rid in list(self._reqs):
            self.abort(rid)
        self._settle()
        mx.synchronize()
        if self.kv.disk is not None:
            self.kv.disk.cache.close()  # NOTE: what was handed to the writer is written
        self.limits.restore()

    def last_outputs(self) -> list[Chunk]:
        """Shut down and report every request's end: the aborts the last step reports, then a
        synthesized abort for whatever it could not report (so no client waits forever)."""
        self.shutdown()
        outputs = self.step()
        lost = self.in_flight().items()
        return outputs + [Chunk(rid, finish_reason="abort", prompt_tokens=n) for rid, n in lost]

    def _warm_up(self, deadline_s: float) -> float:
        """Run the step shapes once before serving; returns the seconds taken.

        NOTE: on CUDA every bucketed shape (each compiles); where shapes are exact (Metal, the
        CPU) "auto" runs one small forward of each kind, which builds the model's `mx.compile`d
        functions and kernels (the CPU backend builds them with the C++ compiler on first use:
        ~2 s the first users paid).
        """
        mode = self.config.warmup
        if mode == "off":
            return 0.0
        minimal = mode == "auto" and self.ladders.exact
        budget = self.prefill_budget
        limit = self.planner.scores_limit
        n, seconds = self.runner.warm_up(budget, deadline_s, minimal=minimal, scores_limit=limit)
        log.info("warm-up: %d step shapes in %.1f s", n, seconds)
        return seconds

    # -- the two loops -----------------------------------------------------------------------
    def _step_sync(self) -> None:
        self._settle()
        batch = self._schedule()
        if batch is not None:
            self._current = batch  # NOTE: in flight until finalized, so a failure is its own
            self._launch_fresh(batch)
            self._finalize(batch)
            self._current = None
            self._settle()

    def _step_overlap(self) -> None:
        cur = self._current
        if cur is not None and self._chains_from(cur) and self.moves_in_flight:
            self._move_in_flight()
        if cur is not None and self._can_chain(cur):
            self._next = self._launch_chained(cur)
        if cur is not None:
            self._finalize(cur)
            self._current = None
        nxt = self._next
        if nxt is not None and nxt.logits is not None:
            self._sample_deferred(nxt)
        if nxt is not None and not self._must_break(nxt):
            self._current, self._next = nxt, None
            return
        if nxt is not None:
            self._finalize(nxt)
            self._next = None
        self._settle()
        batch = self._schedule()
        if batch is not None:
            self._current = batch
            self._launch_fresh(batch)

    def _move_in_flight(self) -> None:
        """Rows move while a decode step is in flight, so the chain goes on: finished requests
        give their rows back, prompts whose bodies are queued are cached, and, with prompts in
        the chain, waiting requests take free rows and pages (`Seating.seat(in_flight=True)`).

        NOTE: safe where a row is its pages alone (`moves_in_flight`): every step is queued on
        one stream in order, and each reads and writes the pool's latest buffers, so a page
        freed here and written by its next owner's step is written after the steps in flight
        are done with it; a cached page is read only by steps queued later. What would wait
        for the device stays with the breaks: copies of partly shared pages, pool growth,
        preemption. Without it every turn of an agent broke the chain twice (its finish, then
        its next turn's seating): 58 + 60 of 569 steps, 32 agents x 3 turns on the CPU.
        """
        self._apply_moves()
        if self.defaults.prefill_in_chain and self._seatable():
            self._seat_blocked = self._seat(in_flight=True)

    def _can_chain(self, cur: Batch) -> bool:
        if not self._chains_from(cur):
            return False
        why = self._chain_break(cur)
        if why is not None:
            self._breaks[why] += 1
        return why is None

    def _chain_break(self, cur: Batch) -> str | None:
        """Why a decode step's rows cannot go on in a chained step (None: they can)."""
        if self._must_seat():
            return "seat"
        # NOTE: a row whose next token is forced (`_follow_thought`): the step after `cur` must
        # take that token as its input, known only once `cur`'s sampled one is replaced
        if any(r.force_next is not None for r in cur.rows):
            return "forced"
        # NOTE: a speculating row's next input is the last token its step accepts
        if cur.proposals is not None or self.spec.breaks_chain(cur.decode):
            return "spec"
        if self.running.prefilling() and not self._prefill_chains(cur):
            return "prefill"
        # NOTE: a request that must finish at `cur` (length) would only waste the chained step;
        # with moves in flight the others go on without it, as rows rebuilt on the host
        # (`Runner.chained_inputs`), which sampling that counts tokens cannot be.
        kept = self._continuing(cur)
        if len(kept) < len(cur.rows) and not self._drops_in_chain(cur, kept):
            return "finish"
        # NOTE: the chained step writes each row's next position: a free page where that starts
        # one (no eviction or preemption while a step is in flight).
        if not all(self.kv.grow(r, evict=False) for r in kept):
            return "pages"
        return None

    def _continuing(self, cur: Batch) -> list[Req]:
        """`cur`'s rows that decode on after it (not finished, not at their last token)."""
        return [r for r in cur.rows if not r.finished and len(r.output_ids) + 1 < r.max_new]

    def _drops_in_chain(self, cur: Batch, kept: list[Req]) -> bool:
        """Whether the chain goes on without `cur`'s other rows: rows move in flight, some row
        goes on, and no sampling counts tokens (the kept rows' counts are on the device)."""
        penalties = cur.sampler is not None and cur.sampler.any_penalty
        return self.moves_in_flight and bool(kept) and not penalties

    def _chains_from(self, cur: Batch) -> bool:
        """A decode step's rows go on in a chained step: a pure decode step's, and with prompts
        in the chain (`prefill_in_chain`) a step's that joined prompts too (they decode in the
        chained step, in the same rows: its sampler state is `cur`'s advanced)."""
        if cur.slices or not cur.rows:
            return False
        return cur.pure_decode or self.defaults.prefill_in_chain

    def _prefill_chains(self, cur: Batch) -> bool:
        """Whether prompts still prefilling let the chain go on, a prefill step beside each
        chained decode step (`prefill_in_chain`): not once one is due (its last token joins a
        fresh step) or its slot waits for a snapshot (taken while nothing is in flight)."""
        if not self.defaults.prefill_in_chain or self._to_snapshot:
            return False
        return all(self._joins_chain(cur, r) for r in self._due_beside(cur))

    def _due_beside(self, cur: Batch) -> list[Req]:
        """Prompts due to join that are not rows of `cur` (prompts that joined in the chain are
        promoted at the next settle; until then they are prefilling rows that decode)."""
        rows = set(map(id, cur.rows))
        return [
            r for r in self.running.prefilling() if due(r) and not r.finished and id(r) not in rows
        ]

    def _joins_chain(self, cur: Batch, req: Req) -> bool:
        """A due prompt joins the chained step (`Runner.chained_inputs`) when no row's sampling
        counts tokens (penalties: the counts of `cur`'s rows are still on the device)."""
        penalties = cur.sampler is not None and cur.sampler.any_penalty
        return not penalties and not has_penalty(req.params)

    def _must_break(self, nxt: Batch) -> bool:
        """After `nxt`'s launch, `cur`'s tokens ended some of its rows, or requests wait for a
        row: break now, or (rows moving in flight) let the next `_can_chain` decide."""
        finished = any(r.finished for r in nxt.rows)
        if self.moves_in_flight:
            finished = finished and not self._drops_in_chain(nxt, self._continuing(nxt))
        for why, hit in (("finish", finished), ("seat", self._must_seat())):
            if hit:
                self._breaks[why] += 1
                return True
        return False

    def _seatable(self) -> bool:
        return self.seating and self.seats.seatable()

    def _must_seat(self) -> bool:
        """Whether requests wait that only a break can seat: with seating in flight, those that
        need a row given back or the pool grown (`_seat_blocked`); else any seatable one."""
        if self.moves_in_flight and self.defaults.prefill_in_chain:
            return self._seat_blocked and self._seatable()
        return self._seatable()

    # -- launches ----------------------------------------------------------------------------
    def prepare_launch(self, batch: Batch) -> None:
        """All launch bookkeeping, for fresh and chained launches alike, before graph building."""
        self._counters["steps_launched"] += 1
        self._counters["steps_chained" if batch.chained else "steps_fresh"] += 1
        self._counters["steps_prefill" if batch.is_prefill else "steps_decode"] += 1
        batch.step_index = self._counters["steps_launched"]
        batch.launch_ts = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("step %d %s", batch.step_index, _describe(batch))
        if self.on_launch is not None:
            self.on_launch(batch)

    def _launch_fresh(self, batch: Batch) -> None:
        self.prepare_launch(batch)
        inputs = self.runner.decode_inputs(batch) if batch.rows else None
        self.runner.launch(batch, inputs)
        self.step_times.launched(batch)
        if batch.beside is not None:
            self._launch_beside(batch.beside)

    def _launch_beside(self, side: Batch) -> None:
        """A prefill step queued right after a decode step, riding its chain (`Batch.beside`):
        after it, so the decode's tokens reach the host while the prefill runs."""
        self.prepare_launch(side)
        self.runner.launch(side, None)
        self.step_times.launched(side)

    def _launch_chained(self, prev: Batch) -> Batch:
        out, sampler = prev.decode_out, prev.sampler
        assert out is not None and sampler is not None, "only a launched decode step chains"
        joining = self._due_beside(prev) if self.defaults.prefill_in_chain else []
        kept = self._continuing(prev) if self.moves_in_flight else prev.rows
        batch = Batch(decode=kept, joined=joining, chained=True)
        if joining or len(kept) < len(prev.rows):
            inputs = self.runner.chained_inputs(prev, batch)
        else:
            batch.sampler, inputs = advance(sampler, out.tokens), out.tokens
        self.prepare_launch(batch)
        # NOTE: a constrained row's mask needs `prev`'s token on the host: the forward goes now,
        # its sampling once `prev` is finalized (`_sample_deferred`), the masks computed while
        # the device runs the forward.
        constrained = any(r.matcher is not None for r in batch.rows)
        self.runner.launch(batch, inputs, defer_sample=constrained, after=prev)
        slices = self._plan_slices() if self.running.prefilling() else []
        if slices:
            batch.beside = Batch(slices=slices, chained=True)
            self._launch_beside(batch.beside)
        return batch

    def _sample_deferred(self, batch: Batch) -> None:
        # NOTE: a row that finished at the step before (its grammar complete) may take any token:
        # the chain breaks there and its token is dropped.
        matchers = [None if r.finished else r.matcher for r in batch.rows]
        self.runner.sample_deferred(batch, self.grammars.fill(matchers))

    def _schedule(self) -> Batch | None:
        """One forward per step: prefill chunks, or every decode row and due last tokens.

        NOTE: decode rows wait at most one prefill step: after a prefill step, a decode step runs
        whenever there is a row to decode.
        """
        if self.seating:
            self._seat()
        decoding = self.running.decoding()
        ready = [r for r in self.running.prefilling() if due(r)]
        # NOTE: with prompts in the chain, a decode step carries the prefill step beside it
        beside = self.defaults.prefill_in_chain and bool(decoding or ready)
        if not beside and not (self._prefill_last and (decoding or ready)):
            slices = self._plan_slices()
            if slices:
                self._prefill_last = True
                return Batch(slices=slices)
        self._prefill_last = False
        self.seats.make_room()
        rows = self.running.decoding()
        joined = [r for r in self.running.prefilling() if due(r)]
        if not rows and not joined:
            return None
        batch = Batch(decode=rows, joined=joined)
        batch.proposals = self.spec.plan(rows, self.kv)
        self._fill_masks(batch)
        slices = self._plan_slices() if beside else []
        if slices:
            batch.beside = Batch(slices=slices)
        return batch

    def _fill_masks(self, batch: Batch) -> None:
        """Constrained rows' masks for a fresh decode step; a speculating step's also for each
        proposal position (`Batch.spec_allowed`)."""
        matchers = [r.matcher for r in batch.rows]
        proposals = _padded([p or [] for p in batch.proposals or []], len(matchers))
        w = max(map(len, proposals), default=0)
        ahead = self.grammars.fill_ahead(matchers, proposals, w) if w else None
        if ahead is None:
            batch.allowed = self.grammars.fill(matchers)
        else:
            batch.allowed, batch.spec_allowed = ahead

    def _seat(self, in_flight: bool = False) -> bool:
        """Seat what fits; a request that ended while seated is reported even when seating
        fails after it (its failed grammar must still reach its client). Returns whether a
        request waits that a break could seat (`Seating.seat`)."""
        try:
            return self.seats.seat(in_flight)
        finally:
            for req in self.seats.ended:
                self._report(req)
            self.seats.ended.clear()

    def _plan_slices(self) -> list[PromptSlice]:
        # NOTE: an aborted prompt is released at the next settle, which a chain puts off
        todo = [r for r in self.running.prefilling() if body_left(r) > 0 and not r.finished]
        if not todo:
            return []
        decoding = bool(self.running.n_decode)
        plan = self.planner.plan(todo, self.ladders, decoding, lone_first=self._lone_next)
        # NOTE: steps of lone chunks and of the others take turns (`PrefillPlanner.plan`)
        self._lone_next = not plan.lone
        return self._slices(plan.chunks, plan.lone)

    def _slices(self, plan: list[tuple[Req, int]], lone: bool) -> list[PromptSlice]:
        slices = []
        for req, n in plan:
            slices.append(PromptSlice(req, req.prefilled, req.prefilled + n, lone))
            req.prefilled += n
            self._counters["prefill_tokens"] += n
            if due(req):
                self._to_publish.append(req)
            elif req.prefilled == req.snap_at:
                self._to_snapshot.append(req)
        return slices

    # -- results -----------------------------------------------------------------------------
    def _finalize(self, batch: Batch) -> None:
        """Block on a launched step and apply its tokens; finished requests' tokens are dropped.

        A prefill step has no tokens: nothing to wait for (its KV writes are ordered before the
        next forward by the buffers themselves).
        """
        assert batch.launch_ts is not None and batch.step_index > 0, "batch was never launched"
        self._counters["batches_finalized"] += 1 + (batch.beside is not None)
        if batch.decode_out is None:
            return
        tokens, logprobs = _host(batch.decode_out)
        self.spec.stepped(batch, self.step_times.add(batch, time.monotonic()))
        for req in batch.joined:
            self._start_decoding(req)
        if batch.proposals is not None:
            self._verify(batch, tokens, logprobs)
            return
        for i, req in enumerate(batch.rows):
            self._accept(req, tokens[i], logprobs[i])

    def _verify(
        self, batch: Batch, first: list[int], logprobs: Sequence[TokenLogprob | None]
    ) -> None:
        """A step with speculating rows: each row's token at its input, then, for a speculating
        row, its tokens at the proposal's positions while the proposal matches them (the last
        one is the token after the proposal's longest matching prefix); its KV past them is
        rolled back."""
        assert batch.proposals is not None
        rest, rest_lps = _ahead(batch.spec_out)
        share = len(batch.rows) / max(sum(1 for p in batch.proposals if p), 1)
        for i, req in enumerate(batch.rows):
            proposal = batch.proposals[i] if i < len(batch.proposals) else None
            emitted = 0 if req.finished else 1
            self._accept(req, first[i], logprobs[i])
            for j, token in enumerate(proposal or []):
                if req.finished or req.output_ids[-1] != token:
                    break
                self._accept(req, rest[i][j], rest_lps[i][j] if rest_lps else None)
                emitted += 1
            if proposal is None:
                continue
            # NOTE: written: the input and the proposal; kept: the input and what was accepted
            req.kv_len -= len(proposal) + 1 - max(emitted, 1)
            self.kv.trim(req)
            self.spec.verified(req, proposal, max(emitted - 1, 0), share)

    def _start_decoding(self, req: Req) -> None:
        """Its prompt is in the KV and its first token sampled: it joins the decode rows."""
        if not req.finished:
            req.state = State.DECODING
            self._to_promote.append(req)

    def _accept(self, req: Req, token: int, logprob: TokenLogprob | None) -> None:
        if req.finished:
            return
        if req.force_next is not None:  # NOTE: the thought's budget is spent: its end instead
            token, logprob, req.force_next = req.force_next, None, None
        n = req.params.logprobs
        req.append(token, TokenLogprob(logprob.logprob, logprob.top[:n]) if n and logprob else None)
        self._counters["generated_tokens"] += 1
        if req.params.think_budget is not None:
            _follow_thought(req, token)
        if req.matcher is not None:
            _follow_grammar(req, token)
        self._touched[req.rid] = req
        if req.finished:
            self._to_free[req.rid] = req

    def _settle(self) -> None:
        """Row moves and releases while no step is in flight."""
        assert self._current is None and self._next is None
        self._seat_blocked = False
        self._apply_moves()
        if self.kv.disk is not None:
            self.kv.disk.flush(busy=bool(self.running.reqs or self._waiting))

    def _apply_moves(self) -> None:
        """Cache queued prompt bodies, snapshot, promote joined prompts, free finished rows."""
        for req in self._to_publish:
            if not req.finished and req.slot is not None:
                self.kv.publish(req)
        self._to_publish.clear()
        for req in self._to_snapshot:
            if not req.finished and req.slot is not None:
                self.kv.snapshot_at(req)
        self._to_snapshot.clear()
        for req in self._to_promote:
            if not req.finished:
                self.running.promote(req)
        self._to_promote.clear()
        for req in self._to_free.values():
            if req.slot is not None:
                self.kv.release(req)
                self.running.release(req)
            req.state = State.FINISHED
        self._to_free.clear()

    def _emit(self) -> list[Chunk]:
        outs = [req.take_output(_prompt_logprobs(req)) for req in self._touched.values()]
        for req in self._touched.values():
            if req.reported_finish:
                del self._reqs[req.rid]
                key = "requests_aborted" if req.finish_reason == "abort" else "requests_finished"
                self._counters[key] += 1
        self._touched.clear()
        return outs

    def _report(self, req: Req) -> None:
        """`req` has output (or its end) for the next `_emit`."""
        self._touched[req.rid] = req

    def _fail_in_flight(self, exc: Exception) -> None:
        mx.synchronize()
        batches = [b for b in (self._current, self._next) if b is not None]
        self._current = self._next = None
        reqs = {r.rid: r for b in batches for r in b.reqs()} or dict(self._reqs)
        for req in reqs.values():
            if not req.finished:
                self._end(req, "error", f"{type(exc).__name__}: {exc}")
        self._settle()

    def _end(self, req: Req, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request outside a step's tokens: report it; its row goes at the next settle."""
        req.finish(reason, error)
        self._report(req)
        if req.state is State.WAITING:
            self._waiting.remove(req)
        else:
            self._to_free[req.rid] = req


def _follow_thought(req: Req, token: int) -> None:
    """Count a thought's tokens; at its budget the next token is forced to the end marker
    (the token sampled after this one is replaced: its step wrote this one's KV)."""
    p = req.params
    if token == p.think_start_id:
        req.thinking = True
    elif token == p.think_end_id:
        req.thinking = False
    elif req.thinking:
        req.thought += 1
        if req.thought >= (p.think_budget or 0):
            req.force_next = p.think_end_id


def _follow_grammar(req: Req, token: int) -> None:
    """Advance a constrained request's matcher; a complete output ends it ("stop")."""
    if not req.matcher.consume_token(token):
        # NOTE: the mask let only tokens through that the matcher takes, unless the grammar gave
        # out (llguidance's limits: `start: "a" start` has no end and exhausts its items)
        reason = req.matcher.get_error().strip().splitlines()[0][:300]
        req.invalid = constraints.field_of(req.params) or "grammar"
        req.finish(
            "error", f"the {req.invalid} gave out after {len(req.output_ids)} tokens: {reason}"
        )
    elif req.matcher.is_stopped():
        req.finish("stop")


def kv_quant(config: EngineConfig, dims: list[tuple[int, int]]) -> KVQuant | None:
    """`--kv-bits`: how full-attention pages are stored (None: the model's dtype); a group size
    that does not divide a head dim is refused here, naming the ones that would."""
    if not config.kv_bits:
        return None
    quant = KVQuant(config.kv_bits, config.kv_group_size)
    for dim in sorted({d for pair in dims for d in pair}):
        quant.check(dim)
    return quant


def _slot_bytes(layout: Layout, chunk: int, context: int | None) -> int:
    """Bytes one running request holds outside the pages: window rings and recurrent state."""
    rings = sum(
        ring_size(s.window, chunk, context or s.window + chunk) * bytes_per_token([s])
        for s in layout.kv
        if s.window is not None
    )
    return rings + layout.state_bytes_per_row


def _describe(batch: Batch) -> str:
    if batch.is_prefill:
        lone = " (lone)" if batch.slices[0].lone else ""
        return f"prefill {len(batch.slices)} chunks, {sum(c.end - c.start for c in batch.slices)} tokens{lone}"
    kind = "chained" if batch.chained else "fresh"
    return f"decode ({kind}) {len(batch.decode)} rows + {len(batch.joined)} last prompt tokens"


def _prompt_logprobs(req: Req) -> list[TokenLogprob | None] | None:
    """A `prompt_logprobs` request's first chunk with a token: its prompt's logprobs, brought to
    the host (the steps that computed them are done: a later step sampled the token)."""
    if req.params.prompt_logprobs is None or req.prompt_lp_sent or not req.new_ids:
        return None
    out: list[TokenLogprob | None] = [None]
    for arrays in req.prompt_lps:
        out += _paired(*(_listed(a) for a in arrays))
    req.prompt_lps, req.prompt_lp_sent = [], True
    return out


def _host(out: Sampled) -> tuple[list[int], Sequence[TokenLogprob | None]]:
    """Block on a step's tokens (and logprobs) and bring them to the host."""
    tokens: list[int] = _listed(out.tokens)
    if out.logprob is None or out.top_ids is None or out.top_logprobs is None:
        return tokens, [None] * len(tokens)
    return tokens, _paired(_listed(out.logprob), _listed(out.top_ids), _listed(out.top_logprobs))


def _padded(proposals: list[list[int]], n: int) -> list[list[int]]:
    return proposals + [[] for _ in range(n - len(proposals))]


def _ahead(out: Sampled | None) -> tuple[list[list[int]], list[list[TokenLogprob]] | None]:
    """A speculating step's tokens at the proposals' positions, row by row, and their logprobs
    when the batch asked for them."""
    if out is None:
        return [], None
    tokens: list[list[int]] = _listed(out.tokens)
    if out.logprob is None or out.top_ids is None or out.top_logprobs is None:
        return tokens, None
    rows = zip(_listed(out.logprob), _listed(out.top_ids), _listed(out.top_logprobs), strict=True)
    return tokens, [_paired(*row) for row in rows]


def _paired(
    chosen: list[float], ids: list[list[int]] | None = None, lps: list[list[float]] | None = None
) -> list[TokenLogprob]:
    """Each token's logprob, with its top alternatives (id, logprob) when they were asked for."""
    if ids is None or lps is None:
        return [TokenLogprob(c) for c in chosen]
    pairs = zip(chosen, ids, lps, strict=True)
    return [TokenLogprob(c, list(zip(i, v, strict=True))) for c, i, v in pairs]


def _listed(a: mx.array) -> list[Any]:
    """`a.tolist()` for an array of rank >= 1 (MLX types it for any rank)."""
    return a.tolist()  # type: ignore[return-value]
