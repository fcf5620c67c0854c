"""The front door's farewell at shutdown (tokenizer_proc/farewell.py): whom it waits for, and
for how long. The end-to-end case (a stopped client) is in test_launch_lifecycle.py."""

from __future__ import annotations

import asyncio
import time

from engine.messages import to_client as tc
from tokenizer_proc.farewell import Farewell


def test_waits_for_every_client_even_when_the_first_answers_before_the_next_is_told():
    async def main() -> float:
        farewell = Farewell()
        told: list[bytes] = []

        async def send(client: bytes, msg: tc.ToClient) -> bool:
            assert isinstance(msg, tc.Closing)
            told.append(client)
            if client == b"a":
                farewell.read(b"a")  # NOTE: the send yields; a's answer may come before b is told
            return True

        asyncio.get_running_loop().call_later(0.3, farewell.read, b"b")
        started = time.monotonic()
        await farewell.run([b"a", b"b"], send, timeout=5.0)
        assert told == [b"a", b"b"]
        return time.monotonic() - started

    assert 0.25 < asyncio.run(main()) < 2.0


def test_a_client_that_cannot_be_told_is_not_waited_for():
    async def main() -> float:
        async def send(client: bytes, msg: tc.ToClient) -> bool:
            return False

        started = time.monotonic()
        await Farewell().run([b"gone"], send, timeout=5.0)
        return time.monotonic() - started

    assert asyncio.run(main()) < 1.0


def test_a_client_that_never_answers_costs_the_timeout_and_no_more():
    async def main() -> float:
        async def send(client: bytes, msg: tc.ToClient) -> bool:
            return True

        farewell = Farewell()
        farewell.read(b"early")  # NOTE: an answer from a client not asked is ignored
        started = time.monotonic()
        await farewell.run([b"silent"], send, timeout=0.3)
        return time.monotonic() - started

    assert 0.25 < asyncio.run(main()) < 2.0
