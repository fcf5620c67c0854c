"""The KV event publisher (`--kv-events-endpoint`): vLLM's PUB socket and ROUTER replay socket.

The scheduler's loop hands over each iteration's events after the step is queued (the device
runs it meanwhile): they are encoded (engine/kv_events.py, microseconds) and sent as [topic,
sequence, payload], and the last `REPLAY_BATCHES` payloads are kept for the replay socket. No
thread of its own (scheduler_proc/main.py says why: a send is an enqueue on libzmq's I/O thread; a
Python thread would only add GIL hand-offs beside the step). Nothing here waits: a PUB socket drops
what a slow or absent subscriber cannot take (past its high-water mark), and that subscriber sees a
gap in the sequence numbers and asks the replay socket for the missing batches.

Replay (vLLM's protocol): a REQ or DEALER sends the first sequence number it wants, 8 bytes
big-endian (after an empty delimiter frame); the answer is [sequence, payload] for each batch
still buffered from there on, then [-1, b""]. A long answer goes out `REPLAY_FRAMES` frames a loop
iteration, so it never holds a step up.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator

import msgspec
import zmq

from engine.config import EngineConfig
from engine.kv_events import END_OF_REPLAY, Event, EventBatch, sequence_bytes, wire_events
from scheduler_proc.kv_event_log import KVEventLog
from scheduler_proc.kv_manager import KVManager

log = logging.getLogger("scheduler")

# NOTE: vLLM's defaults: the replay buffer (buffer_steps) and the PUB socket's high-water mark.
REPLAY_BATCHES = 10_000
PUB_HWM = 100_000
REPLAY_FRAMES = 256  # NOTE: ~1 ms of sends a loop iteration at most


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        layout: str,
        page_size: int,
    ) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, PUB_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        bound = attach(self._pub, endpoint)
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._layout, self._page_size = layout, page_size
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._answers: deque[Iterator[list[bytes]]] = deque()  # NOTE: replays under way
        log.info(
            "KV events: %s %s (%s layout), replay %s",
            "bound to" if bound else "connecting to",
            endpoint,
            layout,
            replay_endpoint or "off",
        )
        if bound and not endpoint.startswith(("ipc://", "inproc://")):
            log.warning(
                "KV events: %s listens on every interface; whoever reaches it reads every "
                "cached prompt's token ids",
                endpoint,
            )

    def put(self, seq: int, events: list[Event]) -> bool:
        """Send batch `seq`; False when it could not be (logged)."""
        try:
            batch = EventBatch(time.time(), wire_events(events, self._layout, self._page_size), 0)
            payload = self._encoder.encode(batch)
            seq_bytes = sequence_bytes(seq)
            self._pub.send_multipart([self._topic, seq_bytes, payload], flags=zmq.NOBLOCK)
        except Exception:  # NOTE: the engine goes on; the next batch resyncs (kv_event_log.py)
            log.exception("KV events: batch %d not sent", seq)
            return False
        self._buffer.append((seq_bytes, payload))
        return True

    def serve_replays(self) -> None:
        """Take replay requests and send what is due of the answers under way."""
        if self._replay is None:
            return
        while self._replay.poll(0):
            self._take_request(self._replay.recv_multipart())
        budget = REPLAY_FRAMES
        while self._answers and budget:
            frames = next(self._answers[0], None)
            if frames is None:
                self._answers.popleft()
                continue
            self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
            budget -= 1

    def _take_request(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        peer, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        due = [(s, p) for s, p in self._buffer if int.from_bytes(s, "big", signed=True) >= start]
        answer = ([peer, b"", s, p] for s, p in due)
        self._answers.append(iter([*answer, [peer, b"", END_OF_REPLAY, b""]]))

    def close(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()


def attach(sock: zmq.Socket, endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard address (`tcp://*:PORT`, `::`), ipc:// or inproc://; connect
    to anything else (the subscriber binds). Returns whether it bound."""
    bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return bind


class KVEvents:
    """The scheduler's KV events: the log on its prefix cache and the publisher it feeds."""

    def __init__(self, config: EngineConfig, kv: KVManager) -> None:
        assert config.kv_events_endpoint and kv.prefix is not None, "KV events need the cache"
        self.publisher = KVEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            config.kv_events_topic,
            config.kv_events_format,
            kv.pages.page_size,
        )
        kv.events = self.log = KVEventLog(kv.prefix.tree, kv.pages.page_size, self.publisher.put)

    def publish(self) -> None:
        """Once a loop iteration, after the step is queued."""
        self.log.publish()
        self.publisher.serve_replays()

    def close(self) -> None:
        self.log.publish()
        self.publisher.close()


def open_kv_events(config: EngineConfig, kv: KVManager) -> KVEvents | None:
    """The publisher when `--kv-events-endpoint` is set (validate() refuses it without the cache)."""
    return KVEvents(config, kv) if config.kv_events_endpoint and kv.prefix is not None else None
