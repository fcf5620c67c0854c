"""Give memory back after large inputs.

NOTE: a huge prompt tokenized on a pool thread leaves glibc's per-thread arenas holding hundreds
of MB after every object is freed (measured: 140 -> 287 MiB after one ~1M-character prompt, back
to 133 MiB after `malloc_trim(0)`); the tokenizer process then looks like it leaks. After a large
frame, and after each pooled tokenization of a large input, the front door asks for a trim: run
on its pool TRIM_DELAY_S later, once for however many asks came in meanwhile.

Trimming alone is not enough under mixed load: glibc raises its mmap threshold to the size of
every large block freed (up to 32 MiB), so later multi-MB buffers come from the heap, interleave
with small live objects and cannot be given back (measured: huge inputs beside ordinary clients
for 10 s left the process at 143 -> 189-204 MiB, trim or not). `keep_large_blocks_mapped` pins
the threshold, so every large buffer is its own mapping and goes back to the OS when freed
(the same load: 124 -> 128 MiB).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable
from concurrent.futures import Executor

LARGE_FRAME_BYTES = 1 << 20
TRIM_DELAY_S = 1.0
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


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim, or None where there is none (macOS, musl)."""
    trim = getattr(_libc(), "malloc_trim", None)
    return (lambda: trim(0)) if trim is not None else None


class Trimmer:
    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._trim = _malloc_trim()
        self._pending = False

    def saw(self, nbytes: int) -> None:
        """Note an input of `nbytes`; a large one asks for a trim (called on the loop)."""
        if nbytes < LARGE_FRAME_BYTES or self._trim is None or self._pending:
            return
        self._pending = True
        asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._run)

    def _run(self) -> None:
        self._pending = False
        try:
            self._pool.submit(self._trim)  # type: ignore[arg-type]
        except RuntimeError:
            pass  # NOTE: the pool is shut down: the process is exiting
