"""A well-behaved client in its own process (so hostile clients' work in the test's process
cannot slow it): short requests back to back, each timed, for `duration` or `n` requests.

`kind` "sdk" times a whole 4-token generation over the SDK; "ttft" the first token of one;
"http" a whole 4-token completion over HTTP (`address` is then the HTTP base URL). `key`: the
API key it presents (the engine's client keys make it a client of its own).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

SCRIPT = """
import http.client, json, sys, time, urllib.parse
from engine.client import EngineClient
from engine.errors import EngineError
address, n, duration, kind, key = sys.argv[1:4] + sys.argv[4:6]
n, duration, key = int(n), float(duration), key or None
latencies, errors = [], []
until = time.monotonic() + duration

def http_one():
    url = urllib.parse.urlparse(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        text = resp.read()
        if resp.status != 200:
            raise EngineError(f"HTTP {resp.status}: {text[:200]!r}")
    finally:
        conn.close()

def sdk_one(c):
    if kind == "ttft":
        stream = c.stream(input_ids=[1, 2, 3, 4], max_tokens=4, ignore_eos=True)
        for chunk in stream:
            if chunk.token_ids:
                break
        stream.close()
    else:
        c.generate(input_ids=[1, 2, 3, 4], max_tokens=4, ignore_eos=True)

c = None if kind == "http" else EngineClient(address, timeout=60, api_key=key)
while time.monotonic() < until and len(latencies) + len(errors) < n:
    t0 = time.monotonic()
    try:
        http_one() if c is None else sdk_one(c)
        latencies.append(time.monotonic() - t0)
    except (EngineError, OSError) as e:
        errors.append(repr(e))
    time.sleep(0.02)
if c is not None:
    c.close()
print(json.dumps({"latencies": latencies, "errors": errors}))
"""


class GoodClient:
    def __init__(
        self,
        address: str,
        n: int = 1_000_000,
        duration: float = 600.0,
        kind: str = "sdk",
        key: str = "",
    ) -> None:
        args = [sys.executable, "-c", SCRIPT, address, str(n), str(duration), kind, key]
        self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def join(self, timeout: float = 120.0) -> GoodClient:
        out, _ = self._proc.communicate(timeout=timeout)
        result = json.loads(out.splitlines()[-1])
        self.latencies, self.errors = result["latencies"], result["errors"]
        return self

    def quantile(self, q: float) -> float:
        lat = sorted(self.latencies) or [0.0]
        return lat[min(len(lat) - 1, int(len(lat) * q))]

    def summary(self) -> str:
        lat = sorted(self.latencies) or [0.0]
        return (
            f"{len(lat)} requests, p50 {statistics.median(lat) * 1e3:.0f} ms, "
            f"p99 {self.quantile(0.99) * 1e3:.0f} ms, worst {lat[-1] * 1e3:.0f} ms"
            + (f", {len(self.errors)} errors" if self.errors else "")
        )
