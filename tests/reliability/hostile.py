"""Hostile clients for the reliability suite: huge inputs, a client that never reads."""

from __future__ import annotations

import random
import time

import zmq
from load import Tally

from engine.client import EngineClient
from engine.errors import EngineError
from engine.messages import to_tokenizer as tt
from engine.transport import encode_request


def huge_inputs(address: str, until: float, tally: Tally, seed: int = 3) -> None:
    """Inputs just under and over the limits: each must be refused (or served) alone, typed."""
    rng = random.Random(seed)
    inputs = [
        {"prompt": "lorem ipsum " * 80_000},  # ~960k chars: tokenized, then too long
        {"prompt": "x" * 9_000_000},  # over max_frame_bytes: refused before decoding
        {"messages": [{"role": "user", "content": "word " * 180}] * 1000},
        {"messages": [{"role": "user", "content": "hi", "name": "n" * 900_000}]},
        {"input_ids": [5] * 2_000_000},
        {"prompt": "y" * 40_000_000},  # beyond 4x the frame limit: the connection is dropped
    ]
    with EngineClient(address, timeout=60) as client:
        while time.monotonic() < until:
            kwargs = rng.choice(inputs)
            tally.add("bad inputs")
            try:
                client.generate(max_tokens=1, timeout=60, **kwargs)
            except EngineError as e:
                tally.add(type(e).__name__)


class NeverReader:
    """A raw client that sends long requests and never reads a reply."""

    def __init__(self, address: str, n: int, tally: Tally) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(address)
        for i in range(n):
            params = {"max_tokens": 300, "ignore_eos": True}
            self.sock.send(
                encode_request(tt.Generate(f"never-{i}", input_ids=[i + 1], params=params))
            )
        tally.fault("never-reading requests", n)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
