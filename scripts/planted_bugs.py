#!/usr/bin/env python3
"""Plant known KV-cache bugs one at a time in a copy of the tree and check the suite catches each.

    .venv/bin/python scripts/planted_bugs.py [--tests tests/test_x.py ...] [--bugs WORD ...]
                                             [--timeout S] [--no-baseline] [--list]

Each bug is a one-line edit of the scheduler's code (a mask off by one, a wrong RoPE offset, a
page table off by one, a page freed while shared, a partly filled page not copied, ...). Before
anything runs, every bug's `old` text must occur exactly once in its file: a stale one (the code
moved) stops the script, named. Then the suite runs once on the unplanted copy (it must pass,
or every bug would look caught), and once per bug under a timeout (`--timeout`, default the
larger of 600 s and twice the clean run). Per bug it reports caught (and the first failing test),
HANG (the run was killed at the timeout, or a test hit its deadline in tests/conftest.py: some
test lacks a bound) or MISSED (a hole in the suite). See docs/testing.md.

Exit status: 0 every bug caught; 1 a bug missed; 2 none missed but a run hung; 3 a stale or
broken bug, or the clean tree fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# NOTE: fail fast (pytest -x): the pages' model-based test (pure Python, 3 s), the paged
# scheduler's (13 s: the only preemption cases), then the model-family tests, where most bugs
# fail within seconds of their 200; the clean run takes about 5 minutes on 2 CPU cores.
DEFAULT_TESTS = (
    "tests/test_kv_pages.py",
    "tests/test_memory_bounds.py",
    "tests/test_prefill_attention.py",
    "tests/test_paged_scheduler.py",
    "tests/test_model_families.py",
    "tests/test_context_sensitive.py",
    "tests/test_scheduler_parity.py",
    "tests/test_decode_attention.py",
    "tests/test_prefix_cache_parity.py",
    "tests/test_scheduler_lifecycle.py",
    "tests/test_scheduler_penalties.py",
    "tests/test_scheduler_sampling.py",
    "tests/test_fair_admission.py",
    "tests/test_burst.py",
    "tests/test_operations.py",
    "tests/test_kv_events.py",
)
MIN_TIMEOUT_S = 600.0
DEADLINE_TEXT = "the test ran past its deadline"  # tests/engine_harness.py `deadline`


@dataclass(frozen=True)
class Bug:
    name: str
    path: str
    old: str
    new: str


BUGS = (
    # -- speculation (scheduler_proc/speculate.py) ----------------------------------------------
    Bug(
        "speculation: a proposed token kept without comparing it with the greedy token",
        "scheduler_proc/scheduler.py",
        "if req.finished or req.output_ids[-1] != token:",
        "if req.finished:",
    ),
    Bug(
        "speculation: the KV of rejected tokens not rolled back",
        "scheduler_proc/scheduler.py",
        "req.kv_len -= len(proposal) + 1 - max(emitted, 1)",
        "req.kv_len -= 0",
    ),
    Bug(
        "speculation: pages taken for rejected tokens kept",
        "scheduler_proc/scheduler.py",
        "            self.kv.trim(req)\n",
        "            pass\n",
    ),
    Bug(
        "speculation: a step with speculating rows chained on blindly",
        "scheduler_proc/scheduler.py",
        "if cur.proposals is not None or any(self.spec.active(r) for r in cur.rows):",
        "if False:",
    ),
    # -- masks, positions, reads ----------------------------------------------------------------
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
        "return self.pool.gather([self.table], self.offset + n, buf, run=self._run)",
        "return self.pool.gather([self.table], self.offset + n - 1, buf, run=self._run)",
    ),
    Bug(
        "KV written one position late (batched writes)",
        "scheduler_proc/kv_cache.py",
        "pos = np.asarray(plan.starts)[:, None] + t\n",
        "pos = np.asarray(plan.starts)[:, None] + t + 1\n",
    ),
    Bug(
        "a step with first and later chunks takes the first chunks' own-keys path",
        "scheduler_proc/kv_cache.py",
        "self.fresh = plan.width > 1 and not any(plan.starts)",
        "self.fresh = plan.width > 1 and not min(plan.starts)",
    ),
    Bug(
        "first chunks attend to their own keys without the causal mask",
        "scheduler_proc/kv_cache.py",
        '            return "causal"\n',
        '            return None if self.fresh else "causal"\n',
    ),
    # -- page tables ----------------------------------------------------------------------------
    Bug(
        "page table off by one: a batched write takes the next entry of its table",
        "scheduler_proc/kv_cache.py",
        "index = np.where(real, pos // page, 0)",
        "index = np.where(real, pos // page + 1, 0)",
    ),
    Bug(
        "page table off by one: token_slots maps a position into the next page",
        "scheduler_proc/kv_cache.py",
        "return np.asarray(table, dtype=np.int64)[pos // page] * page + pos % page",
        "return (np.asarray(table, dtype=np.int64)[pos // page] + 1) * page + pos % page",
    ),
    Bug(
        "contiguous-run check compares only the endpoints of a page table",
        "scheduler_proc/kv_cache.py",
        "return table[:n_pages] == list(range(first, first + n_pages))",
        "return table[n_pages - 1] - table[0] == n_pages - 1",
    ),
    Bug(
        "padding written to the request's own page, not the scratch page",
        "scheduler_proc/kv_cache.py",
        "return np.where(real, own, self.pool.scratch_page * page + t % page).reshape(-1)",
        "return own.reshape(-1)",
    ),
    Bug(
        "padding written to the request's own ring slot, not the scratch slot",
        "scheduler_proc/kv_cache.py",
        "rows.append([slot] * n + [scratch] * (plan.width - n))",
        "rows.append([slot] * plan.width)",
    ),
    # -- pages: sharing, copying, freeing -------------------------------------------------------
    Bug(
        "a page freed while shared (decref frees at one reference left)",
        "scheduler_proc/pages.py",
        "        if self._refs[page] == 0:\n            heapq.heappush(self._free, page)",
        "        if self._refs[page] <= 1:\n            heapq.heappush(self._free, page)",
    ),
    Bug(
        "a page freed while shared (a prefix hit's whole page not increfed)",
        "scheduler_proc/kv_manager.py",
        "                self.pages.incref(block)\n",
        "",
    ),
    Bug(
        "a prefix hit's shared page: the next page's id in the table (cached KV not used)",
        "scheduler_proc/kv_manager.py",
        "                table.append(block)\n",
        "                table.append(block + 1)\n",
    ),
    Bug(
        "the partly filled page of a prefix hit not copied",
        "scheduler_proc/kv_manager.py",
        "        self.pool.copy_tokens(src, dst)\n",
        "",
    ),
    Bug(
        "a prefix hit shares a block that is not a whole aligned page",
        "scheduler_proc/prefix_cache.py",
        "whole = len(block) == p and block[0] % p == 0",
        "whole = len(block) == p",
    ),
    Bug(
        "the prefix cache increfs tokens it already held",
        "scheduler_proc/prefix_cache.py",
        "self._ref(slots[present:], +1)",
        "self._ref(slots, +1)",
    ),
    Bug(
        "a decref skipped: evicted cached tokens keep their pages",
        "scheduler_proc/prefix_cache.py",
        "                self.pages.decref(page, n, cached=True)\n",
        "                pass\n",
    ),
    Bug(
        "the free list hands out its last page, not its lowest (the pool's tail stays in use)",
        "scheduler_proc/pages.py",
        "pages = [heapq.heappop(self._free) for _ in range(n)]",
        "pages = [self._free.pop() for _ in range(n)]",
    ),
    Bug(
        "an idle shrink sizes the pool by the pages in use, not the highest page in use",
        "scheduler_proc/kv_manager.py",
        "size = growth_size(self.pages.highest_in_use(), pool.initial, pool.capacity)",
        "size = growth_size(self.pages.in_use, pool.initial, pool.capacity)",
    ),
    Bug(
        "an idle shrink keeps a slice of the old buffers (nothing freed)",
        "scheduler_proc/kv_cache.py",
        "bufs[i] = mx.contiguous(bufs[i][:, :keep])",
        "bufs[i] = bufs[i][:, :keep]",
    ),
    # -- admission and preemption ---------------------------------------------------------------
    Bug(
        "admission ignores the decode reserve (KVManager.admit)",
        "scheduler_proc/kv_manager.py",
        "if not self.room(total - shared + reserve):",
        "if not self.room(total - shared):",
    ),
    Bug(
        "admission ignores the decode reserve (the scheduler passes none)",
        "scheduler_proc/seating.py",
        "seated = self.kv.seat(req, reserve=self.running.n_decode)",
        "seated = self.kv.seat(req, reserve=0)",
    ),
    Bug(
        "a seating pass copies each prefix hit's partly filled page on its own",
        "scheduler_proc/seating.py",
        "        with self.kv.one_pass():\n            return self._seat_each(pending)\n",
        "        return self._seat_each(pending)\n",
    ),
    Bug(
        "the pending prompts' longest shared prefix read from one neighbour only",
        "scheduler_proc/prefix_cache.py",
        "near = self._sorted[max(0, i - 1) : i + 1]",
        "near = self._sorted[i : i + 1]",
    ),
    Bug(
        "lone chunks of several rows attend without the causal mask",
        "scheduler_proc/kv_cache.py",
        'return _GroupReads(slice(i, i + 1), [self.plan.tables[i]], pages, n, False, "causal")',
        "return _GroupReads(slice(i, i + 1), [self.plan.tables[i]], pages, n, False, None)",
    ),
    Bug(
        "decode rows in groups: a row sees one key past its end",
        "scheduler_proc/kv_cache.py",
        "mask = (mx.arange(n)[None] < mx.array(ends)[:, None])[:, None, None]",
        "mask = (mx.arange(n)[None] <= mx.array(ends)[:, None])[:, None, None]",
    ),
    Bug(
        "decode rows in groups: outputs put back in the wrong row order",
        "scheduler_proc/kv_cache.py",
        "order = np.argsort([i for g in self._split for i in g]).astype(np.int32)",
        "order = np.asarray([i for g in self._split for i in g]).astype(np.int32)",
    ),
    Bug(
        "one lone chunk a step (the burst of agents seated one request a step)",
        "scheduler_proc/runner.py",
        "            self.lone_rows = ladders.rows[-1]\n",
        "            self.lone_rows = 1\n",
    ),
    Bug(
        "a preempted request recomputes its last token twice",
        "scheduler_proc/request.py",
        "self.fill = self.input_ids + self.output_ids\n",
        "self.fill = self.input_ids + self.output_ids + self.output_ids[-1:]\n",
    ),
    Bug(
        "a preempted request's stream re-sends the tokens it already had",
        "scheduler_proc/request.py",
        "        self.preemptions += 1\n",
        "        self.preemptions += 1\n        self.new_ids = list(self.output_ids)\n",
    ),
    # -- windows, rings, recurrent state, snapshots ---------------------------------------------
    Bug(
        "a window layer's batched steps attend to its whole ring (window dropped from the mask)",
        "scheduler_proc/kv_cache.py",
        "mask = ring_mask(self.offset, self._ends, self._t, keys, ring, window_size)",
        "mask = ring_mask(self.offset, self._ends, self._t, keys, ring, None)",
    ),
    Bug(
        "a lone decode row sees its whole ring (no window mask until the ring is full)",
        "scheduler_proc/kv_cache.py",
        "if window_size is None or end <= window_size:",
        "if window_size is None or end <= ring:",
    ),
    Bug(
        "a window layer's ring mask shows ring entries never written (negative positions)",
        "scheduler_proc/kv_cache.py",
        "    visible = (p >= 0) & (p <= q)\n",
        "    visible = p <= q\n",
    ),
    Bug(
        "recurrent state not zeroed when a request takes a slot",
        "scheduler_proc/kv_manager.py",
        "            self.pool.reset_slot(req.slot)\n",
        "            pass\n",
    ),
    Bug(
        "a prefix hit is not cut back to a slot snapshot's boundary",
        "scheduler_proc/prefix_cache.py",
        "n = m.length if boundary is None else boundary(m.length)",
        "n = m.length",
    ),
    Bug(
        "a prefix hit's slot snapshot not restored (the slot zeroed instead)",
        "scheduler_proc/kv_manager.py",
        "self.snapshots.restore(req.slot, req.fill_ids[:n])",
        "self.pool.reset_slot(req.slot)",
    ),
    Bug(
        "a slot snapshot restored into the next slot",
        "scheduler_proc/snapshots.py",
        "self.pool.write_slot(slot, self._store[key][1])",
        "self.pool.write_slot(slot + 1, self._store[key][1])",
    ),
    Bug(
        "padded prefill chunks for a model whose state absorbs padding",
        "scheduler_proc/runner.py",
        "self.uniform_prefill = not padding_keeps_state(model, pool.layout)",
        "self.uniform_prefill = False",
    ),
    # -- fused decode ---------------------------------------------------------------------------
    Bug(
        "fused decode: each row's newest key left out of its length",
        "scheduler_proc/kv_cache.py",
        "return PagedKeys(self._ends, self.length, self._tables, self.pool.page_size)",
        "return PagedKeys(self._ends - 1, self.length, self._tables, self.pool.page_size)",
    ),
    Bug(
        "fused decode's masked twin lets each row see one key past its end",
        "scheduler_proc/decode_attention.py",
        "mx.arange(n)[None] < mx.maximum(lengths, 1)[:, None]",
        "mx.arange(n)[None] < mx.maximum(lengths, 1)[:, None] + 1",
    ),
    # -- chunking -------------------------------------------------------------------------------
    Bug(
        "prefill chunk starts at 0 instead of the cached length",
        "scheduler_proc/scheduler.py",
        "slices.append(PromptSlice(req, req.prefilled, req.prefilled + n, lone))",
        "slices.append(PromptSlice(req, 0, n, lone))",
    ),
    # -- prompt-chunk attention, warm-up, in-place copies ------------------------------------
    Bug(
        "prefill attention by ops ignores the mask (every query sees every key)",
        "scheduler_proc/prefill_attention.py",
        "scores = mx.where(m, scores, mx.array(-mx.inf, scores.dtype))",
        "scores = scores",
    ),
    Bug(
        "prefill attention by ops drops the scale",
        "scheduler_proc/prefill_attention.py",
        "qg = (q * mx.array(scale, q.dtype)).reshape(r, kv_heads, g, t, d)",
        "qg = q.reshape(r, kv_heads, g, t, d)",
    ),
    Bug(
        "warm-up runs prefill shapes at first-chunk key lengths only",
        "scheduler_proc/runner.py",
        "        if scores_limit is None:\n            return\n",
        "        return\n",
    ),
    Bug(
        "a shared partial page is read and written in one graph (the whole buffer copied)",
        "scheduler_proc/kv_cache.py",
        "            write_slots(self.keys[i], d, k)\n",
        "            write_slots(self.keys[i], d, self.keys[i][:, s])\n",
    ),
    Bug(
        "a decode step asks async_eval for the KV buffers (the next step's first writes copy)",
        "scheduler_proc/runner.py",
        "        states = self.pool.recurrent_state()\n",
        "        states = self.pool.state()\n",
    ),
    # -- long prompts' causal chunks, prompt logprobs ------------------------------------------
    Bug(
        "a lone causal chunk's keys run past its queries (the causal kernel never runs)",
        "scheduler_proc/runner.py",
        "max(plan.starts) + width if lone else",
        "max(plan.starts) + width + 32 if lone else",
    ),
    Bug(
        "prompt logprobs read the logits one position late",
        "scheduler_proc/runner.py",
        "logits[j0 - 1 - c.start : j1 - 1 - c.start]",
        "logits[j0 - c.start : j1 - c.start]",
    ),
    # -- sampling penalties (issue 21: each passed every test file before) ---------------------
    Bug(
        "the repetition penalty ignores the prompt's tokens",
        "scheduler_proc/sampling.py",
        "    seen = prompt_seen | (counts > 0)\n",
        "    seen = counts > 0\n",
    ),
    Bug(
        "the presence penalty is multiplied by the count",
        "scheduler_proc/sampling.py",
        "x = x - state.presence[:, None] * (counts > 0)",
        "x = x - state.presence[:, None] * counts",
    ),
    Bug(
        "chained decode steps never update the penalty counts",
        "scheduler_proc/sampling.py",
        "counts = counts.at[mx.arange(tokens.size), tokens].add(1.0)",
        "counts = counts",
    ),
    Bug(
        "a flooding client's rows are never given back to a starved one",
        "scheduler_proc/seating.py",
        "victim = self._fair_victim(blocked) if blocked is not None else None",
        "victim = None",
    ),
    Bug(
        "waiting requests served first come, first served across clients",
        "scheduler_proc/waiting.py",
        "return min(self._lines, key=lambda c: (rows(c), served.get(c, 0)))",
        "return next(iter(self._lines))",
    ),
    Bug(
        "a paused engine goes on admitting waiting requests",
        "scheduler_proc/admin.py",
        "self.sched.seating = paused is None and not self._holding",
        "self.sched.seating = not self._holding",
    ),
    Bug(
        "new weights leave the old model's KV in the prefix cache",
        "scheduler_proc/admin.py",
        'info["flushed_tokens"] = sched.kv.flush()',
        'info["flushed_tokens"] = 0',
    ),
    Bug(
        "a model change does not wait for running requests",
        "scheduler_proc/admin.py",
        "            while sched.running_requests():\n                yield\n",
        "            sched.abort_all()\n",
    ),
    # -- KV events ------------------------------------------------------------------------------
    Bug(
        "KV events: the eviction of a one-page leaf is never told (no BlockRemoved)",
        "scheduler_proc/kv_event_log.py",
        "        if not hashes:\n            return\n",
        "        if len(hashes) < 2:\n            return\n",
    ),
    Bug(
        "KV events: a split gives the page at the cut to the wrong half",
        "scheduler_proc/kv_event_log.py",
        "n = cut // p - span.start // p",
        "n = (cut - 1) // p - span.start // p",
    ),
    Bug(
        "KV events: a flush clears everything while a running request's prefix stays cached",
        "scheduler_proc/kv_event_log.py",
        "if self.tree.total_tokens == 0:",
        "if self.tree.total_tokens >= 0:",
    ),
    Bug(
        "KV events: stored pages chained to the wrong parent (two pages back)",
        "scheduler_proc/kv_event_log.py",
        "parent = self._hash_of(leaf.parent, first - 1)",
        "parent = self._hash_of(leaf.parent, first - 2)",
    ),
)


@dataclass(frozen=True)
class Result:
    outcome: str  # "caught", "HANG" or "MISSED"
    seconds: float
    detail: str  # the first failing test, or why it hung


def check_bugs(root: Path) -> list[str]:
    """What is wrong with the bug list against the tree at `root`: stale or ambiguous `old`
    texts, bugs that change nothing, duplicate names."""
    problems = []
    names = [b.name for b in BUGS]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{name!r}: two bugs of this name")
    for bug in BUGS:
        path = root / bug.path
        if bug.old == bug.new:
            problems.append(f"{bug.name!r}: `new` is `old`, nothing planted")
        if not path.is_file():
            problems.append(f"{bug.name!r}: {bug.path} does not exist")
            continue
        n = path.read_text().count(bug.old)
        if n != 1:
            problems.append(
                f"{bug.name!r}: its `old` text occurs {n} times in {bug.path}, not once"
            )
    return problems


def _copy_tree(dst: Path) -> None:
    """The work tree's tracked and untracked (not ignored) files, as they are now."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")  # fmt: skip
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def _plant(tree: Path, bug: Bug) -> None:
    path = tree / bug.path
    text = path.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"cannot plant {bug.name!r}: the line is not in {bug.path} exactly once")
    planted = text.replace(bug.old, bug.new)
    try:  # NOTE: a planted syntax error would fail every test: "caught", and meaningless
        compile(planted, str(path), "exec")
    except SyntaxError as e:
        raise SystemExit(f"cannot plant {bug.name!r}: {bug.path} no longer compiles: {e}") from e
    path.write_text(planted)


