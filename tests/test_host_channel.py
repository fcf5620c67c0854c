"""The frame links of `--tp` (scheduler_proc/host_channel.py) over a socket pair, in one process."""

from __future__ import annotations

import socket

import pytest

from scheduler_proc.host_channel import HostBroadcast, PeerLost

pytestmark = pytest.mark.timeout(30)


def _pair() -> tuple[HostBroadcast, HostBroadcast]:
    a, b = socket.socketpair()
    return HostBroadcast(0, 2, {1: a}), HostBroadcast(1, 2, {0: b})


def test_a_worker_that_left_after_its_last_frame_is_not_a_lost_rank():
    """A worker runs one iteration ahead: it read the last frame, sent its header and closed
    while rank 0 was still in its last step. Rank 0 has every header it needs; the closed link
    must not read as a rank lost (it failed `scripts/bench_tp_frames.py` on a loaded box)."""
    root, worker = _pair()
    root.start(1, 7)
    worker.start(1, 7)
    worker.finish()
    worker.start(2, 7)  # NOTE: one ahead: its header of step 2 is sent before rank 0's frame
    root.finish()  # NOTE: reads headers 1 and 2, checks 1 (2 waits for rank 0's own step 2)
    root.start(2, 7)
    worker.finish()
    worker.close()  # NOTE: its last frame read, it leaves
    root.finish()  # NOTE: header 2 is here; the link's end must not fail it
    root.close()


def test_a_worker_lost_before_a_header_rank_0_needs_is_reported():
    root, worker = _pair()
    root.start(1, 7)
    worker.start(1, 7)
    worker.finish()
    root.finish()
    root.start(2, 7)
    worker.close()  # NOTE: died without its header of step 2
    root.finish()  # NOTE: step 2 needs header 1 only
    with pytest.raises(PeerLost, match="rank 1"):
        root.start(3, 7)  # NOTE: its frame finds the link gone, or
        root.finish()  # header 2 never comes
