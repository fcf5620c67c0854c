"""What both scheduler loops share (main.py: one process; replicated.py: every tensor-parallel
rank): their timings."""

from __future__ import annotations

HEARTBEAT_S = 0.5
IDLE_WAIT_S = 0.05
IDLE_CLEAR_S = 1.0
# NOTE: after the grace period every request is aborted; a scheduler that still has not reported
# them all by then is stuck, and the loop gives up waiting (terminal outputs are synthesized).
ABORT_SETTLE_S = 5.0
