"""The kernel's cap on a listen backlog (somaxconn), and one warning when it cuts the one asked for.

`listen(1024)` gets at most somaxconn pending connections, silently: macOS's default is 128, Linux's
4096 on new kernels and 128 on old ones. A burst of new clients beyond it has connections dropped,
which their kernels retry a second or more later.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger("tokenizer.http")

PROC_PATH = Path("/proc/sys/net/core/somaxconn")  # NOTE: Linux
SYSCTL = ("sysctl", "-n", "kern.ipc.somaxconn")  # NOTE: macOS (and the BSDs)
SYSCTL_TIMEOUT_S = 2.0
RAISE = {
    "linux": "sudo sysctl -w net.core.somaxconn={n}",
    "darwin": "sudo sysctl -w kern.ipc.somaxconn={n}",
}


def listen_cap(platform: str) -> int | None:
    """somaxconn on `platform` (a `sys.platform` value); None where it cannot be read."""
    try:
        if platform.startswith("linux"):
            return int(PROC_PATH.read_text())
        if platform == "darwin":
            return int(_sysctl())
    except (OSError, ValueError, subprocess.SubprocessError):
        pass  # NOTE: a probe for a warning: whatever fails, the server starts as it would
    return None


def _sysctl() -> str:
    done = subprocess.run(
        SYSCTL, capture_output=True, text=True, timeout=SYSCTL_TIMEOUT_S, check=True
    )
    return done.stdout


def warn_if_capped(backlog: int, platform: str) -> int:
    """The backlog the kernel grants; a warning naming the command that raises the cap when it
    is below `backlog`."""
    cap = listen_cap(platform)
    if cap is None or cap >= backlog:
        return backlog
    fix = RAISE.get("linux" if platform.startswith("linux") else platform, "raise somaxconn")
    log.warning(
        "HTTP listen backlog: %d asked, the kernel grants %d (somaxconn): a burst of new "
        "connections beyond it is dropped and retried a second or more later; raise it: %s",
        backlog,
        cap,
        fix.format(n=backlog),
    )
    return cap
