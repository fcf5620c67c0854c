"""How long steps take, by kind, and the ones that stand out (logged with their shape).

A step's time is what the host waited for its tokens once it was free to wait: from its launch,
or from the previous step's tokens when it was queued behind them (overlap). Prefill steps have no
tokens to wait for; their time shows in the decode step after them. A step over `SLOW_FACTOR`
times the median of its kind, or one whose shape was first seen after warm-up, gets a log line:
that is how a shape warm-up missed shows itself (a GPU compiles it, seconds on first use).
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


class StepTimes:
    def __init__(self, window: int = 512) -> None:
        self._times: dict[str, deque[float]] = {}
        self._window = window
        self._free_since = 0.0
        self.slow_steps = 0
        self.new_shapes = 0
        self.worst_s = 0.0

    def add(self, batch: Batch, now: float) -> None:
        assert batch.launch_ts is not None
        dt = now - max(batch.launch_ts, self._free_since)
        self._free_since = now
        kind = "chained" if batch.chained else ("joined" if batch.joined else "decode")
        times = self._times.setdefault(kind, deque(maxlen=self._window))
        self.worst_s = max(self.worst_s, dt)
        if batch.new_shape:
            self.new_shapes += 1
            ms = dt * 1e3
            log.info(
                "step %d: shape %s first seen after warm-up: %.0f ms",
                batch.step_index,
                batch.new_shape,
                ms,
            )
        elif dt > _MIN_SLOW_S and len(times) >= _MIN_SAMPLES:
            median = statistics.median(times)
            if dt > SLOW_FACTOR * median:
                self.slow_steps += 1
                log.warning(
                    "step %d (%s, %d rows) took %.0f ms, %.0fx the median %s step",
                    batch.step_index,
                    kind,
                    len(batch.rows),
                    dt * 1e3,
                    dt / median,
                    kind,
                )
        times.append(dt)

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
