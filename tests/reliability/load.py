"""Load with faults for the reliability suite: clients that complete, abort, abandon, close and
lose their connections, each request's end tallied so that nothing can go missing."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from engine.client import EngineClient
from engine.errors import EngineError

SHORT_MAX = 24
LONG_MAX = 300  # NOTE: below the suite's 512-token context


@dataclass
class Tally:
    """Requests by outcome; `submitted` must equal the sum of the ends, and `lost` stay 0."""

    counts: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, n: int = 1) -> None:
        with self.lock:
            self.counts[outcome] += n

    def fault(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.faults[kind] += n

    @property
    def ended(self) -> int:
        return sum(self.counts[k] for k in ("completed", "aborted", "errored"))


def _end(tally: Tally, finish: str | None) -> None:
    if finish in ("stop", "length"):
        tally.add("completed")
    elif finish == "abort":
        tally.add("aborted")
    else:
        tally.add("errored")


def one_request(client: EngineClient, rng: random.Random, tally: Tally) -> None:
    """One request with a random fate: complete, abort by rid, or abandon the stream."""
    fate = rng.choice(["complete", "complete", "abort", "abandon"])
    long = fate != "complete"
    params = {"max_tokens": rng.randint(1, LONG_MAX if long else SHORT_MAX), "ignore_eos": long}
    prompt = [rng.randrange(1, 40000) for _ in range(rng.randint(1, 40))]
    tally.add("submitted")
    try:
        stream = client.stream(input_ids=prompt, timeout=60, temperature=rng.random(), **params)
        finish = None
        for i, chunk in enumerate(stream):
            finish = chunk.finish_reason
            if finish is None and i == 2 and fate == "abort":
                tally.fault("aborts")
                client.abort(stream_rid(chunk))
            if finish is None and i == 2 and fate == "abandon":
                tally.fault("abandoned streams")
                stream.close()
                finish = "abort"
                break
        _end(tally, finish)
    except EngineError:
        tally.add("errored")


def stream_rid(chunk: object) -> str:
    return chunk.rid  # type: ignore[attr-defined]


def client_loop(address: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    with EngineClient(address, timeout=60) as client:
        while time.monotonic() < until:
            one_request(client, rng, tally)


def closing_clients(address: str, seed: int, until: float, tally: Tally) -> None:
    """Clients closed while other threads stream through them: those streams must end."""
    rng = random.Random(seed)
    while time.monotonic() < until:
        client = EngineClient(address, timeout=60)
        threads = [
            threading.Thread(target=one_request, args=(client, random.Random(rng.random()), tally))
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.05, 0.4))
        client.close()
        tally.fault("client closes")
        for t in threads:
            t.join(30)
            if t.is_alive():
                tally.add("lost")


def resetter(proxy: object, until: float, tally: Tally, every: float = 0.4) -> None:
    while time.monotonic() < until:
        time.sleep(every)
        proxy.reset()  # type: ignore[attr-defined]
        tally.fault("connection resets")


KILLED_CLIENT = """
import sys, time
from engine.client import EngineClient
c = EngineClient(sys.argv[1])
streams = [c.stream(input_ids=[i + 3, 9], max_tokens=300, ignore_eos=True) for i in range(3)]
[next(s) for s in streams]
print("streaming", flush=True)
time.sleep(60)
"""


def killed_clients(address: str, n: int, tally: Tally) -> None:
    """Client processes killed with SIGKILL mid-stream: the engine must abort their requests."""
    for _ in range(n):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, address], stdout=subprocess.PIPE, text=True
        )
        try:
            if proc.stdout.readline().strip() == "streaming":  # type: ignore[union-attr]
                tally.add("submitted", 3)
                tally.add("aborted", 3)  # NOTE: checked on the engine: nothing left in flight
        finally:
            proc.kill()
            proc.wait(10)
        tally.fault("clients killed")
