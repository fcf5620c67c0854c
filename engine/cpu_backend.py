"""An optimized BLAS for MLX's CPU backend, set up once per process before MLX does any work.

The `mlx-cpu` wheel links a bundled reference BLAS (`mlx_cpu.libs/libblas-*.so`, ~3 GFLOP/s for a
float32 GEMM). `libmlx.so` imports only `cblas_sgemm` / `cblas_dgemm` / `cblas_cgemm` from it, so a
library exporting the standard `cblas_*` symbols that sits in the process's global symbol scope
before `mlx.core` is imported wins the symbol lookup (ELF interposition). Two routes put it there:
`ctypes.CDLL(path, RTLD_GLOBAL)` before the import (what `setup_cpu_backend` does), or `LD_PRELOAD`
in a child's environment (`child_env`). A late load does not work: Python imports extensions with
RTLD_NOW, so libmlx's symbols are bound at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("engine.cpu_backend")

# NOTE: Debian's libopenblas0-pthread (installed by scripts/_env.sh) lands here via alternatives.
_KNOWN_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)
REFERENCE = "reference"
_OFF_VALUES = ("reference", "none", "off")


@dataclass(frozen=True)
class BackendInfo:
    """What `setup_cpu_backend` found: which BLAS MLX's matmuls call, and with how many threads."""

    blas: str
    path: str | None = None
    optimized: bool = False
    threads: int = 0
    env: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        if not self.optimized:
            return f"BLAS: {self.blas} (bundled with mlx-cpu, slow float32 GEMM)"
        if self.path is None:
            return f"BLAS: {self.blas} (linked into mlx)"
        return f"BLAS: {self.blas}, {self.threads} threads, from {self.path}"


_INFO: BackendInfo | None = None
_LOGGED = False


def setup_cpu_backend(config: Any = None, *, log_line: bool = True) -> BackendInfo:
    """Put an optimized BLAS under MLX; call once per process, before `import mlx.core`.

    `config.cpu_blas`: "auto" (find one, else the reference), "reference", or a library path.
    Idempotent: later calls return the first result. The log line is written once, by the first
    call with `log_line=True` (so a quiet call can precede the process's logging setup).
    """
    global _INFO, _LOGGED
    if _INFO is None:
        _INFO = _setup(str(getattr(config, "cpu_blas", "auto") or "auto"))
    if log_line and not _LOGGED:
        _LOGGED = True
        log.info("cpu backend: %s", _INFO.describe())
    return _INFO


def backend_info() -> BackendInfo | None:
    """The result of `setup_cpu_backend` in this process, if it ran."""
    return _INFO


