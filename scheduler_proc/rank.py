"""Start one tensor-parallel scheduler rank: join the group, load and shard, agree on the KV plan.

Every rank loads the whole model and keeps its shard (mlx-lm's `model.shard()`: attention and MLP
projections split, `n_kv_heads // N` per rank, so each rank's KV pool holds its own heads).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.distributed import RankPlan, Watchdog
from engine.ipc import Endpoints
from engine.messages.to_launcher import SchedulerFacts

if TYPE_CHECKING:
    from scheduler_proc.broadcast import Channel

log = logging.getLogger("scheduler")


def create_rank(
    config: EngineConfig,
    endpoints: Endpoints,
    orphaned: threading.Event,
    plan: RankPlan,
    name: str,
) -> tuple[Any, SchedulerFacts | None]:
    from engine import distributed
    from engine.cpu_backend import setup_cpu_backend

    plan.enter()  # NOTE: MLX reads its rank and hostfile from the environment
    distributed.pin_share(plan)
    setup_cpu_backend(config)  # NOTE: before anything imports mlx.core (a BLAS preload)
    from scheduler_proc.replicated import ReplicatedLoop, RootLinks
    from scheduler_proc.scheduler import Scheduler
    from scheduler_proc.startup import load_model, scheduler_facts

    # NOTE: `kill -USR1 <rank pid>` prints where every thread of a rank is (a stuck collective).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dog = Watchdog(name)
    with dog.phase("joining the group", config.tp_init_timeout):
        group = distributed.join_group(plan)
        check_same_options(group, config)
        bcast = open_channel(config, group, plan)
    config = _share_host(config, plan)
    model_dir, model, eos, times = load_model(config)
    distributed.shard(model, group)
    # NOTE: every collective from here on needs every rank; one that failed to start would
    # leave the others blocked, so start-up has a deadline too.
    with dog.phase("starting (KV plan, warm-up)", config.startup_timeout):
        scheduler = Scheduler(
            config,
            model,
            eos,
            kv_agree=lambda p: agree_kv_plan(group, p),
            tokenizer_file=model_dir / "tokenizer.json",
        )
    links = RootLinks(endpoints) if plan.rank == 0 else None
    loop = ReplicatedLoop(
        scheduler, bcast, dog, config.tp_step_timeout, links, orphaned, model_dir=model_dir
    )
    # NOTE: only rank 0 serves clients; a worker's READY carries no facts.
    return loop, scheduler_facts(model_dir, scheduler, config, times) if plan.rank == 0 else None


# NOTE: options every rank's scheduler must share, or the ranks would schedule different steps
# (on several hosts each launcher has its own command line).
SCHEDULER_OPTIONS = (
    "max_running_requests",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "long_prefill_scores",
    "long_prefill_chunk",
    "max_total_tokens",
    "context_length",
    "max_queued_requests",
    "disable_overlap",
    "disable_radix_cache",
    "warmup",
    "fused_decode",
    "prefill_attention",
    "seed",
    "tp_frames",
)


def open_channel(config: EngineConfig, group: Any, plan: RankPlan) -> Channel:
    """The broadcast's carrier (docs/distributed.md): host sockets, or a collective per frame."""
    from scheduler_proc.broadcast import Broadcast
    from scheduler_proc.host_channel import open_host_channel

    if config.tp_frames == "collective":
        return Broadcast(group)
    return open_host_channel(group, plan.hosts)


def check_same_options(group: Any, config: EngineConfig) -> None:
    """Refuse to start when a rank's scheduler options differ from another's."""
    import zlib

    from engine.distributed import agree_min

    text = repr([(k, getattr(config, k)) for k in SCHEDULER_OPTIONS]).encode()
    mine = zlib.crc32(text)
    if agree_min(group, [mine, -mine]) != [mine, -mine]:
        raise ValueError(
            "the ranks were started with different scheduler options; give every host the "
            f"same {', '.join('--' + k.replace('_', '-') for k in SCHEDULER_OPTIONS)}"
        )


def agree_kv_plan(group: Any, plan: Any) -> Any:
    """The plan every rank can hold: the minimum of each rank's pages, slots and context."""
    from engine.distributed import agree_min

    pages, slots, context = agree_min(group, [plan.pages, plan.slots, plan.context])
    agreed = dataclasses.replace(plan, pages=pages, slots=slots, context=context)
    if agreed != plan:
        log.info(
            "KV plan agreed across ranks: %d pages, %d slots, context %d", pages, slots, context
        )
    return agreed


def _share_host(config: EngineConfig, plan: RankPlan) -> EngineConfig:
    """Ranks sharing one host's memory (CPU, Apple silicon) split --mem-fraction between them."""
    from engine.distributed import resolve_backend

    if plan.local_ranks > 1 and resolve_backend(plan.backend) == "ring":
        return dataclasses.replace(config, mem_fraction=config.mem_fraction / plan.local_ranks)
    return config
