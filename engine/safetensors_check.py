"""Check a safetensors file's structure before MLX reads it.

Weights and adapters are read on request, while the engine serves (`update_weights_from_disk`,
`load_lora_adapter`). MLX's reader answers a damaged file with a bare `RuntimeError` ("[json.
exception.parse_error.101] ..." for a corrupt header), which named neither the file nor the
request's field and came back as a 500. This module reads the header in Python and checks every
tensor's byte range against its dtype, shape and the file's size, so a bad file is a `ValueError`
naming the file and what is wrong, before anything is changed. Tensor data is not read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

# NOTE: bytes per element of each safetensors dtype
ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
# NOTE: the format's own limit on the header (100 MB), so a garbage length is not read whole
MAX_HEADER = 100_000_000


def check_file(path: Path) -> None:
    """`ValueError` naming the file and its first problem, if it is not a whole safetensors."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header = _header(f.read(8), f, size)
    except OSError as e:
        raise ValueError(f"{path.name}: unreadable: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None
    data = size - 8 - header.pop("__length__")
    for name, entry in header.items():
        if name != "__metadata__":
            _check_tensor(name, entry, data, path.name)


def check_dir(directory: Path) -> None:
    """`check_file` for every safetensors file in `directory`."""
    for path in sorted(directory.glob("*.safetensors")):
        check_file(path)


def _header(prefix: bytes, f: Any, size: int) -> dict[str, Any]:
    if len(prefix) < 8:
        raise ValueError("not a safetensors file (shorter than its header's length)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER, size - 8):
        raise ValueError(f"corrupt header: its length ({length}) runs past the file ({size} B)")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError("corrupt header: not a JSON object")
    return {**header, "__length__": length}


def _check_tensor(name: str, entry: Any, data: int, file: str) -> None:
    where = f"{file}: tensor {name!r}"
    if not isinstance(entry, dict) or entry.get("dtype") not in ITEM_BYTES:
        raise ValueError(f"{where}: unknown dtype in {entry!r:.80}")
    shape, offsets = _ints(entry.get("shape")), _ints(entry.get("data_offsets"))
    if shape is None or offsets is None or len(offsets) != 2:
        raise ValueError(f"{where}: corrupt shape or data_offsets")
    start, end = offsets
    if not 0 <= start <= end or end - start != math.prod(shape) * ITEM_BYTES[entry["dtype"]]:
        raise ValueError(f"{where}: its byte range does not match its dtype and shape")
    if end > data:
        raise ValueError(f"{where}: runs past the end of the file (truncated?)")


def _ints(value: Any) -> list[int] | None:
    """`value` if it is a list of non-negative ints, else None."""
    ok = isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
    return value if ok else None
