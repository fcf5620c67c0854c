"""The open-file limit: raised by the launcher, never lowered by mlx-lm's import, and no
failure to start where the hard limit is below mlx-lm's 4,096."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

PROBE = """
import resource
{first}
from engine import open_files
raised = open_files.raise_limit()
import mlx_lm.utils  # NOTE: sets (2048, 4096) at import
print(raised[0], resource.getrlimit(resource.RLIMIT_NOFILE)[0], resource.getrlimit(resource.RLIMIT_NOFILE)[1])
"""


def _run(code: str, soft: int, hard: int) -> subprocess.CompletedProcess:
    # NOTE: the limit is set by the child itself, first: a preexec_fn in this many-threaded
    # process can deadlock the fork (it hung the whole suite once)
    first = f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
    return subprocess.run(
        [sys.executable, "-c", first + code], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def hard() -> int:
    _, h = resource.getrlimit(resource.RLIMIT_NOFILE)
    if h != resource.RLIM_INFINITY and h < 1024:
        pytest.skip(f"this machine's hard open-file limit is {h}")
    return 1024


def test_a_hard_limit_below_mlx_lms_4096_still_starts_and_is_used(hard):
    if os.geteuid() != 0:  # NOTE: root may raise a hard limit: nothing fails there
        bare = _run("import mlx_lm.utils", 256, hard)
        assert bare.returncode != 0 and "ValueError" in bare.stderr  # NOTE: what the guard stops
    r = _run(PROBE.format(first="import engine"), 256, hard)
    assert r.returncode == 0, r.stderr
    raised, after, after_hard = map(int, r.stdout.split())
    assert raised == after == after_hard == hard


def test_mlx_lm_never_lowers_a_raised_limit():
    soft, h = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = h if h != resource.RLIM_INFINITY else 65536
    if top <= 4096:
        pytest.skip(f"this machine's hard open-file limit is {h}")
    r = _run(PROBE.format(first="import engine"), 1024, top)
    assert r.returncode == 0, r.stderr
    raised, after, after_hard = map(int, r.stdout.split())
    assert raised > 4096 and after == raised and after_hard == top
