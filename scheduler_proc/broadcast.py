"""Rank 0's inbox, sent to every tensor-parallel rank: one collective per loop iteration.

A frame is one `all_sum` of int32 words: a header slot per rank (step number, state fingerprint,
and from rank 0 the length of the next frame's payload), then rank 0's payload (length-prefixed
commands, zero padded); every other rank contributes zeros there, so the sum is rank 0's bytes.
Each rank checks every header: a different step or fingerprint is fatal (`Diverged`).

NOTE: the payload length is announced one frame ahead, so a frame's shape is known to every rank
without a second collective; a command therefore takes effect one iteration after it was posted.
The frame is queued (`async_eval`) before the step and read after it: it runs on the same stream
as the model's own collectives, in the same order on every rank, between two queued steps.

`--tp-frames collective` chooses this path; the default carries the same frames over host sockets
(scheduler_proc/host_channel.py). Both are a `Channel`.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Protocol

import mlx.core as mx
import numpy as np

from engine.messages.to_ranks import RankCommand
from engine.protocol import Codec

HEADER = struct.Struct("<qqq")  # step, fingerprint, next payload bytes
LEN = struct.Struct("<I")
MIN_PAYLOAD = 256
# NOTE: a frame carries the commands that fit; the rest go in the next ones (a prompt bigger
# than this still goes alone, in a frame of its own size).
MAX_PAYLOAD = 4 << 20


class Diverged(RuntimeError):
    """The ranks are no longer in the same state: the engine cannot go on."""


class Channel(Protocol):
    """How rank 0's commands reach every rank, one frame per loop iteration."""

    rank: int
    size: int
    bytes_sent: int
    polls: bool  # NOTE: a worker waiting for a frame spins a core (the loop naps when idle)

    def post(self, cmd: RankCommand) -> None: ...
    def busy(self) -> bool: ...
    def start(self, step: int, fingerprint: int) -> None: ...
    def finish(self) -> list[RankCommand]: ...
    def close(self) -> None: ...


def check_same(rank: int, step: int, fp: int, step0: int, fp0: int) -> None:
    """A rank's header against rank 0's: a different step or state is fatal."""
    if (step, fp) != (step0, fp0):
        raise Diverged(
            f"rank {rank} is at step {step} with state {fp:#x}; rank 0 at step {step0} "
            f"with state {fp0:#x}"
        )


def encode_command(codec: Codec[RankCommand], cmd: RankCommand) -> bytes:
    data = codec.encode(cmd)
    return LEN.pack(len(data)) + data


def decode_commands(codec: Codec[RankCommand], payload: memoryview) -> list[RankCommand]:
    """Length-prefixed commands, up to a zero length or the payload's end."""
    cmds: list[RankCommand] = []
    at = 0
    while at + LEN.size <= len(payload):
        (n,) = LEN.unpack_from(payload, at)
        if n == 0:
            break
        cmds.append(codec.decode(payload[at + LEN.size : at + LEN.size + n]))
        at += LEN.size + n
    return cmds


class Broadcast:
    polls = True  # NOTE: the ring busy-polls (94 % of a core measured)

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self._codec: Codec[RankCommand] = Codec(RankCommand)
        self._queue: deque[bytes] = deque()  # rank 0: encoded commands not yet announced
        self._next = b""  # rank 0: the payload announced in the last frame
        self._len = 0  # payload bytes of the coming frame, agreed by the last one
        self._frame: mx.array | None = None
        self.bytes_sent = 0  # frames' payload bytes, padding included

    def post(self, cmd: RankCommand) -> None:
        """Rank 0: send `cmd` to every rank (applied by all at the same iteration)."""
        self._queue.append(encode_command(self._codec, cmd))

    def busy(self) -> bool:
        """Rank 0: commands posted and not yet delivered (the loop must not idle)."""
        return bool(self._queue or self._next or self._len)

    def start(self, step: int, fingerprint: int) -> None:
        """Queue this iteration's frame; nothing blocks."""
        head = self.size * HEADER.size
        buf = bytearray(head + self._len)
        announce = 0
        if self.rank == 0:
            buf[head : head + len(self._next)] = self._next
            self._next = self._take()
            announce = _bucket(len(self._next)) if self._next else 0
        buf[self.rank * HEADER.size : (self.rank + 1) * HEADER.size] = HEADER.pack(
            step, fingerprint, announce
        )
        self.bytes_sent += self._len
        words = np.frombuffer(bytes(buf), dtype=np.int32)
        self._frame = mx.distributed.all_sum(mx.array(words), group=self.group)
        mx.async_eval(self._frame)

    def finish(self) -> list[RankCommand]:
        """Wait for this iteration's frame, check every rank's header, return the commands."""
        assert self._frame is not None, "finish() without start()"
        data = np.array(self._frame).tobytes()
        self._frame = None
        heads = [HEADER.unpack_from(data, r * HEADER.size) for r in range(self.size)]
        step0, fp0, announce = heads[0]
        for r, (step, fp, _) in enumerate(heads):
            check_same(r, step, fp, step0, fp0)
        self._len = announce
        return decode_commands(self._codec, memoryview(data)[self.size * HEADER.size :])

    def close(self) -> None:
        pass

    def _take(self) -> bytes:
        parts: list[bytes] = []
        total = 0
        while self._queue and (not parts or total + len(self._queue[0]) <= MAX_PAYLOAD):
            parts.append(self._queue.popleft())
            total += len(parts[-1])
        return b"".join(parts)


def _bucket(n: int) -> int:
    """Payload bytes rounded up to a power of two (a few frame shapes), whole int32 words, and
    room for the zero length that ends the commands."""
    size = MIN_PAYLOAD
    while size < n + LEN.size:
        size *= 2
    return size
