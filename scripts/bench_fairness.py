"""A light client beside a flood from another: its latency quiet, then beside each flood.

  python3 scripts/bench_fairness.py --model DIR                    # launch defaults
  python3 scripts/bench_fairness.py --model /tmp/llama1b --flood sdk --flood-requests 500  # a GPU

It launches `mlx-engine launch` with its defaults plus a keys file of two clients (`attacker`,
`good`: docs/operations.md, "Fair admission"), no per-peer connection cap (on loopback every
client is one address) and a context that holds the flood's outputs. The good client runs in a
process of its own (tests/reliability/good_client.py) and times, back to back, the first token
of a 4-token request ("ttft") and a whole 4-token request ("sdk", and "http" over HTTP). Then the
attacker floods: `sdk`, N long requests on one SDK connection; `http`, N connections each one
non-streamed long completion, never read. Each line: the good client's p50 / p99 and their ratio
to quiet, what the flood got admitted, how often the engine stepped meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "reliability"))

ATTACKER, GOOD = "sk-attacker-01", "sk-good-00001"
KINDS = ("ttft", "sdk", "http")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="for the launched engine (default model)")
    p.add_argument("--flood", default="sdk,http", help="floods to run: sdk, http")
    p.add_argument("--flood-requests", type=int, default=0, help="0: 500 (sdk), 1100 (http)")
    p.add_argument("--output-len", type=int, default=4000, help="tokens of each flood request")
    p.add_argument("--seconds", type=float, default=8.0, help="the good client's time per kind")
    p.add_argument("--launch-arg", action="append", default=[], help="one more launch option")
    p.add_argument("--out", default=None, help="directory for launch.log and results.json")
    return p.parse_args()


@contextlib.contextmanager
def launched(args: argparse.Namespace, out: Path) -> Iterator[tuple[str, str]]:
    """The engine, once it answers the SDK: (SDK address, HTTP URL)."""
    from launched import launched_engine

    from engine.client import EngineClient
    from engine.errors import EngineError

    (out / "keys").write_text(f"attacker {ATTACKER}\ngood {GOOD}\n")
    options = ["--api-keys-file", str(out / "keys"), "--http-max-connections-per-peer", "0"]
    options += ["--context-length", str(args.output_len + 512), *args.launch_arg]
    options += ["--model", args.model] if args.model else []
    with launched_engine(options, out / "launch.log") as (zmq_port, http_port):
        address = f"tcp://127.0.0.1:{zmq_port}"
        with EngineClient(address, api_key=GOOD, timeout=120) as c:
            with contextlib.suppress(EngineError):  # NOTE: first shapes, before timing
                c.generate(input_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        yield address, f"http://127.0.0.1:{http_port}"


def good(address: str, url: str, seconds: float) -> dict[str, list[float]]:
    """The good client's latencies of each kind, one kind after another."""
    from good_client import GoodClient

    out = {}
    for kind in KINDS:
        target = url if kind == "http" else address
        client = GoodClient(target, duration=seconds, kind=kind, key=GOOD).join(seconds + 300)
        if client.errors:
            print(f"  {kind}: {len(client.errors)} errors, first {client.errors[0]}", flush=True)
        out[kind] = client.latencies
    return out


def sdk_flood(address: str, n: int, output_len: int) -> contextlib.AbstractContextManager:
    from engine.client import EngineClient
    from engine.messages import to_tokenizer as tt

    @contextlib.contextmanager
    def flood() -> Iterator[None]:
        hog = EngineClient(address, api_key=ATTACKER)
        params = {"max_tokens": output_len, "ignore_eos": True}
        try:
            for i in range(n):
                rid = f"hog-{i}"
                hog._t.register(rid, lambda msg: None)  # NOTE: replies dropped as they come
                hog._t.send(tt.Generate(rid, input_ids=[7, 8, 9, i % 1000 + 10], params=params))
            yield
        finally:
            hog.close()

    return flood()


def http_flood(url: str, n: int, output_len: int) -> contextlib.AbstractContextManager:
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "tell me a story", "max_tokens": output_len, "ignore_eos": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ATTACKER}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )

    @contextlib.contextmanager
    def flood() -> Iterator[None]:
        socks = []
        try:
            for _ in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall((head + body).encode())
                socks.append(s)
            yield
        finally:
            for s in socks:
                s.close()

    return flood()


def stats_when(address: str, done: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The engine's stats once `done(stats)` (within 300 s)."""
    from engine.client import EngineClient

    with EngineClient(address, api_key=GOOD) as c:
        deadline = time.monotonic() + 300
        while not done(stats := c.stats()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not get there: {stats}")
            time.sleep(0.2)
        return stats


def idle(stats: dict[str, float]) -> bool:
    return stats["requests_in_flight"] + stats["running"] + stats["waiting"] == 0


def quantiles(lat: list[float]) -> tuple[float, float]:
    s = sorted(lat) or [float("nan")]
    return statistics.median(s), s[min(len(s) - 1, int(len(s) * 0.99))]


def report(
    name: str, lat: dict[str, list[float]], quiet: dict[str, list[float]], extra: str
) -> None:
    parts = []
    for kind in KINDS:
        p50, p99 = quantiles(lat[kind])
        q50, _ = quantiles(quiet[kind])
        parts.append(f"{kind} p50 {p50 * 1e3:.0f} ms ({p50 / q50:.1f}x) p99 {p99 * 1e3:.0f} ms")
    print(f"{name:8} " + "; ".join(parts) + (f"; {extra}" if extra else ""), flush=True)


def flood(
    name: str, args: argparse.Namespace, address: str, url: str, quiet: dict[str, list[float]]
) -> dict:
    """One flood: the good client's latencies beside it, and what the flood got."""
    n = args.flood_requests or (500 if name == "sdk" else 1100)
    make = sdk_flood if name == "sdk" else http_flood
    start = stats_when(address, idle)
    before = start["requests_received"]
    with make(address if name == "sdk" else url, n, args.output_len):
        arrived = stats_when(address, lambda s: s["requests_received"] >= before + n)
        t0 = time.monotonic()
        lat = good(address, url, args.seconds)
        during = stats_when(address, lambda s: True)
        elapsed = time.monotonic() - t0
    stats_when(address, idle)
    steps = during["steps_launched"] - arrived["steps_launched"]
    step = elapsed / max(1.0, steps) * 1e3  # NOTE: the mean step while the good client ran
    extra = (
        f"{int(arrived['requests_in_flight'])} of {n} admitted, "
        f"{int(during['requests_preempted'] - start['requests_preempted'])} rows given back, "
        f"a step every {step:.0f} ms"
    )
    report(name, lat, quiet, extra)
    return {"latencies": lat, "arrived": arrived, "during": during}


def main() -> None:
    args = parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    with launched(args, out) as (address, url):
        slots = int(stats_when(address, idle)["kv_slots_total"])
        print(f"engine: {slots} rows; log {out / 'launch.log'}", flush=True)
        quiet = good(address, url, args.seconds)
        results["quiet"] = {"latencies": quiet}
        report("quiet", quiet, quiet, "")
        for name in [f.strip() for f in args.flood.split(",") if f.strip()]:
            results[name] = flood(name, args, address, url, quiet)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
