"""A safetensors file written one tensor at a time, so that long writes can report as they go
(`mx.save_safetensors` writes a whole model in one silent call: minutes for a large GGUF).

The format: an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
byte range in the data; `__metadata__`), padded with spaces to a multiple of 8, then the tensors'
bytes back to back in the header's order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
}


def write_safetensors(
    path: Path,
    tensors: dict[str, mx.array],
    metadata: dict[str, str],
    written: Callable[[int], None],
) -> None:
    """Write `tensors` to `path`, evaluating each only when its turn comes; `written(nbytes)`
    after each."""
    with Path(path).open("wb") as f:
        header = _header(tensors, metadata)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for value in tensors.values():
            # NOTE: a byte view of a row-major copy: the file holds C-order data of any dtype
            # (bfloat16 has no numpy type to go through)
            data = mx.contiguous(value).reshape(-1).view(mx.uint8)
            f.write(np.asarray(data).data)
            written(value.nbytes)


def _header(tensors: dict[str, mx.array], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, value in tensors.items():
        end = offset + value.nbytes
        entries[name] = {
            "dtype": DTYPES[value.dtype],
            "shape": value.shape,
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)
