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
    _step(times, now + 10.0, 0.2, 31)  # NOTE: after the log's quiet interval
    assert times.slow_steps == 2 and "the median decode step" in caplog.text
    assert times.stats()["step_worst_s"] == 1.5


def test_a_kind_without_samples_is_judged_by_the_kind_with_most(caplog):
    """Joined steps follow prefill steps and rarely get samples of their own: on a CPU every
    1-1.5 s joined step was logged as a stall although decode steps took as long."""
    times = StepTimes()
    caplog.set_level(logging.WARNING, logger="scheduler_proc.step_times")
    now = 0.0
    for i in range(20):
        now = _step(times, now, 1.2, 1 + i)
    early = times.slow_steps  # NOTE: the first 16, before any median, are stalls over 1 s
    caplog.clear()
    joined = Batch(step_index=30, launch_ts=now)
    joined.joined = [object()]  # type: ignore[list-item]
    times.add(joined, now + 1.4)
    assert times.slow_steps == early and not caplog.text, caplog.text
    late = Batch(step_index=31, launch_ts=now + 2)
    late.joined = [object()]  # type: ignore[list-item]
    times.add(late, now + 2 + 13.0)
    assert (
        times.slow_steps == early + 1
        and "(joined, 1 rows) took 13000 ms, 11x the median decode" in caplog.text
    )


def test_a_run_of_slow_steps_is_one_line_per_interval_with_a_count(caplog):
    """A flood that slows every step logs once per LOG_EVERY_S, not once a step; each step is
    still counted."""
    times = StepTimes()
    caplog.set_level(logging.WARNING, logger="scheduler_proc.step_times")
    now = 0.0
    for i in range(20):
        now = _step(times, now, 0.01, 1 + i)
    for i in range(60):  # NOTE: a slow step among 3 quick ones (the median stays 10 ms): 13.8 s
        now = _step(times, now, 0.2, 100 + 4 * i)
        for j in range(3):
            now = _step(times, now, 0.01, 101 + 4 * i + j)
    lines = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert times.slow_steps == 60 and len(lines) == 3, lines
    assert "21 more slow step(s) before it, the worst 200 ms" in lines[1], lines


def _prefill(times: StepTimes, now: float, index: int) -> None:
    batch = Batch(step_index=index, launch_ts=now)
    batch.slices = [object()]  # type: ignore[list-item]
    times.launched(batch)


def test_prefill_steps_with_no_row_decoding_are_no_stall(caplog):
    """A long prompt alone: its prefill steps, then its last token's joined step, held no
    decoding row (every long-context run logged its ~770 ms as the worst step, a stall). The
    same steps beside a decoding row are still its stall."""
    times = StepTimes()
    caplog.set_level(logging.WARNING, logger="scheduler_proc.step_times")
    now = 0.0
    for i in range(20):
        now = _step(times, now, 0.01, 1 + i)
    for i in range(56):
        _prefill(times, now + 0.001 * i, 30 + i)
    alone = Batch(step_index=90, launch_ts=now + 0.06)
    alone.joined = [object()]  # type: ignore[list-item]
    times.add(alone, now + 0.77)
    assert times.slow_steps == 0 and not caplog.text, caplog.text
    assert times.stats()["step_worst_s"] < 0.1
    now += 11.0
    for i in range(4):
        _prefill(times, now + 0.001 * i, 100 + i)
    beside = Batch(step_index=110, launch_ts=now + 0.01)
    beside.decode = [object()]  # type: ignore[list-item]
    times.add(beside, now + 0.5)
    assert times.slow_steps == 1 and "after 4 prefill steps" in caplog.text, caplog.text
    assert times.stats()["step_worst_s"] == 0.5
