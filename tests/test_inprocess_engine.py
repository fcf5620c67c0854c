"""The in-process engine when its own loop fails: callers get EngineDead, nothing hangs."""

from __future__ import annotations

import pytest

from engine.client import EngineClient
from engine.errors import EngineDead
from mlx_engine.inprocess import InProcessEngine


def test_a_crashed_loop_fails_waiting_calls_and_spares_the_mlx_thread(tiny_model_dir):
    transport = InProcessEngine(str(tiny_model_dir), max_total_tokens=8192)
    client = EngineClient(transport=transport, timeout=30.0)

    def crash():
        raise RuntimeError("bookkeeping bug")

    transport.sched.step = crash  # NOTE: Scheduler.step catches device failures; this is past it
    with pytest.raises(EngineDead, match="bookkeeping bug"):
        client.generate(input_ids=[1, 2, 3], max_tokens=4, temperature=0.0)
    with pytest.raises(EngineDead):
        client.generate(input_ids=[1, 2, 3], max_tokens=4, temperature=0.0)
    client.close()

    # The one long-lived MLX thread survived: a new in-process engine serves.
    again = EngineClient(transport=InProcessEngine(str(tiny_model_dir)), timeout=30.0)
    try:
        result = again.generate(input_ids=[1, 2, 3], max_tokens=4, temperature=0.0)
        assert len(result.token_ids) == 4
    finally:
        again.close()
