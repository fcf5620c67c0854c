"""glibc's heap, asked to give memory back: freed memory otherwise stays with the process (its
arenas keep it), and a long-running engine looks like it leaks. No-ops where the C library is not
glibc (macOS, musl)."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

MMAP_THRESHOLD_BYTES = 256 << 10
_M_MMAP_THRESHOLD = -3  # NOTE: glibc's mallopt parameter number (malloc.h)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def keep_large_blocks_mapped() -> bool:
    """Serve blocks over MMAP_THRESHOLD_BYTES from their own mappings; False where not glibc."""
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0), or None where there is none."""
    trim = getattr(_libc(), "malloc_trim", None)
    return (lambda: trim(0)) if trim is not None else None
