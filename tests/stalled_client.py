"""An SDK client in a process of its own, so that a test can stop it (SIGSTOP) as a starved
machine stops a slow reader: `python stalled_client.py ADDRESS N`.

It runs N long streams, prints `started` once each has a token, then one JSON line: per stream,
how it ended and whether every token the engine counted arrived. It closes when its stdin does
(until then the engine hears only what the SDK sends by itself).
"""

from __future__ import annotations

import json
import sys
import threading

from engine.client import EngineClient

LONG = {"max_tokens": 4000, "temperature": 0.0, "ignore_eos": True}


def main(address: str, n: int) -> None:
    client = EngineClient(address, timeout=60.0)
    started = [threading.Event() for _ in range(n)]
    ends: list[dict[str, object]] = [{} for _ in range(n)]

    def run(i: int) -> None:
        received = 0
        try:
            for chunk in client.stream(input_ids=[i + 1, 7, 9], **LONG):
                started[i].set()
                received += len(chunk.token_ids)
                end = {"finish": chunk.finish_reason, "received": received}
                ends[i] = end | {"counted": chunk.usage.completion_tokens}
        except Exception as e:  # noqa: BLE001 - reported to the test
            ends[i] = {"error": repr(e), "received": received}
            started[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(60)
    print("started", flush=True)
    for t in threads:
        t.join(60)
    print(json.dumps(ends), flush=True)
    sys.stdin.read()
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