def child_env(info: BackendInfo, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that should run MLX on the same BLAS (via LD_PRELOAD).

    Needed only where the child imports `mlx.core` before it can call `setup_cpu_backend`.
    """
    env = dict(os.environ if base is None else base)
    env.update(dict(info.env))
    if info.optimized and info.path:
        pre = env.get("LD_PRELOAD", "")
        if info.path not in pre.split():
            env["LD_PRELOAD"] = f"{info.path} {pre}".strip()
    return env


def _setup(spec: str) -> BackendInfo:
    if sys.platform == "darwin":
        # NOTE: MLX on macOS links Apple's Accelerate: already the fast BLAS.
        return BackendInfo(blas="Accelerate", optimized=True)
    if sys.platform != "linux":
        return BackendInfo(blas=REFERENCE)
    bound = _bound_cblas_library()
    if bound:
        # NOTE: already in the global scope (LD_PRELOAD from `child_env`): that one is in use,
        # whatever the config asks, and the log line must say so.
        return _info_for(bound)
    if spec.lower() in _OFF_VALUES:
        return BackendInfo(blas=REFERENCE)
    if "mlx.core" in sys.modules:
        # NOTE: too late to interpose: libmlx bound its symbols when it was imported.
        return _too_late()
    for path in _candidates(spec):
        info = _try_load(path)
        if info is not None:
            return info
    if spec != "auto":
        log.warning("cpu backend: could not load BLAS %r; using the reference BLAS", spec)
    return BackendInfo(blas=REFERENCE)


def _too_late() -> BackendInfo:
    log.warning("cpu backend: mlx.core was imported before setup; using the reference BLAS")
    return BackendInfo(blas=REFERENCE)


def _candidates(spec: str) -> list[str]:
    if spec != "auto":
        return [spec]
    found = [p for p in _KNOWN_PATHS if Path(p).exists()]
    name = ctypes.util.find_library("openblas")
    return found + ([name] if name else [])


def _try_load(path: str) -> BackendInfo | None:
    env = _openblas_env()
    os.environ.update(env)  # NOTE: OpenBLAS reads these in its constructor, at dlopen.
    try:
        # NOTE: load locally first and check the kernel before exposing its symbols to libmlx.
        lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        if not hasattr(lib, "cblas_sgemm") or not _sgemm_ok(lib):
            log.warning("cpu backend: %s has no working cblas_sgemm; skipped", path)
            return None
        ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError as exc:
        log.warning("cpu backend: cannot load %s (%s)", path, exc)
        return None
    _set_threads(lib, int(env.get("OPENBLAS_NUM_THREADS", "0") or 0))
    bound = _bound_cblas_library()
    return _info_for(bound, tuple(sorted(env.items()))) if bound else None


def _info_for(path: str, env: tuple[tuple[str, str], ...] = ()) -> BackendInfo:
    lib = ctypes.CDLL(path)
    return BackendInfo(
        blas=_blas_name(lib, path), path=path, optimized=True, threads=_threads(lib), env=env
    )


def _openblas_env() -> dict[str, str]:
    """Thread count and kernel choice, unless the caller's environment already says."""
    env: dict[str, str] = {}
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        # NOTE: MLX runs CPU ops on one stream thread, which becomes OpenBLAS's first thread;
        # one thread per core we may run on, no more, so nothing is oversubscribed.
        env["OPENBLAS_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    core = _coretype_for(_cpu_flags())
    if "OPENBLAS_CORETYPE" not in os.environ and core:
        # NOTE: Debian's OpenBLAS 0.3.21 does not know newer CPUs (Sapphire/Emerald Rapids,
        # Zen 4) and falls back to Prescott kernels, 6x slower; pick from the CPU's flags.
        env["OPENBLAS_CORETYPE"] = core
    return env


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def _coretype_for(flags: set[str]) -> str | None:
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def _sgemm_ok(lib: ctypes.CDLL) -> bool:
    """An odd-sized product of small integers (exact in float32) against numpy's own result.

    NOTE: odd sizes reach the kernels' edge cases, where builds for the wrong CPU go wrong.
    """
    import numpy as np

    m, k, n = 67, 45, 53
    rng = np.random.default_rng(0)
    a = rng.integers(0, 8, (m, k)).astype(np.float32)
    b = rng.integers(0, 8, (k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    ptr = ctypes.POINTER(ctypes.c_float)
    args = [x.ctypes.data_as(ptr) for x in (a, b, c)]
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    # NOTE: CblasRowMajor=101, CblasNoTrans=111.
    lib.cblas_sgemm(101, 111, 111, m, n, k, one, args[0], k, args[1], n, zero, args[2], n)
    return bool(np.array_equal(c, a.astype(np.int64) @ b.astype(np.int64)))


def _bound_cblas_library() -> str | None:
    """The file that defines `cblas_sgemm` in the global scope: what libmlx binds to."""
    try:
        addr = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    except AttributeError:
        return None
    return _dladdr_path(addr)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _dladdr_path(addr: int | None) -> str | None:
    libc = ctypes.CDLL(None)
    info = _DlInfo()
    if not addr or not libc.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
        return None
    return os.fsdecode(info.dli_fname) if info.dli_fname else None


def _blas_name(lib: ctypes.CDLL, path: str) -> str:
    if not hasattr(lib, "openblas_get_config"):
        return Path(path).name
    lib.openblas_get_config.restype = ctypes.c_char_p
    lib.openblas_get_corename.restype = ctypes.c_char_p
    config = lib.openblas_get_config().decode().split()
    version = " ".join(config[:2])
    return f"{version} (core {lib.openblas_get_corename().decode()})"


def _set_threads(lib: ctypes.CDLL, n: int) -> None:
    if n > 0 and hasattr(lib, "openblas_set_num_threads"):
        lib.openblas_set_num_threads(n)


def _threads(lib: ctypes.CDLL) -> int:
    if hasattr(lib, "openblas_get_num_threads"):
        return int(lib.openblas_get_num_threads())
    return 0
