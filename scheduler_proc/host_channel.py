"""Rank 0's inbox sent to every tensor-parallel rank over host TCP sockets, off the device.

The frames of `Broadcast` (scheduler_proc/broadcast.py), carried by the host instead of a
collective. Each iteration rank 0 sends its frame (step number, state fingerprint, the commands)
to every rank before its step, and every other rank sends its own step and fingerprint back.
After the step each rank reads what it was sent and checks it: a worker compares rank 0's header
with its own at once, rank 0 every worker's (at most one frame late: see `finish`), so a drifted
rank stops the ranks (`Diverged`), and the commands apply at the same iteration everywhere.

Why beside the group rather than on it: a collective of the frame runs on the device's stream
(NCCL on GPUs) and is waited for every iteration; here the frame sits in the host's socket
buffer before the step it belongs to is launched, so reading it after the step is one `recv`.
Besides, a lost peer is an end of file on its socket (fatal at once: `PeerLost`), a worker
waiting for a frame sleeps in `recv` instead of spinning in the ring, and a command applies in
the iteration it is sent (the frame carries its length: nothing is announced a frame ahead).

The links are a star: rank 0 listens at `frame_address(hostfile)` (engine/distributed.py: rank
0's IP, one port above the hostfile's highest); each worker connects and says hello with its rank
and a token rank 0 handed every rank through the group (one `all_gather` at start-up), so a stray
or stale connection is never taken for a rank.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
from typing import Any

from engine.distributed import frame_address
from engine.messages.to_ranks import RankCommand
from engine.protocol import Codec
from scheduler_proc.broadcast import HEADER, check_same, decode_commands, encode_command

log = logging.getLogger("scheduler")

HELLO = struct.Struct("<qq")  # rank, token
HELLO_TIMEOUT_S = 5.0  # NOTE: a connection that says nothing is not a rank


class PeerLost(ConnectionError):
    """A rank's frame link closed or failed: that rank died or left; the engine cannot go on."""


