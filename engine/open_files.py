"""The open-file limit: raised to what the system allows, and never lowered behind our back.

Every HTTP connection, SDK socket and model file is a descriptor. At the common soft limit of
1,024, 1,100 idle HTTP connections left the front door unable to accept anything, its ZMQ
endpoint included. Importing `mlx_lm.utils` sets the limit to (2048, 4096): that lowers a higher
hard limit for the rest of the process (an unprivileged process cannot raise it again), and where
the hard limit is below 4,096 it raises `ValueError` and the engine cannot start. `keep_raised`
(run when the `engine` package is imported, before anything imports mlx-lm) turns such a call
into "at least what it asks, within the hard limit, the hard limit untouched".
"""

from __future__ import annotations

import resource
from typing import Any

NOFILE = resource.RLIMIT_NOFILE
# NOTE: macOS reports an unlimited hard limit but refuses a soft one above its per-process cap
FALLBACKS = (1 << 20, 1 << 16, 10240, 4096)

_setrlimit = resource.setrlimit


def raise_limit() -> tuple[int, int]:
    """Raise the soft limit to the hard one (or the largest the system takes); (soft, hard)."""
    soft, hard = resource.getrlimit(NOFILE)
    wanted = [hard] if hard != resource.RLIM_INFINITY else []
    for target in [*wanted, *(f for f in FALLBACKS if f <= hard or not wanted)]:
        if target <= soft:
            break
        try:
            _setrlimit(NOFILE, (target, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(NOFILE)


def keep_raised() -> None:
    """Route every later change of the open-file limit through `_at_least` (idempotent)."""
    resource.setrlimit = _guarded


def _guarded(which: int, limits: Any) -> None:
    if which != NOFILE:
        return _setrlimit(which, limits)
    soft, hard = resource.getrlimit(NOFILE)
    _setrlimit(NOFILE, (_at_least(soft, int(limits[0]), hard), hard))
    return None


def _at_least(soft: int, wanted: int, hard: int) -> int:
    """The soft limit a request for `wanted` leaves: never lower than now, never above hard."""
    if wanted == resource.RLIM_INFINITY:
        wanted = hard
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    return max(soft, wanted)


def describe(limit: int) -> str:
    return "none" if limit == resource.RLIM_INFINITY else str(limit)
