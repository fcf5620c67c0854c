#!/usr/bin/env python3
"""Plant known KV-cache bugs one at a time in a copy of the tree and check the suite catches each.

    .venv/bin/python scripts/planted_bugs.py [--tests tests/test_x.py ...]

Each bug is a one-line edit of the scheduler's code (a mask off by one, a wrong RoPE offset, a
prefix whose KV is never loaded, a row copy skipped, ...). A bug the tests do not catch is a hole
in the suite: the script exits non-zero and names it. See docs/testing.md.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# NOTE: the model-family tests first: most bugs fail there within seconds (pytest -x).
DEFAULT_TESTS = (
    "tests/test_model_families.py",
    "tests/test_context_sensitive.py",
    "tests/test_scheduler_parity.py",
    "tests/test_decode_attention.py",
    "tests/test_prefix_cache_parity.py",
    "tests/test_scheduler_lifecycle.py",
)


@dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str
    new: str


BUGS = (
    Bug(
        "attention mask off by one (a query sees the next key)",
        "scheduler_proc/kv_cache.py",
        "visible = keys <= query\n",
        "visible = keys <= query + 1\n",
    ),
    Bug(
        "RoPE offset off by one in batched steps",
        "scheduler_proc/kv_cache.py",
        "self.offset = mx.array(plan.starts, dtype=mx.int32)",
        "self.offset = mx.array(plan.starts, dtype=mx.int32) + 1",
    ),
    Bug(
        "single-row decode reads one key too few",
        "scheduler_proc/kv_cache.py",
        "        end = self.offset + n\n        if ring is not None:\n",
        "        end = self.offset + n - 1\n        if ring is not None:\n",
    ),
    Bug(
        "KV written one position late",
        "scheduler_proc/kv_cache.py",
        "pos.append([start + t for t in range(n)]",
        "pos.append([start + t + 1 for t in range(n)]",
    ),
    Bug(
        "padding written to the request's own row, not the scratch row",
        "scheduler_proc/kv_cache.py",
        "rows.append([row] * n + [scratch] * (self.width - n))",
        "rows.append([row] * self.width)",
    ),
    Bug(
        "prefix KV not loaded into the row",
        "scheduler_proc/prefix_store.py",
        "        pool.load_prefix(row, kv)\n",
        "        pass\n",
    ),
    Bug(
        "row copy skipped when a row moves",
        "scheduler_proc/kv_cache.py",
        "        if src == dst:\n            return\n",
        "        return\n",
    ),
    Bug(
        "sliding-window layers attend to every key (window dropped from the ragged mask)",
        "scheduler_proc/kv_cache.py",
        "ragged_mask(self.offset, self._t, self.length, window_size)",
        "ragged_mask(self.offset, self._t, self.length, None)",
    ),
    Bug(
        "a lone decode row reads every key of a window layer",
        "scheduler_proc/kv_cache.py",
        "start = max(0, end - window) if window is not None and n == 1 else 0",
        "start = 0",
    ),
    Bug(
        "a window layer's ring mask shows ring entries never written (negative positions)",
        "scheduler_proc/kv_cache.py",
        "    visible = (p >= 0) & (p <= q) & (p > q - window)",
        "    visible = (p <= q) & (p > q - window)",
    ),
    Bug(
        "a prefix hit is not cut back to where its whole window is stored",
        "scheduler_proc/prefix_cache.py",
        "        if self.window is None:\n            return n\n",
        "        return n\n",
    ),
    Bug(
        "recurrent state not zeroed when a request takes a row",
        "scheduler_proc/kv_cache.py",
        "        self.reset_states(row)\n",
        "",
    ),
    Bug(
        "a moved row with no tokens yet leaves its recurrent state behind",
        "scheduler_proc/kv_cache.py",
        "        if src == dst:\n            return\n",
        "        if src == dst or length <= 0:\n            return\n",
    ),
    Bug(
        "padded prefill chunks for a model whose state absorbs padding",
        "scheduler_proc/runner.py",
        "self.uniform_prefill = not padding_keeps_state(model, pool.layout)",
        "self.uniform_prefill = False",
    ),
    Bug(
        "fused decode: each row's newest key left out of its length",
        "scheduler_proc/kv_cache.py",
        "return (self._ends, self.length) if self.fused",
        "return (self._ends - 1, self.length) if self.fused",
    ),
    Bug(
        "fused decode's masked twin lets each row see one key past its end",
        "scheduler_proc/decode_attention.py",
        "mx.arange(n)[None] < mx.maximum(lengths, 1)[:, None]",
        "mx.arange(n)[None] < mx.maximum(lengths, 1)[:, None] + 1",
    ),
    Bug(
        "a prefill step gathers its rows whole before slicing their keys",
        "scheduler_proc/kv_cache.py",
        "return buf[:, :, :keys][self._read_rows]",
        "return buf[self._read_rows][:, :, :keys]",
    ),
    Bug(
        "prefill chunk starts at 0 instead of the cached length",
        "scheduler_proc/scheduler.py",
        "chunks.append(PromptSlice(req, req.prefilled, req.prefilled + n))",
        "chunks.append(PromptSlice(req, 0, n))",
    ),
)


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in files:
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def _plant(tree: Path, bug: Bug) -> None:
    path = tree / bug.path
    text = path.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"cannot plant {bug.name!r}: the line is not in {bug.path} exactly once")
    path.write_text(text.replace(bug.old, bug.new))


def _caught(tree: Path, tests: list[str]) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=tree, capture_output=True).returncode != 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS))
    args = ap.parse_args()
    missed = []
    for bug in BUGS:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp)
            _copy_tree(tree)
            _plant(tree, bug)
            t0 = time.monotonic()
            caught = _caught(tree, args.tests)
        print(f"{'caught' if caught else 'MISSED'}  {bug.name}  ({time.monotonic() - t0:.0f} s)")
        if not caught:
            missed.append(bug.name)
    print(f"{len(BUGS) - len(missed)} of {len(BUGS)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
