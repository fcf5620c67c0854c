"""The prefix cache's disk tier (`--kv-cache-dir`): blocks of KV kept in files across restarts.

A block is `block` tokens (a whole number of pages) at a position that is a multiple of it. Its
key chains every token before it: key(k) = BLAKE2b(key(k - 1) + tokens of block k), key(-1)
being the model's identity and the KV format, so one key names one exact prefix of one model's
KV. Files live in `DIR/<identity>/<key>.kv` (kv_files.py: atomic, checksummed), least recently
used first out once the folder holds more than `--kv-cache-disk-gb` (every identity's files
count: one budget for the folder).

The scheduler's thread only looks up keys and hands work over; threads of this module do the
I/O: one writes (the arrays the scheduler gathered, brought to the host there), one loads (a
request's blocks, which it waits for out of the seating pass; `READERS` read and check them,
and copy each into its place in one array a layer's K or V: `Loaded.joined`). A file that is
missing, corrupt, foreign or half-written is skipped with a log line, and never read again: a
load stops at the first block it cannot use.

Models with window rings or recurrent state (a slot per request) hit only where a snapshot of
the slot exists (snapshots.py), at any token. Such a snapshot goes to disk as a file of its own,
`DIR/<identity>/<anchor>+<length>+<key>.kv`: the slot's arrays and the K/V of the tokens after
the last whole block (the anchor: that block's key, or the root's). Its key chains the anchor
and those tokens. The index keeps the snapshots by anchor, so a prompt's candidates are found by
walking its blocks' keys.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scheduler_proc import kv_files

log = logging.getLogger(__name__)

SUFFIX = ".kv"
SNAP = "+"  # NOTE: a snapshot's file name: <anchor>+<length>+<key>.kv
# NOTE: a temporary file older than this is a writer's that died (kill -9); younger, it may be
# another engine's on the same folder, still writing.
STALE_TMP_S = 3600.0
WRITER_BYTES = 512 << 20  # NOTE: what the writer may hold in memory, waiting for the disk
# NOTE: a load's blocks are read and checked this many at once (file reads and CRC-32 let go of
# the GIL): a restart's first request waits for all of them
READERS = 4


Arrays = tuple[tuple[str, tuple[int, ...]], ...]  # NOTE: (dtype, shape) each
# NOTE: a file's arrays, made on the writer's thread when it writes them (the device-to-host
# copy runs there, never on the step's thread)
HostArrays = Callable[[], list[np.ndarray]]


@dataclass(frozen=True)
class BlockFormat:
    """What a block file of this engine holds: per full-attention layer K then V, each
    `(kv_heads, block, dim)` of `dtype` (MLX's name); `slots`: a slot's snapshot's arrays (rings,
    then recurrent state), for models that have them."""

    block: int
    arrays: Arrays
    slots: Arrays = ()

    @property
    def nbytes(self) -> int:
        return _nbytes(self.arrays)

    def snapshot(self, tail: int) -> Arrays:
        """A snapshot file's arrays: the K/V of `tail` tokens (fewer than a block), the slot's."""
        return tuple((d, (s[0], tail, *s[2:])) for d, s in self.arrays) + self.slots

    def snapshot_nbytes(self, tail: int) -> int:
        return _nbytes(self.snapshot(tail))

    def describe(self) -> str:
        text = f"v1 block={self.block} " + ";".join(f"{d}{list(s)}" for d, s in self.arrays)
        if self.slots:
            text += " slots " + ";".join(f"{d}{list(s)}" for d, s in self.slots)
        return text


@dataclass(eq=False)
class Loaded:
    """What a load read: whole blocks in order, and the snapshot after them when one was asked
    for and every block came."""

    blocks: list[list[np.ndarray]]
    snapshot: list[np.ndarray] | None = None
    read_s: float = 0.0  # NOTE: the loader's time: files read, checked and parsed
    # NOTE: per array, every block's tokens in order (`blocks` are views of these): one host
    # array a layer's K or V to bring to the device, copied into place by the readers
    joined: list[np.ndarray] = field(default_factory=list)


class DiskCache:
    def __init__(self, root: Path, capacity_bytes: int, fmt: BlockFormat, identity: str) -> None:
        self.root, self.capacity, self.fmt = root, capacity_bytes, fmt
        self.block = fmt.block
        root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # NOTE: every block file under root, least recently used first: path -> bytes
        self._lru: OrderedDict[Path, int] = OrderedDict()
        self.bytes = 0
        self._pending: set[bytes] = set()  # keys handed to the writer, not yet on disk
        # NOTE: snapshot files by their anchor (the key of the last whole block before them)
        self._snaps: dict[bytes, set[tuple[int, bytes]]] = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-load")
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kv-disk-read")
        self.written_bytes = self.read_bytes = self.hit_tokens = 0
        self.evicted_files = self.skipped_files = self.dropped_blocks = 0
        self._queued_bytes = 0
        self.set_identity(identity)
        self._scan()

    def set_identity(self, identity: str) -> None:
        """The model's identity (`model_identity.fingerprint`): keys and the folder follow it."""
        self.identity = identity
        seed = f"{identity}|{self.fmt.describe()}".encode()
        self._root_key = hashlib.blake2b(seed, digest_size=16).digest()
        self.folder = self.root / self._root_key.hex()
        self.folder.mkdir(parents=True, exist_ok=True)

    # -- keys ------------------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int], n_blocks: int) -> list[bytes]:
        """The chain keys of the first `n_blocks` blocks of `tokens`."""
        out, key, b = [], self._root_key, self.block
        for k in range(n_blocks):
            chunk = np.asarray(tokens[k * b : (k + 1) * b], dtype="<i4").tobytes()
            key = hashlib.blake2b(key + chunk, digest_size=16).digest()
            out.append(key)
        return out

    def anchor(self, keys: list[bytes], length: int) -> bytes:
        """The key a snapshot at `length` tokens hangs from: its last whole block's, or the
        root's (`keys`: at least its whole blocks')."""
        n = length // self.block
        return keys[n - 1] if n else self._root_key

    def snapshot_key(self, tokens: Sequence[int], length: int, anchor: bytes) -> bytes:
        """The key of a snapshot of `tokens[:length]`: the anchor and the tokens after it."""
        tail = tokens[length // self.block * self.block : length]
        chunk = np.asarray(tail, dtype="<i4").tobytes()
        return hashlib.blake2b(anchor + b"snapshot" + chunk, digest_size=16).digest()

    def snapshots(self, anchor: bytes) -> list[tuple[int, bytes]]:
        """The snapshots on disk hanging from `anchor`: (length, key) each."""
        with self._lock:
            return sorted(self._snaps.get(anchor, ()), reverse=True)

    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _snap_path(self, anchor: bytes, length: int, key: bytes) -> Path:
        return self.folder / f"{anchor.hex()}{SNAP}{length}{SNAP}{key.hex()}{SUFFIX}"

    def wants_snapshot(self, anchor: bytes, length: int, key: bytes) -> bool:
        """Neither on disk nor being written."""
        with self._lock:
            return (
                self._snap_path(anchor, length, key) not in self._lru and key not in self._pending
            )

    def has(self, key: bytes) -> bool:
        return self._path(key) in self._lru

    def present(self, keys: list[bytes], first: int) -> int:
        """How many blocks from `first` on have a file (by the index, not read)."""
        n = first
        with self._lock:
            while n < len(keys) and self._path(keys[n]) in self._lru:
                n += 1
        return n - first

    def wanted(self, keys: list[bytes]) -> list[int]:
        """The blocks neither on disk nor being written."""
        with self._lock:
            return [
                k
                for k, key in enumerate(keys)
                if self._path(key) not in self._lru and key not in self._pending
            ]

    # -- writes ----------------------------------------------------------------------------------
    def store(
        self, tokens: Sequence[int], keys: list[bytes], blocks: dict[int, HostArrays]
    ) -> None:
        """Write `blocks` (block index -> its arrays in `fmt` order, made by the writer) in the
        background; dropped (counted) when the writer is behind by more than `WRITER_BYTES`."""
        for k, arrays in blocks.items():
            key = keys[k]
            with self._lock:
                if key in self._pending or self._queued_bytes > WRITER_BYTES:
                    self.dropped_blocks += key not in self._pending
                    continue
                self._pending.add(key)
                self._queued_bytes += self.fmt.nbytes
            header = self._header(tokens, keys, k)
            self._writer.submit(self._write, key, header, arrays, self._path(key), self.fmt.nbytes)

    def store_snapshot(
        self, tokens: Sequence[int], length: int, anchor: bytes, arrays: HostArrays
    ) -> None:
        """Write the snapshot of `tokens[:length]` (`arrays`: its tail's K/V, then the slot's)
        in the background; dropped (counted) when the writer is behind."""
        key = self.snapshot_key(tokens, length, anchor)
        size = self.fmt.snapshot_nbytes(length % self.block)
        with self._lock:
            if key in self._pending or self._queued_bytes > WRITER_BYTES:
                self.dropped_blocks += key not in self._pending
                return
            self._pending.add(key)
            self._queued_bytes += size
        header = self._snap_header(tokens, length, anchor, key)
        path = self._snap_path(anchor, length, key)
        self._writer.submit(self._write, key, header, arrays, path, size)

    def _snap_header(self, tokens: Sequence[int], length: int, anchor: bytes, key: bytes) -> dict:
        start = length // self.block * self.block
        return {
            "identity": self.identity,
            "format": self.fmt.describe(),
            "key": key.hex(),
            "parent": anchor.hex(),
            "start": start,
            "tokens": [int(t) for t in tokens[start:length]],
            "arrays": [[d, list(s)] for d, s in self.fmt.snapshot(length - start)],
        }

    def _header(self, tokens: Sequence[int], keys: list[bytes], k: int) -> dict:
        b = self.block
        parent = keys[k - 1] if k else self._root_key
        return {
            "identity": self.identity,
            "format": self.fmt.describe(),
            "key": keys[k].hex(),
            "parent": parent.hex(),
            "start": k * b,
            "tokens": [int(t) for t in tokens[k * b : (k + 1) * b]],
            "arrays": [[d, list(s)] for d, s in self.fmt.arrays],
        }

    def _write(self, key: bytes, header: dict, arrays: HostArrays, path: Path, queued: int) -> None:
        try:
            size = kv_files.dump(path, header, arrays(), [d for d, _ in header["arrays"]])
        except Exception as e:  # NOTE: a full disk or a bad folder costs the block, not the engine
            log.warning("KV disk cache: could not write %s: %s", path.name, e)
            return
        finally:
            with self._lock:
                self._pending.discard(key)
                self._queued_bytes -= queued
        with self._lock:
            self.written_bytes += size
            self._add(path, size)
        self._evict()

    # -- loads -----------------------------------------------------------------------------------
    def load(
        self, tokens: Sequence[int], keys: list[bytes], first: int, n: int, snapshot: int = 0
    ) -> Future[Loaded]:
        """Read blocks `first .. first + n - 1` in the background: the arrays of those that are
        whole and what was asked, in order, up to the first that is not; then, when every one
        came, the snapshot of `tokens[:snapshot]` (0: none asked)."""
        return self._loader.submit(self._load, list(tokens), keys, first, n, snapshot)

    def _load(
        self, tokens: list[int], keys: list[bytes], first: int, n: int, snapshot: int
    ) -> Loaded:
        out, t, b = Loaded([]), time.perf_counter(), self.block
        joined = [
            np.empty((s[0], n * b, *s[2:]), kv_files.numpy_dtype(d)) for d, s in self.fmt.arrays
        ]
        reads = [
            self._readers.submit(
                self._read_into,
                self._path(keys[k]),
                self._header(tokens, keys, k),
                [a[:, i * b : (i + 1) * b] for a in joined],
            )
            for i, k in enumerate(range(first, first + n))
        ]
        for read in reads:
            arrays = read.result()
            if arrays is None:
                break
            out.blocks.append(arrays)
        out.joined = [a[:, : len(out.blocks) * b] for a in joined]
        if snapshot and len(out.blocks) == n:
            anchor = self.anchor(keys, snapshot)
            key = self.snapshot_key(tokens, snapshot, anchor)
            header = self._snap_header(tokens, snapshot, anchor, key)
            size = self.fmt.snapshot_nbytes(snapshot % self.block)
            out.snapshot = self._read(self._snap_path(anchor, snapshot, key), header, size)
        out.read_s = time.perf_counter() - t
        return out

    def _read_into(self, path: Path, header: dict, into: list[np.ndarray]) -> list | None:
        """`_read` of a block, its arrays copied into `into` (their places in `Loaded.joined`,
        on this reader's thread: numpy lets go of the GIL while it copies)."""
        arrays = self._read(path, header, self.fmt.nbytes)
        if arrays is None:
            return None
        for dest, a in zip(into, arrays, strict=True):
            dest[...] = a
        return into

    def _read(self, path: Path, header: dict, size: int) -> list[np.ndarray] | None:
        """The arrays of the file at `path`, checked against `header`; None (skipped) when it
        is not that, whole."""
        try:
            arrays = kv_files.load(path, header, size + kv_files.MAX_HEADER)
        except (OSError, kv_files.KVFileError) as e:
            self._skip(path, e)
            return None
        with self._lock:
            self.read_bytes += size
            if path in self._lru:
                self._lru.move_to_end(path)
        _touch(path)  # NOTE: its age on disk orders the LRU after a restart
        return arrays

    def _skip(self, path: Path, e: Exception) -> None:
        log.warning("KV disk cache: skipped %s: %s", path.name, e)
        with self._lock:
            self.skipped_files += 1
            self._drop(path)
        path.unlink(missing_ok=True)

    # -- the folder ------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index every block file under the root, oldest first; temporary files of writers
        that died go."""
        now, found = time.time(), []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                st = entry.stat(follow_symlinks=False)
                if entry.name.endswith(kv_files.TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    found.append((st.st_mtime, Path(entry.path), st.st_size))
        with self._lock:
            for _, path, size in sorted(found):
                self._add(path, size)
        self._evict()
        log.info(
            "KV disk cache %s: %d files, %.2f GiB of %.2f GiB",
            self.root,
            len(self._lru),
            self.bytes / 2**30,
            self.capacity / 2**30,
        )

    def _add(self, path: Path, size: int) -> None:
        self._drop(path)
        self._lru[path] = size
        self.bytes += size
        snap = _snapshot_name(path)
        if snap is not None:
            anchor, entry = snap
            self._snaps.setdefault(anchor, set()).add(entry)

    def _drop(self, path: Path) -> None:
        if path not in self._lru:
            return
        self.bytes -= self._lru.pop(path)
        snap = _snapshot_name(path)
        if snap is not None:
            anchor, entry = snap
            held = self._snaps.get(anchor, set())
            held.discard(entry)
            if not held:
                self._snaps.pop(anchor, None)

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self.bytes <= self.capacity or not self._lru:
                    return
                path = next(iter(self._lru))
                self._drop(path)
                self.evicted_files += 1
            path.unlink(missing_ok=True)

    def clear(self) -> int:
        """Every block file of this model and format gone (flush_cache); returns how many."""
        with self._lock:
            mine = [p for p in self._lru if p.parent == self.folder]
            for p in mine:
                self._drop(p)
        for p in mine:
            p.unlink(missing_ok=True)
        return len(mine)

    def close(self) -> None:
        """Writes queued so far finish (a clean shutdown keeps them); loads are not waited for."""
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            files = len(self._lru)
        return {
            "kv_disk_files": files,
            "kv_disk_bytes": self.bytes,
            "kv_disk_hit_tokens": self.hit_tokens,
            "kv_disk_read_bytes": self.read_bytes,
            "kv_disk_written_bytes": self.written_bytes,
            "kv_disk_evicted_files": self.evicted_files,
            "kv_disk_skipped_files": self.skipped_files,
            "kv_disk_dropped_blocks": self.dropped_blocks,
        }


def _snapshot_name(path: Path) -> tuple[bytes, tuple[int, bytes]] | None:
    """A snapshot file's anchor, length and key, from its name (None: a block's, or not ours)."""
    parts = path.name.removesuffix(SUFFIX).split(SNAP)
    if len(parts) != 3:
        return None
    try:
        return bytes.fromhex(parts[0]), (int(parts[1]), bytes.fromhex(parts[2]))
    except ValueError:
        return None


def _nbytes(arrays: Arrays) -> int:
    return sum(int(np.prod(s)) * _itemsize(d) for d, s in arrays)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # NOTE: evicted meanwhile: its arrays were read whole


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
