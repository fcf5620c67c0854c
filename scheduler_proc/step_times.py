"""How long steps take, by kind, and the ones that stand out (logged with their shape).

A decode step's time is what the host waited for its tokens once it was free to wait: from its
launch, or from the previous step's tokens when it was queued behind them (overlap). Prefill steps
have no tokens to wait for; their time shows in the decode step after them (counted from the first
of them, kept out of the medians, and named in its log line; with no row decoding they held nobody,
and are not judged). A step over `SLOW_FACTOR` times the median of its kind, or one whose shape was
first seen after warm-up, gets a log line: that is how a shape warm-up missed shows itself (a GPU
compiles it, seconds on first use).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from scheduler_proc.batch import Batch

log = logging.getLogger(__name__)

SLOW_FACTOR = 10.0
_MIN_SAMPLES = 16
_MIN_SLOW_S = 0.05  # NOTE: below this a "slow" step is noise, not a stall
_STALL_S = 1.0  # NOTE: logged whatever the median, even before there is one
# NOTE: at most one slow-step line per interval, with a count of those held back: a flood that
# slows every step (a full batch on a CPU) wrote a line a step, 170 KB in 20 s.
LOG_EVERY_S = 5.0


class StepTimes:
    def __init__(self, window: int = 512) -> None:
        self._times: dict[str, deque[float]] = {}
        self._window = window
        self._free_since = 0.0
        self._prefills: list[Batch] = []  # launched since the last decode step's tokens
        self.slow_steps = 0
        self.new_shapes = 0
        self.worst_s = 0.0
        self._quiet_until = -LOG_EVERY_S
        self._held = 0  # slow steps not logged since the last line
        self._held_worst = 0.0

    def launched(self, batch: Batch) -> None:
        """A prefill step went to the device: its time shows in the next decode step's."""
        if batch.is_prefill:
            self._prefills.append(batch)
            self.new_shapes += batch.new_shape

    def add(self, batch: Batch, now: float) -> float | None:
        """A decode step's tokens reached the host. Returns the wall seconds since the previous
        decode step's tokens when no prefill step ran between them (None otherwise): the pace
        its rows saw, host work included."""
        assert batch.launch_ts is not None
        before, self._prefills = self._prefills, []
        start = before[0].launch_ts if before else batch.launch_ts
        dt = now - max(start or 0.0, self._free_since)
        interval = now - self._free_since if self._free_since and not before else None
        self._free_since = now
        kind = "chained" if batch.chained else ("joined" if batch.joined else "decode")
        times = self._times.setdefault(kind, deque(maxlen=self._window))
        # NOTE: prefill steps delay the decoding rows' next tokens; with none decoding (a long
        # prompt alone, its last token joining) they held nobody, and the time is that prompt's
        # first token's (TTFT): a 30k-token prompt's 56 prefill steps had read as one 770 ms
        # "stall" in every long-context run.
        held = bool(batch.decode) or not before
        if held:
            self.worst_s = max(self.worst_s, dt)
        self.new_shapes += batch.new_shape
        new = [b.shape for b in (*before, batch) if b.new_shape]
        if new:
            log.info(
                "step %d: %.0f ms with shapes first seen after warm-up %s (%s)",
                batch.step_index,
                dt * 1e3,
                new,
                _after(before),
            )
        elif held:
            slow = self._slow(dt, times, kind)
            if slow is not None:
                self.slow_steps += 1
                self._log_slow(batch, kind, dt, slow + f" ({_after(before)})", now)
        if not before:
            times.append(dt)
        return interval

    def _log_slow(self, batch: Batch, kind: str, dt: float, why: str, now: float) -> None:
        if now < self._quiet_until:
            self._held += 1
            self._held_worst = max(self._held_worst, dt)
            return
        held = ""
        if self._held:
            held = f"; {self._held} more slow step(s) before it, the worst {self._held_worst * 1e3:.0f} ms"
        log.warning(
            "step %d (%s, %d rows) took %.0f ms%s%s",
            batch.step_index,
            kind,
            len(batch.rows),
            dt * 1e3,
            why,
            held,
        )
        self._quiet_until = now + LOG_EVERY_S
        self._held, self._held_worst = 0, 0.0

    def _slow(self, dt: float, times: deque[float], kind: str) -> str | None:
        """Why a step is worth a log line ("" when no kind has a median yet), or None.

        NOTE: a kind short of samples (joined steps follow prefill steps, whose time they hold,
        so they rarely get any) is judged by the kind with the most: with a plain 1 s rule a
        CPU's every 64-row joined step (1.0-1.5 s, its decode steps as long) was a warning."""
        if dt <= _MIN_SLOW_S:  # NOTE: most steps: no median computed
            return None
        if len(times) < _MIN_SAMPLES:
            kind, times = max(self._times.items(), key=lambda kt: len(kt[1]), default=(kind, times))
        if len(times) < _MIN_SAMPLES:
            return "" if dt > _STALL_S else None
        median = statistics.median(times)
        return f", {dt / median:.0f}x the median {kind} step" if dt > SLOW_FACTOR * median else None

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            "steps_slow": self.slow_steps,
            "steps_new_shape": self.new_shapes,
            "step_worst_s": round(self.worst_s, 4),
        }
        for kind, times in self._times.items():
            if times:
                out[f"step_median_{kind}_s"] = round(statistics.median(times), 5)
        return out


def _after(prefills: list[Batch]) -> str:
    if not prefills:
        return "no prefill step before it"
    shapes = ", ".join(str(b.shape) for b in prefills[:4]) + ", ..." * (len(prefills) > 4)
    return f"after {len(prefills)} prefill steps: {shapes}"
