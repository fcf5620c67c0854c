"""Check a GGUF file's structure before MLX reads it.

MLX's GGUF reader trusts the header: a corrupt tensor table (seen: a flipped byte in a tensor's
dimensions or offset) makes `mx.load` read out of bounds and the process dies with SIGSEGV. This
module walks the header in Python with every length and offset checked against the file, so a
corrupt file is a `ModelError` naming what is wrong, never a signal. Tensor data is not read.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import BinaryIO

from engine.errors import ModelError

MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
# NOTE: (elements per block, bytes per block) of the ggml types, by type id.
BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 36),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    30: (1, 2),  # BF16
}
# NOTE: metadata value types: fixed sizes by id; 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class _Reader:
    """Sequential reads that never go past the end of the file."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size

    @property
    def pos(self) -> int:
        return self.f.tell()

    def bytes(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise ModelError(f"{what} extends past the end of the file")
        return self.f.read(n)

    def unpack(self, fmt: str, what: str) -> int | float | bool:
        return struct.unpack("<" + fmt, self.bytes(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = int(self.unpack("Q", what))
        try:
            return self.bytes(n, what).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelError(f"{what} is not UTF-8: {e}") from None

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise ModelError(f"{what} extends past the end of the file")
        self.f.seek(n, 1)


def check_gguf(path: Path) -> None:
    """Raise `ModelError` when the header of `path` is inconsistent with the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        try:
            _check(_Reader(f, size), size)
        except ModelError as e:
            raise ModelError(f"{path}: corrupt GGUF: {e}") from None


def _check(r: _Reader, size: int) -> None:
    if r.bytes(4, "magic") != b"GGUF":
        raise ModelError("bad magic")
    version = r.unpack("I", "version")
    if version not in (2, 3):
        raise ModelError(f"unsupported GGUF version {version}")
    n_tensors = int(r.unpack("Q", "tensor count"))
    n_kv = int(r.unpack("Q", "metadata count"))
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        value = _value(r, int(r.unpack("I", f"type of {key}")), key)
        if key == "general.alignment":
            alignment = _alignment(value)
    tensors = [_tensor_info(r, i) for i in range(_count(n_tensors, size, "tensors"))]
    data_start = -(-r.pos // alignment) * alignment
    for name, nbytes, offset in tensors:
        if offset % alignment:
            raise ModelError(f"tensor {name!r}: offset {offset} is not aligned to {alignment}")
        if data_start + offset + nbytes > size:
            raise ModelError(f"tensor {name!r} extends past the end of the file")


def _count(n: int, size: int, what: str) -> int:
    # NOTE: every entry takes at least one byte, so more entries than bytes is corrupt; this
    # bounds the loops before anything is allocated.
    if n > size:
        raise ModelError(f"{n} {what} cannot fit a {size}-byte file")
    return n


def _value(r: _Reader, kind: int, key: str, depth: int = 0) -> object:
    if kind in _SCALARS:
        return r.unpack(_SCALARS[kind], key)
    if kind == _STRING:
        return r.string(key)
    if kind != _ARRAY or depth >= MAX_DIMS:
        raise ModelError(f"metadata {key!r} has unknown type {kind} (or arrays nested too deep)")
    item = int(r.unpack("I", f"item type of {key}"))
    n = _count(int(r.unpack("Q", f"length of {key}")), r.size, f"items of {key!r}")
    if item in _SCALARS:
        r.skip(n * struct.calcsize(_SCALARS[item]), key)
    elif item == _STRING:
        for _ in range(n):
            r.skip(int(r.unpack("Q", key)), key)
    else:
        for _ in range(n):
            _value(r, item, key, depth + 1)
    return None


def _alignment(value: object) -> int:
    if not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise ModelError(f"general.alignment must be a power of two, got {value!r}")
    return value


def _tensor_info(r: _Reader, i: int) -> tuple[str, int, int]:
    name = r.string(f"name of tensor {i}")
    n_dims = int(r.unpack("I", f"dimensions of {name!r}"))
    if not 1 <= n_dims <= MAX_DIMS:
        raise ModelError(f"tensor {name!r} has {n_dims} dimensions")
    dims = [int(r.unpack("Q", f"shape of {name!r}")) for _ in range(n_dims)]
    kind = int(r.unpack("I", f"type of {name!r}"))
    offset = int(r.unpack("Q", f"offset of {name!r}"))
    if kind not in BLOCKS:
        raise ModelError(f"tensor {name!r} has unknown type {kind}")
    block, block_bytes = BLOCKS[kind]
    if 0 in dims or dims[0] % block:
        raise ModelError(f"tensor {name!r}: shape {dims} does not fit its type's blocks")
    elements = math.prod(dims)
    if elements > r.size * block:  # NOTE: bounds the product before it overflows anything
        raise ModelError(f"tensor {name!r}: shape {dims} is larger than the file")
    return name, elements // block * block_bytes, offset
