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
from concurrent.futures import Executor

from engine import heap

LARGE_FRAME_BYTES = 1 << 20
TRIM_DELAY_S = 1.0
# NOTE: the heap's calls live on the ground floor (engine/heap.py): the scheduler trims too.
keep_large_blocks_mapped = heap.keep_large_blocks_mapped


class Trimmer:
    def __init__(self, pool: Executor) -> None:
        self._pool = pool
        self._trim = heap.malloc_trim()
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