class HostBroadcast:
    polls = False  # NOTE: a worker waiting for its frame sleeps in recv

    def __init__(self, rank: int, size: int, peers: dict[int, socket.socket]) -> None:
        self.rank, self.size = rank, size
        self._peers = peers  # rank 0: every worker's socket; a worker: {0: rank 0's}
        self._codec: Codec[RankCommand] = Codec(RankCommand)
        self._queue: list[bytes] = []  # rank 0: encoded commands for the next frame
        self._payload = b""  # rank 0: this iteration's commands, applied at finish()
        self._unsent: dict[int, memoryview] = {}  # rank 0: what a full socket did not take
        self._mine = (0, 0)  # this rank's step and fingerprint
        self._sent: dict[int, int] = {}  # rank 0: its fingerprint of each step not yet acked
        self._acked = dict.fromkeys(peers, 0)  # rank 0: each worker's last step checked
        self._inbox = {r: bytearray() for r in peers}  # rank 0: header bytes not yet checked
        self.bytes_sent = 0  # frames' payload bytes (once per frame, not per rank)

    def post(self, cmd: RankCommand) -> None:
        """Rank 0: send `cmd` to every rank (applied by all at the same iteration)."""
        self._queue.append(encode_command(self._codec, cmd))

    def busy(self) -> bool:
        """Rank 0: commands posted and not yet sent (the loop must not idle)."""
        return bool(self._queue)

    def start(self, step: int, fingerprint: int) -> None:
        """Send this iteration's frame (rank 0) or header (the others); nothing blocks."""
        self._mine = (step, fingerprint)
        if self.rank != 0:
            self._send_all(0, HEADER.pack(step, fingerprint, 0))  # NOTE: 24 bytes, always room
            return
        self._sent[step] = fingerprint
        self._payload = b"".join(self._queue)
        self._queue.clear()
        self.bytes_sent += len(self._payload)
        frame = HEADER.pack(step, fingerprint, len(self._payload)) + self._payload
        for r in self._peers:
            self._send_some(r, frame)

    def finish(self) -> list[RankCommand]:
        """Read what this iteration's frame brought, check the headers, return the commands."""
        if self.rank != 0:
            step0, fp0, n = HEADER.unpack(self._recv(0, HEADER.size))
            payload = self._recv(0, n)
            check_same(self.rank, *self._mine, step0, fp0)
            return decode_commands(self._codec, memoryview(payload))
        # NOTE: a frame too big for the socket's buffer is finished here, after the step: every
        # worker reads it after its own step, which needs nothing more from rank 0.
        for r, rest in list(self._unsent.items()):
            self._send_all(r, rest)
        self._unsent.clear()
        # NOTE: a worker's header of this step may still be on its way (it is sent after the
        # worker's previous step, which may end after rank 0's): rank 0 waits only for the one
        # before, so it never waits on a worker's host work in steady stepping, and checks
        # this one now if it is here. A worker lags one iteration at most.
        step = self._mine[0]
        for r in self._peers:
            self._check_acks(r, step - 1)
        for s in [s for s in self._sent if s <= min(self._acked.values(), default=step)]:
            del self._sent[s]
        return decode_commands(self._codec, memoryview(self._payload))

    def close(self) -> None:
        """After the last frame: rank 0 reads every header still coming, so no link closes with
        unread bytes (that would reset it under a worker still reading its last frame)."""
        for r in self._peers if self.rank == 0 else ():
            if self._acked[r] < self._mine[0]:  # NOTE: else the link may be closed already
                self._check_acks(r, self._mine[0])
        for sock in self._peers.values():
            sock.close()

    def _check_acks(self, r: int, need: int) -> None:
        """Check every header worker r sent so far, waiting for the one of step `need`.

        NOTE: one non-blocking recv takes whatever arrived; a blocking one only when `need` has
        not. Each syscall here costs rank 0 tens of microseconds while the step in flight
        shares its core, so there are as few as the headers allow (one, stepping).
        """
        gone: PeerLost | None = None
        try:
            self._inbox[r] += self._read(r, block=False)
        except PeerLost as e:
            # NOTE: a worker one header ahead leaves once it has read its last frame, maybe
            # while rank 0 is still in its own last step: its end matters only when a header
            # this iteration needs is missing (a worker that died is caught one step later).
            gone = e
        while True:
            self._take_headers(r)
            if self._acked[r] >= need:
                return
            if gone is not None:
                raise gone
            self._inbox[r] += self._read(r, block=True)

    def _take_headers(self, r: int) -> None:
        """Check worker r's headers received so far, up to rank 0's own step.

        NOTE: a worker may be one header ahead (it sends the next one as soon as it has this
        frame): that one waits for rank 0's own next step."""
        buf = self._inbox[r]
        while len(buf) >= HEADER.size and self._acked[r] < self._mine[0]:
            step, fp, _ = HEADER.unpack_from(buf)
            del buf[: HEADER.size]
            want = self._acked[r] + 1
            check_same(r, step, fp, want, self._sent[want])
            self._acked[r] = step

    def _read(self, r: int, block: bool) -> bytes:
        """What worker r's link holds now (without `block`, maybe nothing); its end is fatal."""
        try:
            data = self._peers[r].recv(1 << 16, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return b""
        except OSError as e:
            raise self._lost(r, e) from e
        if not data:
            raise self._lost(r, None)
        return data

    def _send_some(self, r: int, frame: bytes) -> None:
        try:
            sent = self._peers[r].send(frame, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise self._lost(r, e) from e
        if sent < len(frame):
            self._unsent[r] = memoryview(frame)[sent:]

    def _send_all(self, r: int, data: bytes | memoryview) -> None:
        try:
            self._peers[r].sendall(data)
        except OSError as e:
            raise self._lost(r, e) from e

    def _recv(self, r: int, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = self._peers[r].recv_into(view[got:])
            except OSError as e:
                raise self._lost(r, e) from e
            if k == 0:
                raise self._lost(r, None)
            got += k
        return buf

    def _lost(self, r: int, e: OSError | None) -> PeerLost:
        why = f" ({e})" if e else ""
        return PeerLost(f"rank {r}'s frame link closed{why}: that rank died or left")


def open_host_channel(group: Any, hosts: tuple[tuple[str, ...], ...]) -> HostBroadcast:
    """Form the star of frame links; call it under the group's start-up deadline (a watchdog)."""
    rank, size = group.rank(), group.size()
    ip, port = frame_address(hosts)
    # NOTE: rank 0 listens before the token exchange, so no worker ever connects too early.
    listener = _listen(ip, port) if rank == 0 else None
    token = _share_token(group, secrets.randbits(62) if rank == 0 else 0)
    if listener is None:
        peers = {0: _connect(ip, port, rank, token)}
    else:
        with listener:
            peers = _accept(listener, size, token)
    log.info("rank %d: frame links over TCP (rank 0 at %s:%d)", rank, ip, port)
    return HostBroadcast(rank, size, peers)


def _listen(ip: str, port: int) -> socket.socket:
    try:
        return socket.create_server((ip, port), backlog=64)
    except OSError as e:
        raise OSError(
            f"rank 0 cannot listen for the frame links on {ip}:{port} ({e}): that port (one "
            "above the hostfile's highest) must be free, or use --tp-frames collective"
        ) from e


def _share_token(group: Any, token: int) -> int:
    """Rank 0's token, known to every rank (int64 as int32 words: every backend has int32)."""
    import mlx.core as mx
    import numpy as np

    words = np.asarray([token], dtype=np.int64).view(np.int32)
    got = np.array(mx.distributed.all_gather(mx.array(words), group=group))
    return int(got.view(np.int64).reshape(group.size())[0])


def _connect(ip: str, port: int, rank: int, token: int) -> socket.socket:
    sock = socket.create_connection((ip, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(HELLO.pack(rank, token))
    return sock


def _accept(listener: socket.socket, size: int, token: int) -> dict[int, socket.socket]:
    peers: dict[int, socket.socket] = {}
    while len(peers) < size - 1:
        sock, addr = listener.accept()
        sock.settimeout(HELLO_TIMEOUT_S)
        try:
            rank, theirs = HELLO.unpack(_read_hello(sock))
        except OSError as e:
            log.warning("frame links: %s said no hello (%s); ignored", addr, e)
            sock.close()
            continue
        if theirs != token or not 0 < rank < size or rank in peers:
            log.warning(
                "frame links: %s is not a rank of this engine (rank %d); ignored", addr, rank
            )
            sock.close()
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peers[rank] = sock
    return dict(sorted(peers.items()))


def _read_hello(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < HELLO.size:
        part = sock.recv(HELLO.size - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return data
