"""One block of KV on disk: a file that is whole and checked, or refused with a reason.

A file holds the K and V of every full-attention layer for one block of tokens, under a header
naming what they are (the model's identity, the KV format, the block's chain key, its parent's
key, its position and its tokens):

    MAGIC | header length (u32 LE) | header (JSON) | arrays (raw, in header order) | digest

The digest (CRC-32, 4 bytes) covers everything before it, so a truncated, torn or flipped file
fails the check. It guards against damage, not against someone who may write the folder (they
could write any KV): CRC-32 checks ~3.9 GB/s where BLAKE2b checked 0.9 on one core, and a
restart's load is checked on its way in (a 2,000-word prompt's 83 MB of a 1B model's KV: ~90 ms
of BLAKE2b against ~90 ms to compute it again on an H100). Files are written to a temporary name
in the same folder, flushed to the disk and renamed: a reader sees a whole file or none, whatever
kills the writer (`kill -9`, power). Nothing here knows MLX: arrays are numpy (bfloat16 travels
as its bits, uint16).
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"MLXEKV02"  # NOTE: 01 (BLAKE2b) files are refused as not ours, then skipped
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
DIGEST = _CRC.size
MAX_HEADER = 1 << 22  # NOTE: a block's tokens are a few hundred ints; more is not ours
TMP_SUFFIX = ".tmp"
# NOTE: numpy has no bfloat16: its bits travel as uint16 and the header names the real dtype
_BITS = {"bfloat16": np.uint16}


class KVFileError(ValueError):
    """A file that is not a whole, checked block of the KV asked for (the reason says why)."""


def dump(path: Path, header: dict[str, Any], arrays: list[np.ndarray], dtypes: list[str]) -> int:
    """Write `arrays` (named `dtypes`: MLX's names) under `header` to `path` atomically;
    returns the bytes written."""
    head = dict(header, arrays=[[d, list(a.shape)] for a, d in zip(arrays, dtypes, strict=True)])
    meta = json.dumps(head, separators=(",", ":")).encode()
    crc = 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    size = 0
    try:
        with open(tmp, "wb") as f:
            parts: list[bytes | memoryview] = [MAGIC, _LEN.pack(len(meta)), meta]
            for part in parts + [_bytes(a) for a in arrays]:
                crc = zlib.crc32(part, crc)
                f.write(part)
                size += len(part)
            f.write(_CRC.pack(crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size + DIGEST


def load(path: Path, expect: dict[str, Any], max_bytes: int) -> list[np.ndarray]:
    """The arrays of the block at `path`, whose header must hold every item of `expect`
    (identity, format, key, parent, start, tokens); `KVFileError` when it is not exactly
    that, whole, and at most `max_bytes` long; `OSError` when it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise KVFileError(f"larger than a block ({max_bytes} bytes)")
    body = memoryview(data)[:-DIGEST] if len(data) > DIGEST else memoryview(b"")
    if len(data) < len(MAGIC) + _LEN.size + DIGEST or bytes(body[: len(MAGIC)]) != MAGIC:
        raise KVFileError("not a KV block file (no magic), or truncated")
    if _CRC.pack(zlib.crc32(body)) != data[-DIGEST:]:
        raise KVFileError("checksum mismatch (truncated or corrupt)")
    (n,) = _LEN.unpack_from(body, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if n > MAX_HEADER or start + n > len(body):
        raise KVFileError("header length out of range")
    try:
        header = json.loads(bytes(body[start : start + n]))
    except ValueError as e:
        raise KVFileError(f"header is not JSON: {e}") from None
    for k, v in expect.items():
        if not isinstance(header, dict) or header.get(k) != v:
            raise KVFileError(f"header {k} differs from the block asked for")
    return _arrays(body[start + n :], header.get("arrays"))


def numpy_dtype(name: str) -> np.dtype:
    """Where an array named `name` (MLX's dtype name) lives in numpy: bfloat16 as its bits."""
    return np.dtype(_BITS.get(name, name))


def _arrays(payload: memoryview, specs: Any) -> list[np.ndarray]:
    if not isinstance(specs, list):
        raise KVFileError("header lists no arrays")
    out, at = [], 0
    for spec in specs:
        try:
            name, shape = str(spec[0]), tuple(int(s) for s in spec[1])
            dtype = numpy_dtype(name)
        except (TypeError, ValueError, IndexError) as e:
            raise KVFileError(f"bad array entry {spec!r}: {e}") from None
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if min(shape, default=0) < 0 or at + n > len(payload):
            raise KVFileError("arrays run past the end of the file")
        out.append(np.frombuffer(payload[at : at + n], dtype=dtype).reshape(shape))
        at += n
    if at != len(payload):
        raise KVFileError("bytes left over after the arrays")
    return out


def _bytes(a: np.ndarray) -> memoryview:
    """An array's bytes in order; an empty array's none (a snapshot at a block's end has no
    tail tokens: a memoryview of zero length cannot be cast)."""
    if a.size == 0:
        return memoryview(b"")
    return memoryview(np.ascontiguousarray(a)).cast("B")  # type: ignore[arg-type]
