"""Helpers for the scheduler tests: build a scheduler on a tiny model, drive it, reference tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

from engine.config import EngineConfig
from engine.messages.to_client import Chunk
from engine.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler

VOCAB = 49152  # the tiny random models' vocabulary

_MODELS: dict[Path, Any] = {}


def tiny_model(path: Path) -> Any:
    if path not in _MODELS:
        _MODELS[path] = load_model(path)[0]
    return _MODELS[path]


def make_scheduler(
    model: Any,
    eos: tuple[int, ...] = (),
    tokenizer_file: Path | None = None,
    draft: Any = None,
    **overrides: Any,
) -> Scheduler:
    """`draft`: `--spec draft`'s model (pass `spec="draft"` and a `draft_model` name too)."""
    # NOTE: 32 rows + the scratch row, and 7 rows' worth of prefix store.
    base = dict(max_running_requests=32, max_total_tokens=40 * 2048, context_length=2048)
    config = EngineConfig(**{**base, **overrides})
    return Scheduler(config, model, eos, tokenizer_file=tokenizer_file, draft=draft)


def bucketed(sched: Scheduler, warm: bool = True) -> Scheduler:
    """Give a CPU scheduler the GPU's bucketed shapes (padding rows, widths, key lengths), and run
    its full warm-up, so the GPU's code path is checked here."""
    from scheduler_proc.shapes import Ladders

    slots, context = sched.running.slots, sched.max_context
    sched.ladders = sched.runner.ladders = Ladders.for_pool(slots, context, sched.chunk_size)
    if warm:
        limit = sched.planner.scores_limit
        sched.runner.warm_up(sched.prefill_budget, deadline_s=600.0, scores_limit=limit)
    return sched


def count_forwards(sched: Scheduler) -> list[int]:
    """Model calls per launched step, appended to as the scheduler runs."""
    per_step: list[int] = []
    model = sched.runner.model
    real_launch = sched.on_launch

    def counted(*args: Any, **kwargs: Any) -> Any:
        per_step[-1] += 1
        return model(*args, **kwargs)

    def on_launch(batch: Any) -> None:
        per_step.append(0)
        if real_launch is not None:
            real_launch(batch)

    sched.runner.model = counted
    sched.on_launch = on_launch
    return per_step


def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own single-request greedy generation."""
    steps = generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(tok) for tok, _ in steps]


def drive(
    sched: Scheduler,
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
    max_steps: int = 100_000,
) -> dict[str, list[Chunk]]:
    """Submit requests at the given step numbers and step until all work is done."""
    outs: dict[str, list[Chunk]] = {}
    step = 0
    while step <= max(arrivals, default=0) or sched.has_work():
        for rid, ids, params in arrivals.get(step, []):
            sched.submit(rid, ids, params)
        for out in sched.step():
            outs.setdefault(out.rid, []).append(out)
        step += 1
        assert step < max_steps, "scheduler did not finish"
    return outs


def tokens(outs: list[Chunk]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy and blind to eos: exactly `max_tokens` tokens, comparable with mlx-lm's."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def random_prompt(rng: random.Random, n: int, vocab: int = VOCAB) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def assert_pages_balanced(sched: Scheduler) -> None:
    """Every page's references are the prefix cache's tokens in it, and nothing else: no running
    request holds a page, a freed page is on the free list once, none is leaked."""
    from collections import Counter

    pages, page = sched.kv.pages, sched.pool.page_size
    tree: Counter[int] = Counter()
    if sched.prefix is not None:
        for node in sched.prefix.tree.nodes():
            tree.update(s // page for s in node.slots)
    assert not sched.running.reqs, "a request still runs"
    for p in range(1, pages.size + 1):
        assert pages.refs(p) == tree[p], f"page {p}: {pages.refs(p)} refs, {tree[p]} cached"
    assert pages.available == pages.size - len(tree), "free list and counts disagree"
