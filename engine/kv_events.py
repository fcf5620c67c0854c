"""KV events on the wire: vLLM's event format, and how a block's hash is computed.

A subscriber (a KV-aware router: Dynamo's, llm-d's indexer, smg) learns which prefixes the engine
holds from three events (docs/prefix_cache.md, "KV events"):
- `BlockStored`: whole pages newly cached, in order along one path, with their hashes, the hash of
  the page before the first of them (None at the start of a prompt) and their tokens;
- `BlockRemoved`: pages evicted;
- `AllBlocksCleared`: nothing is cached (a flush, and the engine's start).

A block is one KV page (`--page-size` tokens). Its hash is a function of the whole token prefix
up to its end, chained, so a consumer holding the same tokens computes the same hashes:
h(page k) = first 8 bytes of BLAKE2b-64(h(page k-1) as 8 bytes little-endian, or 8 zero bytes
for the first page; then the page's tokens as uint32 little-endian), read little-endian, with the
top bit cleared (a non-negative int64, which decoders typed i64 or u64 both take).

Frames are vLLM's (its `ZmqEventPublisher`): [topic, sequence number as 8 bytes big-endian,
msgpack of the batch]; a batch is `[ts, events, data_parallel_rank]`. Two event layouts:
- "array": each event a positional array, its type's name first (vLLM's layout until its events
  became maps; the one most decoders read);
- "map": each event a map with its type's name under "type" (vLLM's later layout).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

LAYOUTS = ("array", "map")
# NOTE: vLLM's name for the engine's primary KV pool (its MEDIUM_GPU), whatever the device: a
# consumer sorting blocks by tier reads "GPU" as the pool requests run on.
MEDIUM = "GPU"
_TOP_BIT_CLEAR = (1 << 63) - 1
_NO_PARENT = bytes(8)


# -- the engine's side: what the prefix cache records ------------------------------------------
class Stored(NamedTuple):
    """Whole pages cached along one path: their hashes, the page before's hash, their tokens."""

    hashes: list[int]
    parent: int | None
    tokens: list[int]


class Removed(NamedTuple):
    hashes: list[int]


class Cleared(NamedTuple):
    pass


Event = Stored | Removed | Cleared


def chain_hashes(parent: int | None, tokens: Sequence[int], page_size: int) -> list[int]:
    """The hashes of the whole pages of `tokens` (which start on a page boundary), each chained
    to the one before, the first to `parent` (None: the first page of a prompt)."""
    words = array("I", tokens)
    if sys.byteorder == "big":  # NOTE: the hash is defined over little-endian tokens
        words.byteswap()
    data = words.tobytes()
    step = 4 * page_size
    out: list[int] = []
    prev = _NO_PARENT if parent is None else parent.to_bytes(8, "little")
    for start in range(0, len(data) - step + 1, step):
        digest = hashlib.blake2b(prev + data[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") & _TOP_BIT_CLEAR)
        prev = out[-1].to_bytes(8, "little")
    return out


# -- the wire ------------------------------------------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: `[ts, events, data_parallel_rank]` (the events' layout varies)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


def wire_events(events: Sequence[Event], layout: str, page_size: int) -> list[Any]:
    """The recorded events as `layout`'s structs."""
    return [_wire(e, layout, page_size) for e in events]


def _wire(event: Event, layout: str, page_size: int) -> Any:
    if isinstance(event, Stored):
        args = (event.hashes, event.parent, event.tokens, page_size, None, MEDIUM, None)
        if layout == "array":
            return ArrayBlockStored(*args)
        # NOTE: one KV cache group, full attention (window layers keep rings, not pages)
        return MapBlockStored(*args, group_idx=0, kv_cache_spec_kind="full_attention")
    if isinstance(event, Removed):
        if layout == "array":
            return ArrayBlockRemoved(event.hashes, MEDIUM)
        return MapBlockRemoved(event.hashes, MEDIUM, group_idx=0)
    return ArrayAllBlocksCleared() if layout == "array" else MapAllBlocksCleared()


ArrayEvents = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
MapEvents = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared


class ArrayBatch(EventBatch):
    events: list[ArrayEvents]


class MapBatch(EventBatch):
    events: list[MapEvents]


def decoder(layout: str) -> msgspec.msgpack.Decoder:
    """A typed decoder of one batch's payload in `layout`."""
    return msgspec.msgpack.Decoder(ArrayBatch if layout == "array" else MapBatch)


def sequence_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# NOTE: the replay socket's last frame: sequence -1 and an empty payload (vLLM's END_SEQ).
END_OF_REPLAY = sequence_bytes(-1)
