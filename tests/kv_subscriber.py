"""A KV event subscriber written from the wire format alone, as a KV-aware router would: vLLM's
struct layouts (mirrored here, not imported from the engine), the documented block hash computed
independently, and the cached blocks rebuilt from the events (tests/test_kv_events.py,
scripts/kv_events_check.py).
"""

from __future__ import annotations

import hashlib
import queue
import struct
import threading
import time
from typing import Any

import msgspec
import zmq

# -- vLLM's structs, as a consumer declares them (vllm/distributed/kv_events.py) ---------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The first layout: each event a positional array, tagged by its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The later layout: each event a map, its class name under "type"."""


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class MapEventBatch(EventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


DECODERS = {
    "array": msgspec.msgpack.Decoder(KVEventBatch),
    "map": msgspec.msgpack.Decoder(MapEventBatch),
}


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """docs/prefix_cache.md: BLAKE2b-64 over the parent's hash (8 bytes LE, zeros for none) and
    the tokens (uint32 LE), read LE, top bit cleared."""
    prev = struct.pack("<Q", parent or 0)
    digest = hashlib.blake2b(prev + struct.pack(f"<{len(tokens)}I", *tokens), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


class Rebuilt:
    """The engine's cached blocks as the events say: hash -> (parent hash, tokens). Every rule a
    consumer relies on is asserted as it applies an event."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.seq = -1
        self.block_size: int | None = None
        self.events = 0

    def apply(self, seq: int, batch: Any) -> None:
        assert seq == self.seq + 1, f"batch {seq} after {self.seq}: a gap"
        self.seq = seq
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            self.events += 1
            name = type(event).__name__.removeprefix("Map")
            getattr(self, f"_{name}")(event)

    def _BlockStored(self, e: Any) -> None:
        bs = e.block_size
        self.block_size = self.block_size or bs
        assert bs == self.block_size and e.medium == "GPU" and e.lora_id is None
        assert len(e.token_ids) == bs * len(e.block_hashes) and e.block_hashes
        parent = e.parent_block_hash
        assert parent is None or parent in self.blocks, "stored under a parent not cached"
        for i, h in enumerate(e.block_hashes):
            tokens = tuple(e.token_ids[i * bs : (i + 1) * bs])
            assert h == block_hash(parent, list(tokens)), "a hash that is not the documented one"
            assert h not in self.blocks, "stored twice"
            assert 0 <= h < 1 << 63
            self.blocks[h] = (parent, tokens)
            parent = h

    def _BlockRemoved(self, e: Any) -> None:
        for h in e.block_hashes:
            assert h in self.blocks, "removed a block never stored"
            del self.blocks[h]

    def _AllBlocksCleared(self, e: Any) -> None:
        self.blocks.clear()

    def hashes(self) -> list[int]:
        """Sorted; every block's parent is cached too (a prefix, not scattered pages)."""
        for parent, _ in self.blocks.values():
            assert parent is None or parent in self.blocks, "a block outlived its parent"
        return sorted(self.blocks)


class Subscription:
    """A SUB socket read by a thread of its own, as a subscriber runs (ZeroMQ attaches a new
    publisher's pipe, and sends it the subscription, only while the SUB socket is in use: one
    read only now and then misses what was published meanwhile), and a DEALER for replays."""

    def __init__(self, layout: str = "array", topic: bytes = b"", bind: bool = True) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.decode = DECODERS[layout].decode
        self.topic = topic
        self.frames = 0
        self.endpoint = ""
        if bind:
            port = self.sub.bind_to_random_port("tcp://127.0.0.1")
            self.endpoint = f"tcp://127.0.0.1:{port}"
        self._got: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, connect: str | None = None) -> Subscription:
        """Start reading (after connecting to `connect`, a publisher that binds)."""
        if connect:
            self.sub.connect(connect)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        while not self._stop.is_set():
            if self.sub.poll(50):
                self._got.put(self.sub.recv_multipart())
        self.sub.close()

    def receive(self, timeout: float) -> tuple[int, Any] | None:
        """One batch (sequence number, decoded), or None after `timeout` seconds."""
        try:
            topic, seq, payload = self._got.get(timeout=timeout)
        except queue.Empty:
            return None
        assert topic == self.topic and len(seq) == 8
        self.frames += 1
        return int.from_bytes(seq, "big", signed=True), self.decode(payload)

    def replay(self, endpoint: str, start: int, timeout: float = 10.0) -> list[tuple[int, Any]]:
        """Every batch from `start` the engine still buffers (vLLM's replay protocol)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            deadline = time.monotonic() + timeout
            while True:
                assert dealer.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "no reply"
                empty, seq, payload = dealer.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert empty == b"" and payload == b""
                    return out
                out.append((n, self.decode(payload)))
        finally:
            dealer.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        else:
            self.sub.close()


def catch_up(
    sub: Subscription, rebuilt: Rebuilt, seq: int, replay: str | None, timeout: float
) -> None:
    """Apply batches until `seq` (from the SUB socket; a gap is filled from `replay`)."""
    deadline = time.monotonic() + timeout
    while rebuilt.seq < seq:
        left = deadline - time.monotonic()
        assert left > 0, f"batch {seq} never came (at {rebuilt.seq})"
        got = sub.receive(min(left, 0.5))
        if got is None:
            continue
        n, batch = got
        if n <= rebuilt.seq:
            continue
        if n > rebuilt.seq + 1:
            assert replay is not None, f"gap before batch {n} and no replay socket"
            for m, b in sub.replay(replay, rebuilt.seq + 1):
                if rebuilt.seq < m < n:
                    rebuilt.apply(m, b)
        rebuilt.apply(n, batch)
