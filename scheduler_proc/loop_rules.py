"""What both scheduler loops share (main.py: one process; replicated.py: every tensor-parallel
rank): their timings, the drain rule, and how a tokenized request goes in."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from engine.errors import EngineError, ShuttingDown
from engine.messages.to_detokenizer import Register
from engine.messages.to_scheduler import TokenizedRequest
from engine.messages.to_tokenizer import RequestFailed
from engine.wire_errors import to_failure

log = logging.getLogger("scheduler")

HEARTBEAT_S = 0.5
IDLE_WAIT_S = 0.05
IDLE_CLEAR_S = 1.0
# NOTE: after the grace period every request is aborted; a scheduler that still has not reported
# them all by then is stuck, and the loop gives up waiting (terminal outputs are synthesized).
ABORT_SETTLE_S = 5.0


class Draining:
    """Graceful shutdown, one rule for both loops: after `begin(grace)` new requests are refused;
    at the deadline every request still in flight is aborted, once; ABORT_SETTLE_S after that the
    loop stops waiting for their reports (terminal outputs are synthesized at exit)."""

    def __init__(self) -> None:
        self.deadline: float | None = None
        self.aborted_at: float | None = None

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def begin(self, grace: float, running: int) -> bool:
        """Start draining; False when already draining."""
        if self.deadline is not None:
            return False
        log.info("draining: %d running request(s), grace %.1fs", running, grace)
        self.deadline = time.monotonic() + grace
        return True

    def due(self, sched: Any, now: float) -> list[str]:
        """The requests to abort now: all still in flight, once the grace is over."""
        if self.deadline is None or self.aborted_at is not None or now < self.deadline:
            return []
        live = list(sched.in_flight())
        if live:
            log.info("grace period over; aborting %d request(s)", len(live))
            self.aborted_at = now
        return live

    def exit_reason(self, sched: Any, now: float, busy: bool = False) -> str:
        """Why the loop may stop now ("" while it must go on); `busy`: commands not yet applied
        (tensor parallel's broadcast)."""
        if self.deadline is None:
            return ""
        if self.aborted_at is not None and now > self.aborted_at + ABORT_SETTLE_S:
            return "aborts not settled"
        if not sched.in_flight() and not sched.has_work() and not busy:
            return "drained"
        return ""


class IdleClock:
    """A scheduler idle for IDLE_CLEAR_S goes idle (`went_idle`: its pool shrinks, its cached
    buffers go back), once, not at every gap between requests, whose next one would allocate
    them again. `busy()` after every step, `idle(sched)` when there was nothing to run."""

    def __init__(self) -> None:
        self._since: float | None = None

    def busy(self) -> None:
        self._since = None

    def idle(self, sched: Any) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
        elif now - self._since > IDLE_CLEAR_S:
            sched.went_idle()
            self._since = math.inf  # NOTE: done; nothing more until the next work


def submit(sched: Any, msg: TokenizedRequest, draining: bool, tell: Callable[[Any], None]) -> None:
    """A tokenized request into the scheduler, or its refusal told; `Register` first, on the
    outputs' socket, so the detokenizer knows its stop strings before its first token."""
    tell(Register(msg.rid, list(msg.params.stop)))
    try:
        if draining:
            raise ShuttingDown("the engine is shutting down")
        # NOTE: the front door checked prompt and params against this scheduler's facts.
        sched.submit(
            msg.rid, msg.input_ids, msg.params, checked=True, client=msg.client, shared=msg.shared
        )
    except EngineError as e:
        log.info("rid=%s refused: %s", msg.rid, e)
        tell(RequestFailed(to_failure(msg.rid, e)))
    except Exception as e:
        if not sched.contain_errors:  # NOTE: tensor parallel: nothing can be trusted; fatal
            raise
        log.exception("rid=%s submit failed", msg.rid)  # NOTE: one bad request, not the engine
        tell(RequestFailed(to_failure(msg.rid, EngineError(f"{type(e).__name__}: {e}"))))
