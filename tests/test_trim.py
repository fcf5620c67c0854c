"""The front door gives large client buffers back to the OS (tokenizer_proc.trim)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, sys

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
if sys.argv[1] == "tuned":
    from tokenizer_proc.trim import keep_large_blocks_mapped
    assert keep_large_blocks_mapped()
big = bytearray(20 << 20)
del big  # NOTE: untuned glibc now serves anything under 20 MiB from the heap
before = libc.mallinfo2().hblks
buf = bytearray(2 << 20)
print(libc.mallinfo2().hblks - before)
"""


def _glibc_has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return bool(name) and hasattr(ctypes.CDLL(name), "mallinfo2")


@pytest.mark.skipif(not _glibc_has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize(("mode", "mapped"), [("tuned", 1), ("untuned", 0)])
def test_a_large_buffer_gets_its_own_mapping_after_a_larger_one_was_freed(mode, mapped):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == mapped
