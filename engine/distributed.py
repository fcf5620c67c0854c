"""Tensor parallel over MLX's own distributed layer (docs/distributed.md).

The engine forms the group itself: the launcher decides each rank's place (`Topology`), and a rank
process sets MLX's environment from it (`RankPlan.enter`) and joins with `init(strict=True)` under a
deadline (`join_group`). Ring (TCP) on the CPU and on Macs, NCCL on CUDA GPUs.

NOTE: the launcher imports this module, so nothing here imports MLX at module level.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# NOTE: exit codes of a rank that gave up, so a log reader (and a test) can tell why.
EXIT_STALLED = 3  # the watchdog: no step (or no group) within its deadline (1: its backstop)
EXIT_FATAL = 4  # a collective failed or the ranks diverged

WATCH_POLL_S = 0.2
BACKSTOP_S = 2.0
REARM_S = 1.0
JOIN_RETRY_S = 1.0


@dataclass(frozen=True)
class RankPlan:
    """Where one rank sits in the group: everything a rank process needs before importing MLX."""

    rank: int
    hosts: tuple[tuple[str, ...], ...]  # each rank's "ip:port" addresses (MLX's ring hostfile)
    hostfile: str  # a file holding `hosts` as JSON, for MLX_HOSTFILE
    backend: str  # ring, nccl or auto
    local_ranks: int  # ranks on this host (they share its CPU and memory)
    gpu: int | None  # the one GPU this rank sees (CUDA_VISIBLE_DEVICES); None: leave it alone

    @property
    def size(self) -> int:
        return len(self.hosts)

    def env(self) -> dict[str, str]:
        """MLX's variables for this rank: ring reads the hostfile, NCCL rank 0's address."""
        ip, port = self.hosts[0][0].rsplit(":", 1)
        env = {
            "MLX_RANK": str(self.rank),
            "MLX_WORLD_SIZE": str(self.size),
            "MLX_HOSTFILE": self.hostfile,
            "NCCL_HOST_IP": ip,
            "NCCL_PORT": port,
        }
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu)
        return env

    def enter(self) -> None:
        """Set this rank's environment; call before MLX is imported."""
        os.environ.update(self.env())


@dataclass(frozen=True)
class Topology:
    """The ranks of one engine and which of them this launcher runs."""

    hosts: tuple[tuple[str, ...], ...]
    hostfile: str
    local: tuple[int, ...]
    backend: str

    @property
    def size(self) -> int:
        return len(self.hosts)

    def plan(self, rank: int) -> RankPlan:
        # NOTE: one GPU visible per rank: MLX's NCCL group picks device `rank % visible`, which
        # must be the device MLX itself uses (the first visible one). A host of several ranks
        # gives each its own; a worker host (one rank) its first GPU.
        one_host = len(self.local) == self.size
        gpu = _local_gpu(rank if one_host else 0)
        return RankPlan(rank, self.hosts, self.hostfile, self.backend, len(self.local), gpu)


def topology(config: Any, run_dir: Path) -> Topology | None:
    """None for a single process; else the group from --tp (one host) or --tp-hostfile."""
    if config.tp_hostfile:
        hosts = read_hostfile(config.tp_hostfile)
        if config.tp not in (1, len(hosts)):
            raise ValueError(f"--tp {config.tp} but {config.tp_hostfile} lists {len(hosts)} ranks")
        if not 0 <= config.tp_rank < len(hosts):
            raise ValueError(f"--tp-rank {config.tp_rank} is not a rank of {config.tp_hostfile}")
        return Topology(
            hosts, str(Path(config.tp_hostfile).resolve()), (config.tp_rank,), config.tp_backend
        )
    if config.tp <= 1:
        return None
    # NOTE: one host: every rank on the loopback, a free port each (the ring binds them all),
    # and the frame channel's port after them free too.
    hosts = tuple((f"127.0.0.1:{_free_port()}",) for _ in range(config.tp))
    while not _port_free(frame_address(hosts)[1]):
        hosts = tuple((f"127.0.0.1:{_free_port()}",) for _ in range(config.tp))
    path = run_dir / "hostfile.json"
    path.write_text(json.dumps([list(h) for h in hosts]))
    return Topology(hosts, str(path), tuple(range(config.tp)), config.tp_backend)


def read_hostfile(path: str) -> tuple[tuple[str, ...], ...]:
    """MLX's ring hostfile: a JSON list, per rank, of its "ip:port" addresses."""
    want = '(want a JSON list of each rank\'s ["ip:port"], e.g. [["10.0.0.1:5000"], ...])'
    try:
        data = json.loads(Path(path).read_text())
        hosts = tuple(tuple(str(a) for a in (h if isinstance(h, list) else [h])) for h in data)
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--tp-hostfile {path}: {e} {want}") from e
    bad = [a for h in hosts for a in h if not re.fullmatch(r"[^\s:]+:\d+", a)]
    if bad or len(hosts) < 2 or not all(hosts):
        raise ValueError(f"--tp-hostfile {path}: two or more ranks, each with an ip:port {want}")
    return hosts


def frame_address(hosts: tuple[tuple[str, ...], ...]) -> tuple[str, int]:
    """Where rank 0 listens for the other ranks' frame channels (scheduler_proc/host_channel.py):
    rank 0's first IP in the hostfile, one port above the hostfile's highest.

    NOTE: derived, so every rank computes it from the same hostfile with no option to agree on;
    above every port the hostfile names, so it never takes a ring port (two ranks of one host
    are often given consecutive ports).
    """
    ip = hosts[0][0].rsplit(":", 1)[0]
    return ip, 1 + max(int(a.rsplit(":", 1)[1]) for h in hosts for a in h)


