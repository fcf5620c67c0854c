"""The step log's rules (`step_times.py`): a step over 10x its kind's median is counted and
logged, and so is a stall over 1 s before the kind has a median; ordinary steps are not."""

from __future__ import annotations

import logging

import pytest

from scheduler_proc.batch import Batch
from scheduler_proc.step_times import StepTimes

pytestmark = pytest.mark.timeout(60)


def _step(times: StepTimes, now: float, took: float, index: int) -> float:
    batch = Batch(step_index=index, launch_ts=now)
    times.add(batch, now + took)
    return now + took


def test_slow_steps_and_early_stalls_are_counted_and_logged(caplog):
    times = StepTimes()
    caplog.set_level(logging.WARNING, logger="scheduler_proc.step_times")
    now = _step(times, 0.0, 0.5, 1)  # NOTE: slow, but under the stall bound, no median yet
    assert times.slow_steps == 0
    now = _step(times, now, 1.5, 2)  # NOTE: a stall before there is a median
    assert times.slow_steps == 1 and "step 2 (decode, 0 rows) took 1500 ms (" in caplog.text
    for i in range(20):
        now = _step(times, now, 0.01, 3 + i)
    now = _step(times, now, 0.08, 30)  # NOTE: 8x the median: not slow
    assert times.slow_steps == 1
    _step(times, now, 0.2, 31)
    assert times.slow_steps == 2 and "the median decode step" in caplog.text
    assert times.stats()["step_worst_s"] == 1.5
