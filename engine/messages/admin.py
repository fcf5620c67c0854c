"""Operating a running engine (docs/operations.md, "Operate a running engine"): the operations and
the messages that carry them.

An operation travels client -> tokenizer (`AdminRequest`, with the owner's key), tokenizer ->
scheduler (`AdminCommand`; under tensor parallel rank 0 broadcasts it), and its answer back through
the detokenizer (`AdminDone`, after the outputs of the step that completed it) to the client
(`AdminReply` in to_client.py, or a `Failure`). The scheduler runs one operation at a time, in arrival order.
"""

from __future__ import annotations

from typing import Any, Literal

from engine.messages.to_client import Failure
from engine.protocol import Message

# NOTE: SGLang's names (its /pause_generation modes) plus "wait" from the operators:
# abort: every request in flight ends now (finish_reason "abort");
# wait: no new admissions, running requests finish, the call returns when they have;
# retract: running requests give their rows back and wait in the queue, streams intact;
# in_place: running requests keep their rows and KV, and simply stop stepping.
PauseMode = Literal["abort", "wait", "retract", "in_place"]
# NOTE: what a request that arrives while paused meets: a place in the queue, or 503 `Paused`.
WhilePaused = Literal["queue", "refuse"]


class PauseGeneration(Message):
    mode: PauseMode = "abort"
    new_requests: WhilePaused = "queue"


class ContinueGeneration(Message):
    pass


class UpdateWeights(Message):
    """New weights of the same architecture from a directory, .gguf or Hugging Face name,
    swapped in once running requests finished (or were aborted, `abort_all_requests`)."""

    model_path: str
    abort_all_requests: bool = False


class LoadAdapter(Message):
    """A LoRA adapter (mlx-lm's format: adapter_config.json + adapters.safetensors); one is
    active at a time, so loading one replaces the one before."""

    lora_path: str
    lora_name: str = ""


class UnloadAdapter(Message):
    lora_name: str = ""  # NOTE: "" unloads whichever is loaded


class FlushCache(Message):
    pass


class GetModelInfo(Message):
    pass


class GetCachedBlocks(Message):
    """The hashes of every whole page the prefix cache holds (KV events' blocks), and the
    sequence number of the last KV event batch, which brought a subscriber to this state."""


AdminOp = (
    PauseGeneration
    | ContinueGeneration
    | UpdateWeights
    | LoadAdapter
    | UnloadAdapter
    | FlushCache
    | GetModelInfo
    | GetCachedBlocks
)
# NOTE: operations that change what the model computes: they wait for running requests, then the
# prefix cache is flushed (its KV was computed by the model before).
MODEL_CHANGES = (UpdateWeights, LoadAdapter, UnloadAdapter)


class AdminRequest(Message):
    """Client -> tokenizer: an operation, with the owner's key or control token."""

    rid: str
    op: AdminOp
    api_key: str | None = None


class AdminCommand(Message):
    """Tokenizer -> scheduler (and rank 0 -> every rank)."""

    rid: str
    op: AdminOp


class AdminDone(Message):
    """Scheduler -> detokenizer -> tokenizer: the operation's result, or why it failed."""

    rid: str
    info: dict[str, Any] = {}
    failure: Failure | None = None
