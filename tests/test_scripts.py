"""README's commands as a newcomer types them."""

from __future__ import annotations

import subprocess
from pathlib import Path

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