def _imports_from(tree: Path) -> None:
    """The copy's own code is what the tests import (not the editable install's /work tree)."""
    probe = "import scheduler_proc.kv_cache as m; print(m.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, timeout=120
    )
    where = Path(out.stdout.strip() or "?").resolve()
    if not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"the copied tree imports scheduler_proc from {where}, not from {tree}")


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        m = re.match(r"(FAILED|ERROR) (\S+)", line)
        if m:
            return f"{m.group(1)} {m.group(2)}"
    tail = [line for line in output.splitlines() if line.strip()]
    return tail[-1] if tail else "no output"


def run_tests(tree: Path, tests: list[str], timeout: float, log: Path) -> Result:
    """The tests on `tree`, stopping at the first failure, killed (all its processes) at
    `timeout`; pytest's output goes to `log`."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=tree,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # NOTE: its own process group, so a timeout kills all of it
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Result("HANG", time.monotonic() - t0, f"killed at the {timeout:.0f} s timeout")
        finally:  # NOTE: interrupted (Ctrl-C, SIGTERM): no test run left behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - t0
    if proc.returncode == 0:
        return Result("MISSED", seconds, "every test passed")
    output = log.read_text(errors="replace")
    detail = _first_failure(output)
    if DEADLINE_TEXT in output:
        return Result("HANG", seconds, f"{detail} (a test ran past TEST_TIMEOUT_S)")
    if proc.returncode != 1:  # NOTE: 1: tests failed; 2: interrupted (a collection error), ...
        detail += f" (pytest exit {proc.returncode})"
    return Result("caught", seconds, detail)


def _in_copy(base: Path, tests: list[str], timeout: float, bug: Bug | None, log: Path) -> Result:
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(base, tree, symlinks=True)
        if bug is None:
            _imports_from(tree)
        else:
            _plant(tree, bug)
        return run_tests(tree, tests, timeout, log)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def _stale(root: Path) -> bool:
    problems = check_bugs(root)
    if problems:
        print("stale or broken planted bugs (update scripts/planted_bugs.py):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
    return bool(problems)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # NOTE: so `run_tests` kills its test run on the way out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS))
    ap.add_argument("--bugs", nargs="+", metavar="WORD", help="only bugs whose name has a WORD")
    ap.add_argument("--timeout", type=float, help="seconds per run (default: see above)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the clean run")
    ap.add_argument("--logs", type=Path, help="where each run's pytest output goes")
    ap.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _terminate)
    if _stale(ROOT):
        return 3
    bugs = [b for b in BUGS if not args.bugs or any(w in b.name for w in args.bugs)]
    if args.list:
        for bug in bugs:
            print(f"{bug.path}: {bug.name}")
        return 0
    logs = args.logs or Path(tempfile.gettempdir()) / time.strftime("planted_bugs-%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="planted-base-") as tmp:
        # NOTE: one snapshot of the tree for every run: edits made while the script runs (it
        # takes a while) neither race a copy nor judge one bug on other code than the next.
        base = Path(tmp) / "tree"
        _copy_tree(base)
        if _stale(base):  # NOTE: the tree may have changed since the check above
            return 3
        print(f"pytest output of each run: {logs}", flush=True)
        timeout = args.timeout or MIN_TIMEOUT_S
        if not args.no_baseline:
            clean = _in_copy(base, args.tests, 3 * timeout, None, logs / "00-clean.log")
            print(f"clean tree: {clean.seconds:.0f} s, {clean.detail}", flush=True)
            if clean.outcome != "MISSED":  # NOTE: on the clean tree every test must pass
                print("the clean tree does not pass: no planted bug can be judged", file=sys.stderr)
                return 3
            timeout = args.timeout or max(MIN_TIMEOUT_S, 2 * clean.seconds)
        print(f"{len(bugs)} planted bugs, {timeout:.0f} s each at most", flush=True)
        results: list[tuple[Bug, Result]] = []
        for i, bug in enumerate(bugs, 1):
            log = logs / f"{i:02d}-{_slug(bug.name)}.log"
            r = _in_copy(base, args.tests, timeout, bug, log)
            results.append((bug, r))
            print(f"{r.outcome:6}  {r.seconds:5.0f} s  {bug.name}  <- {r.detail}", flush=True)
    missed = [b.name for b, r in results if r.outcome == "MISSED"]
    hung = [b.name for b, r in results if r.outcome == "HANG"]
    print(f"{len(bugs) - len(missed)} of {len(bugs)} planted bugs caught ({len(hung)} by a hang)")
    for name in missed:
        print(f"MISSED: {name}")
    for name in hung:
        print(f"HANG (a test lacks a bound): {name}")
    return 1 if missed else 2 if hung else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted")