def _port_free(port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_gpu(rank: int) -> int | None:
    """The GPU of a rank on one host: the rank-th visible one (harmless where there is none)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return rank
    ids = [v for v in visible.split(",") if v.strip()]
    return int(ids[rank]) if rank < len(ids) and ids[rank].isdigit() else None


# --- inside a rank process (MLX imported) ---------------------------------------------------------


def resolve_backend(backend: str) -> str:
    import mlx.core as mx

    if backend != "auto":
        return backend
    return "nccl" if mx.cuda.is_available() else "ring"


def join_group(plan: RankPlan) -> Any:
    """`mx.distributed.init(strict=True)`; call it under a `Watchdog` phase.

    NOTE: strict, because without it a missing environment silently gives a group of one; a
    deadline (the caller's watchdog), because init blocks while a peer is missing and cannot be
    interrupted.
    """
    import mlx.core as mx

    backend = resolve_backend(plan.backend)
    while True:
        try:
            group = mx.distributed.init(strict=True, backend=backend)
            break
        except RuntimeError as e:
            # NOTE: a peer not listening yet or a port still held from a previous run; the
            # caller's watchdog bounds the retries.
            log.warning("rank %d: joining the group failed (%s); retrying", plan.rank, e)
            time.sleep(JOIN_RETRY_S)
    if group.size() != plan.size or group.rank() != plan.rank:
        raise RuntimeError(f"group is rank {group.rank()} of {group.size()}, want {plan.rank}")
    log.info("rank %d of %d joined (%s)", plan.rank, plan.size, backend)
    return group


def pin_share(plan: RankPlan) -> None:
    """Ranks sharing a host: pin each one's threads to its own even share of the cores (Linux).

    NOTE: the ring's socket threads busy-poll; a small all_sum took 65-115 us with each rank on
    its own core and 7-16 ms unpinned on two cores. Call before the BLAS is set up (it sizes its
    threads to the cores this process may use); threads started later inherit the pin.
    """
    if plan.local_ranks < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    i, share = plan.rank % plan.local_ranks, max(1, len(cores) // plan.local_ranks)
    mine = set(cores[i * share : (i + 1) * share]) or {cores[i % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:
            pass  # NOTE: a thread that ended meanwhile
    log.info("rank %d pinned to cores %s", plan.rank, sorted(mine))


def check_shardable(model: Any, size: int) -> None:
    """Refuse a model mlx-lm cannot shard over `size` ranks, with the reason."""
    if not hasattr(model, "shard"):
        kind = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
        raise ValueError(f"--tp {size}: mlx-lm cannot shard model type {kind!r} (no shard())")
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    for name, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if n is not None and n % size:
            raise ValueError(
                f"--tp {size}: the model has {heads} attention heads and {kv_heads} KV heads; "
                f"its {name} ({n}) do not divide by {size}"
            )


def shard(model: Any, group: Any) -> None:
    """mlx-lm's `shard()`, evaluated at once: the shards are copies, so the full weights are
    freed here, before the KV budget reads the device's free memory."""
    import mlx.core as mx

    check_shardable(model, group.size())
    model.shard(group)
    mx.eval(model.parameters())


def agree_min(group: Any, values: Sequence[int]) -> list[int]:
    """Each value's minimum over every rank (one all_gather)."""
    import mlx.core as mx
    import numpy as np

    words = np.asarray(values, dtype=np.int64).view(np.int32)
    # NOTE: int64 travels as int32 words: all_gather only copies, and every backend has int32.
    got = np.array(mx.distributed.all_gather(mx.array(words), group=group))
    return [int(v) for v in got.view(np.int64).reshape(group.size(), -1).min(axis=0)]


class Watchdog:
    """Ends this process when a phase outlives its deadline without a beat.

    NOTE: the only way out of a collective that never completes (a peer alive but stalled):
    MLX cannot cancel it, and the launcher then sees the rank die and stops the engine. A Python
    thread says what timed out and exits EXIT_STALLED; a call that holds the GIL while it blocks
    (`mx.distributed.init` does) starves that thread, so faulthandler's C timer backs it up
    BACKSTOP_S later (it dumps every thread's stack and exits 1). Re-arming that timer costs
    ~90 us, so beats re-arm it at most every REARM_S.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._what = ""
        self._timeout = 0.0
        self._last = self._armed_at = time.monotonic()
        self._armed = False
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def arm(self, what: str, timeout: float) -> None:
        self._what, self._timeout = what, timeout
        log.info("%s: %s, deadline %.1fs", self.name, what, timeout)
        self._armed = True
        self._backstop()
        self.beat()

    def disarm(self) -> None:
        self._armed = False
        faulthandler.cancel_dump_traceback_later()

    def beat(self) -> None:
        self._last = now = time.monotonic()
        if self._armed and now - self._armed_at > REARM_S:
            self._backstop()

    def phase(self, what: str, timeout: float) -> _Phase:
        return _Phase(self, what, timeout)

    def _backstop(self) -> None:
        faulthandler.dump_traceback_later(self._timeout + BACKSTOP_S, exit=True)
        self._armed_at = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_POLL_S)
            if self._armed and time.monotonic() - self._last > self._timeout:
                log.error(
                    "%s: %s took over %.1fs (a rank stalled or a collective hangs); exiting",
                    self.name,
                    self._what,
                    self._timeout,
                )
                for h in logging.getLogger().handlers:
                    h.flush()
                sys.stderr.flush()
                os._exit(EXIT_STALLED)


class _Phase:
    def __init__(self, dog: Watchdog, what: str, timeout: float) -> None:
        self.dog, self.what, self.timeout = dog, what, timeout

    def __enter__(self) -> Watchdog:
        self.dog.arm(self.what, self.timeout)
        return self.dog

    def __exit__(self, *exc: object) -> None:
        self.dog.disarm()
