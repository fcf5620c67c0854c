"""Operating an engine under load: what a pause and a weight swap cost, and what clients see.

  python3 scripts/bench_operations.py                       # the default model, launch defaults
  python3 scripts/bench_operations.py --model DIR --new-weights DIR2 --streams 16

It launches `mlx-engine launch` with its defaults, starts N greedy streams over the SDK and, once
each has its first tokens:
- `retract`: pauses with mode retract, holds `--hold` s, continues; the streams' tokens are
  compared with the same streams run without a pause (they must be equal);
- `swap`: calls `update_weights_from_disk(--new-weights)` (default: the model it serves, a
  checkpoint that fits by definition) while a probe request arrives; reports the call's time,
  the engine's own `swap_s` (load, check, swap) and `waited_s` (running requests finishing),
  and the probe's time to its first token (what a client arriving during a swap waits).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="for the launched engine (default model)")
    p.add_argument("--new-weights", default=None, help="checkpoint to swap in (default: --model)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64, help="tokens of each stream")
    p.add_argument("--hold", type=float, default=1.0, help="seconds paused")
    p.add_argument("--launch-arg", action="append", default=[], help="one more launch option")
    return p.parse_args()


@contextlib.contextmanager
def launched(args: argparse.Namespace, out: Path) -> Iterator[tuple[str, str]]:
    """The engine once READY: (SDK address, the model directory it serves)."""
    from launched import launched_engine

    options = [*args.launch_arg, *(["--model", args.model] if args.model else [])]
    with launched_engine(options, out / "launch.log") as (zmq_port, _):
        yield f"tcp://127.0.0.1:{zmq_port}", _model_dir(out / "launch.log")


def _model_dir(log: Path) -> str:
    for line in log.read_text().splitlines():
        if "model " in line and " loaded in " in line:
            return line.split("model ", 1)[1].split(" loaded in ")[0]
    raise RuntimeError("no 'model ... loaded in' line in the launch log")


class Streams:
    def __init__(self, client: Any, prompts: list[list[int]], n: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(client, i, p, n), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for t in self.threads:
            t.start()

    def _run(self, client: Any, i: int, prompt: list[int], n: int) -> None:
        try:
            params = {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}
            for chunk in client.stream(input_ids=prompt, **params):
                self.tokens[i] += chunk.token_ids
        except BaseException as e:  # NOTE: reported, not raised in a thread
            self.errors.append(e)

    def started(self) -> None:
        while not all(self.tokens) and not self.errors:
            time.sleep(0.005)

    def join(self) -> None:
        for t in self.threads:
            t.join(600)


def retract(client: Any, prompts: list[list[int]], args: argparse.Namespace) -> None:
    plain = Streams(client, prompts, args.output_len)
    plain.join()
    streams = Streams(client, prompts, args.output_len)
    streams.started()
    t0 = time.monotonic()
    info = client.pause_generation("retract")
    paused_s = time.monotonic() - t0
    time.sleep(args.hold)
    t1 = time.monotonic()
    client.continue_generation()
    continue_s = time.monotonic() - t1
    streams.join()
    same = streams.tokens == plain.tokens and not streams.errors
    print(
        f"retract: {info['retracted']} of {len(prompts)} streams retracted in "
        f"{paused_s * 1e3:.0f} ms, continued in {continue_s * 1e3:.0f} ms; streams equal to "
        f"an uninterrupted run: {same}; errors: {len(streams.errors)}",
        flush=True,
    )


def swap(client: Any, prompts: list[list[int]], args: argparse.Namespace, model: str) -> None:
    streams = Streams(client, prompts, args.output_len)
    streams.started()
    probe: dict[str, float] = {}

    def arrive() -> None:
        time.sleep(0.05)  # NOTE: after the swap was asked for
        t0 = time.monotonic()
        for _ in client.stream(input_ids=prompts[0], max_tokens=1, temperature=0.0):
            probe.setdefault("ttft", time.monotonic() - t0)

    prober = threading.Thread(target=arrive, daemon=True)
    prober.start()
    t0 = time.monotonic()
    info = client.update_weights_from_disk(args.new_weights or model)
    call_s = time.monotonic() - t0
    streams.join()
    prober.join(600)
    print(
        f"swap: call {call_s:.2f} s = waited {info['waited_s']:.2f} s for {len(prompts)} "
        f"running streams + swap {info['swap_s']:.2f} s (load, check, swap); a request arriving "
        f"meanwhile got its first token after {probe.get('ttft', float('nan')):.2f} s; "
        f"stream errors: {len(streams.errors)}",
        flush=True,
    )


def main() -> None:
    args = parse_args()
    from engine.client import EngineClient

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp, launched(args, Path(tmp)) as (address, model):
        with EngineClient(address, timeout=600) as client:
            client.generate(input_ids=[1, 2, 3], max_tokens=2)  # NOTE: first shapes
            retract(client, prompts, args)
            swap(client, prompts, args, model)


if __name__ == "__main__":
    main()
