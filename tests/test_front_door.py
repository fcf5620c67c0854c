"""Nothing slow holds the front door: while the pool tokenizes one client's huge input,
other clients' calls are read and answered."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
from engine_harness import LaunchedEngine, bounded  # noqa: F401

from engine.messages import to_client as tc
from engine.messages import to_tokenizer as tt
from engine.protocol import Codec
from engine.transport import encode_request

pytestmark = pytest.mark.usefixtures("bounded")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory):
    log = tmp_path_factory.mktemp("door") / "launch.log"
    extra = ("--max-total-tokens", "8192", "--context-length", "1024")
    launched = LaunchedEngine(tiny_model_dir, log, *extra).wait_ready()
    yield launched
    launched.stop()


def test_a_huge_input_does_not_hold_other_clients(engine):
    ctx = zmq.Context()
    socks = []
    for _ in range(2):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(engine.address)
        socks.append(s)
    hostile, polite = socks
    codec = Codec(tc.ToClient)
    try:
        # NOTE: connected both first, so the order below is the order the engine reads them.
        for s in socks:
            s.send(encode_request(tt.HealthCheck("warm")))
            assert isinstance(codec.decode(s.recv()), tc.HealthReply)
        messages = [{"role": "user", "content": "word " * 180}] * 1000  # ~1 s to template
        hostile.send(encode_request(tt.Generate("huge", messages=messages)))
        time.sleep(0.05)
        polite.send(encode_request(tt.HealthCheck("polite")))
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        order = []
        while len(order) < 2:
            events = dict(poller.poll(30_000))
            assert events, "no reply within 30 s"
            for s in socks:
                if s in events:
                    order.append(codec.decode(s.recv()).rid)  # type: ignore[union-attr]
        assert order == ["polite", "huge"], "another client's call waited for a tokenization"
    finally:
        for s in socks:
            s.close()
        ctx.term()
