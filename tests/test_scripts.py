"""README's commands as a newcomer types them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_launch_script_passes_options_through_to_the_cli():
    """`./scripts/launch --zmq-port N ...` once handed `--zmq-port` to pip as a package extra."""
    done = subprocess.run(
        [str(ROOT / "scripts" / "launch"), "--zmq-port", "30999", "--help"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "--zmq-port" in done.stdout and "--max-running-requests" in done.stdout


NO_MODEL = (
    "bench_kv_cache.py",
    "bench_decode_attention.py",
    "bench_prefill_attention.py",
    "bench_lone_reads.py",
    "bench_host_copy.py",
)
# NOTE: scripts that launch the engine or build token masks need a model with its tokenizer
WITH_TOKENIZER = (
    "bench_agent.py",
    "bench_fairness.py",
    "bench_grammar.py",
    "bench_operations.py",
    "check_structured.py",
)
SCRIPT_RUNS = {
    "bench_kv_cache.py": ["--batch", "2", "--length", "32"],
    "bench_decode_attention.py": [
        "--batch",
        "2",
        "--context",
        "8",
        "--row-len",
        "16",
        "--iters",
        "1",
    ],
    "bench_decode_step.py": ["--batch", "2", "--context", "8", "--steps", "2"],
    "profile_decode.py": ["--batch", "2", "--context", "8", "--steps", "1"],
    "profile_scheduler.py": [
        *("--concurrency", "2", "--num-requests", "3", "--prompt", "4:9", "--output", "2"),
        *("--waves", "1", "--set", "max_total_tokens=4096"),
    ],
    "bench_prefill_attention.py": ["--shapes", "2x4x16", "--heads", "4", "--kv-heads", "2"],
    "bench_lone_reads.py": [
        *("--rows", "3", "--layers", "1", "--keys", "64", "--width", "16", "--heads", "4/2"),
        *("--repeats", "1"),
    ],
    "bench_host_copy.py": [
        *("--dim", "32", "--tokens", "4", "--layers", "2", "--every", "2", "--flush-mb", "1"),
        *("--pool-gb", "0.01", "--seconds", "0.3"),
    ],
    "bench_agent.py": ["--system-tokens", "40", "--turns", "2", "--max-tokens", "2"],
    "bench_fairness.py": ["--flood-requests", "3", "--output-len", "8", "--seconds", "1"],
    "bench_grammar.py": ["--rows", "4", "--tokens", "3", "--mix", "0.5"],
    "bench_operations.py": ["--streams", "2", "--output-len", "8", "--hold", "0.2"],
    "check_structured.py": ["--samples", "2", "--batch", "2", "--max-tokens", "12"],
    "bench_scheduler.py": [
        *("--num-requests", "2", "--max-tokens", "2", "--min-tokens", "1", "--min-prompt", "2"),
        *("--max-prompt", "8", "--concurrency", "2", "--single-tokens", "3", "--skip", "stagger"),
    ],
}


@pytest.mark.parametrize("script", sorted(SCRIPT_RUNS))
def test_benchmark_scripts_run_on_a_tiny_model(script, request):
    """The benchmarks use the scheduler's internals; a tiny run keeps them from rotting."""
    argv = [sys.executable, str(ROOT / "scripts" / script), *SCRIPT_RUNS[script]]
    if script not in NO_MODEL:
        fixture = "tiny_model_dir" if script in WITH_TOKENIZER else "tiny_weights_dir"
        argv += ["--model", str(request.getfixturevalue(fixture))]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_router_benchmark_runs_on_a_tiny_model(tiny_model_dir, tmp_path):
    """scripts/bench_router.py: engines, smg in front, `mlx-engine bench` through both setups."""
    import json

    pytest.importorskip("smg", reason="smg has wheels for Linux x86_64 and macOS arm64 only")
    argv = [sys.executable, str(ROOT / "scripts" / "bench_router.py")]
    argv += ["--model", str(tiny_model_dir), "--users", "2", "--turns", "2", "--system-len", "20"]
    argv += ["--input-len", "4:8", "--output-len", "4", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "router.json").read_text())
    assert [r["errors"] for r in rows] == [0, 0] and all(r["requests"] == 8 for r in rows)


def _launchers_under(pid: int) -> list[int]:
    """The engine launchers `pid` started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"launch" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _engines_under(pid: int) -> set[int]:
    """Sessions of the engine launchers `pid` started (bench_restart's run in their own)."""
    sessions = set()
    for launcher in _launchers_under(pid):
        try:
            sessions.add(os.getsid(launcher))
        except OSError:
            continue
    return sessions


def _gone(pid: int) -> bool:
    """Exited (or a zombie, waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def _alive_in(session: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session and not _gone(int(entry.name)):
                    alive.append(int(entry.name))
            except OSError:
                continue
    return alive


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_benchmark_stopped_by_sigterm_stops_the_engines_it_started(tiny_model_dir):
    """`timeout 200 python3 scripts/bench_restart.py` ran past its limit and left its engines
    running in their own sessions, holding the port and the GPU's memory: the next benchmark's
    engine could not allocate. SIGTERM now unwinds the script, which stops them."""
    argv = [sys.executable, str(ROOT / "scripts" / "bench_restart.py"), "--repeats", "1"]
    argv += ["--model", str(tiny_model_dir), "--system-words", "20"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (sessions := _engines_under(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no engine started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive_in(s) for s in sessions) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for s in sessions for p in _alive_in(s)], "engine processes left running"
    finally:
        proc.kill()
        proc.wait()
        for s in sessions if "sessions" in locals() else ():
            for p in _alive_in(s):
                os.kill(p, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_the_process_benchmark_stopped_by_sigterm_stops_its_engine(tiny_model_dir):
    """bench_process.py starts its engine as its own child; stopped by SIGTERM (a `timeout`)
    it ended at once and left that engine running, orphaned."""
    argv = [sys.executable, str(ROOT / "scripts" / "bench_process.py"), "--only", "sdk"]
    argv += ["--model", str(tiny_model_dir), "--requests", "100000", "--max-tokens", "64"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    launchers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (launchers := _launchers_under(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, "no engine started"
            time.sleep(0.1)
        time.sleep(2.0)  # NOTE: starting or just started: either way it must go
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in launchers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in launchers), "the engine was left running"
    finally:
        proc.kill()
        proc.wait()
        for p in launchers:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
