"""Starting a scheduler, for the one-process loop (main.py) and every tensor-parallel rank
(rank.py) alike: the model loaded, and the facts its READY reports."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.messages.to_launcher import SchedulerFacts

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler

log = logging.getLogger("scheduler")


def load_model(config: EngineConfig) -> tuple[Path, Any, list[int], tuple[float, float]]:
    """(model dir, model, eos ids, (seconds to find or fetch it, seconds to load it))."""
    from engine.models import resolve_model_dir
    from scheduler_proc.model_loader import load_for_scheduler

    t0 = time.monotonic()
    model_dir = resolve_model_dir(config.model, config.gguf_file)
    t1 = time.monotonic()
    model, eos = load_for_scheduler(str(model_dir), config)
    t2 = time.monotonic()
    log.info("model %s loaded in %.1f s (found or fetched in %.1f s)", model_dir, t2 - t1, t1 - t0)
    return model_dir, model, eos, (t1 - t0, t2 - t1)


def load_draft(config: EngineConfig, model_dir: Path) -> Any:
    """`--draft-model`, loaded as the model is (without its adapter); `ModelError` when its
    tokenizer is not the model's (its tokens would mean other text)."""
    from dataclasses import replace

    from engine.errors import ModelError
    from engine.models import resolve_model_dir
    from scheduler_proc.model_loader import load_for_scheduler

    try:
        draft_dir = resolve_model_dir(config.draft_model)
    except ModelError as e:
        raise ModelError(f"--draft-model: {e}") from None
    if _vocabulary(draft_dir) != _vocabulary(model_dir):
        raise ModelError(
            f"the draft model {draft_dir} has another tokenizer than the model {model_dir}: "
            "a draft must share its tokenizer"
        )
    t0 = time.monotonic()
    draft, _ = load_for_scheduler(str(draft_dir), replace(config, adapter_path=None))
    log.info("draft model %s loaded in %.1f s", draft_dir, time.monotonic() - t0)
    return draft


def _vocabulary(model_dir: Path) -> dict[str, int]:
    from engine.tokenizer_loader import load_tokenizer

    return dict(load_tokenizer(model_dir).get_vocab())


def scheduler_facts(
    model_dir: Path, scheduler: Scheduler, config: EngineConfig, times: tuple[float, float]
) -> SchedulerFacts:
    """What the scheduler's READY tells the launcher (and through it the other processes);
    `times`: `load_model`'s."""
    from engine.models import served_name
    from engine.tokenizer_loader import tokenizer_defaults

    return SchedulerFacts(
        model_dir=str(model_dir),
        model=served_name(config.model, model_dir),
        vocab_size=int(scheduler.vocab),
        max_context=scheduler.max_context,
        kv_budget_tokens=scheduler.kv_plan.budget.tokens,
        prefix_cache_tokens=0 if scheduler.prefix is None else scheduler.kv_plan.tokens,
        tokenizer_defaults=tokenizer_defaults(model_dir),
        running_slots=scheduler.running.slots,
        snapshot_hits=scheduler.kv.snapshots is not None,
        model_s=round(times[0], 2),
        load_s=round(times[1], 2),
        warm_up_s=round(scheduler.warm_up_s, 2),
    )
