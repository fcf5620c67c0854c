"""Messages the launcher receives on its private PULL socket."""

from __future__ import annotations

import msgspec

from engine.protocol import Message


class SchedulerFacts(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the scheduler learned while starting, which the other children need: the model
    directory it resolved (a .gguf is converted first) and the limits of its KV pool."""

    model_dir: str
    model: str  # the name clients see
    vocab_size: int
    max_context: int  # tokens per request (prompt + generated)
    kv_budget_tokens: int = 0
    prefix_cache_tokens: int = 0  # what the prefix cache may hold: the KV pages it shares
    tokenizer_defaults: str = "null"  # JSON of the model module's TOKENIZER_DEFAULTS
    running_slots: int = 0  # most requests running at once (the front door's admission)
    # NOTE: the prefix cache hits only at snapshots of a slot (window rings, recurrent state):
    # the front door tells it where a chat's shared part ends (`TokenizedRequest.shared`)
    snapshot_hits: bool = False
    # NOTE: where start-up went (seconds): the model found or fetched (a download, a GGUF
    # conversion), loaded, the step shapes warmed; the launcher's READY line reports them
    model_s: float = 0.0
    load_s: float = 0.0
    warm_up_s: float = 0.0


class Ready(Message):
    """A child finished starting; the scheduler's READY carries its `SchedulerFacts`."""

    process: str
    pid: int
    facts: SchedulerFacts | None = None


class StartFailed(Message):
    process: str
    error: str


class ShutdownRequested(Message):
    """An SDK client called `shutdown()`; the launcher runs the same path as SIGTERM."""

    reason: str


ToLauncher = Ready | StartFailed | ShutdownRequested
