"""The launcher behind `mlx-engine launch`: spawns the three processes, handshakes, watches, and
owns shutdown (docs/processes.md, docs/operations.md). Runs in the foreground; the exit code tells a supervisor what
happened: 0 after a graceful shutdown, 1 when a child failed or had to be killed."""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import zmq

from engine import control_token, open_files
from engine.config import EngineConfig
from engine.ipc import Endpoints, PullQueue, PushQueue
from engine.messages.to_launcher import (
    Ready,
    SchedulerFacts,
    ShutdownRequested,
    StartFailed,
    ToLauncher,
)
from engine.messages.to_scheduler import Drain, ToScheduler
from engine.messages.to_tokenizer import Control, FromEngine

log = logging.getLogger("launcher")

POLL_S = 0.1
EXIT_SLACK_S = 10.0  # beyond --shutdown-grace, for the drained pipeline to flush and exit
TEARDOWN_S = 5.0  # how long the launcher waits for killed children before it gives up
FAIL_NOTICE_S = 2.0  # how long the tokenizer may take to tell clients the engine died
CONNECT_PROBE_S = 0.5  # how long the busy-port check waits for a listener to answer
TARGETS = {
    "scheduler": "scheduler_proc.main:run",
    "tokenizer": "tokenizer_proc.main:run",
    "detokenizer": "detokenizer_proc.main:run",
}


def run_engine(config: EngineConfig) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=config.log_level.upper(),
        format="%(asctime)s launcher[%(process)d] %(levelname)s %(message)s",
    )
    soft, hard = open_files.raise_limit()  # NOTE: children inherit it
    log.info("open files: at most %d (hard limit %s)", soft, open_files.describe(hard))
    busy = None if config.tp_rank > 0 else _busy_endpoint(config)
    if busy:
        # NOTE: before anything starts: a busy port must not cost a model load (minutes for a
        # large model) to be found out.
        log.error("cannot serve on %s", busy)
        return 1
    with _private_dir() as run_dir, _control_token(config):
        return Launcher(config, run_dir).run()


@contextmanager
def _control_token(config: EngineConfig) -> Iterator[None]:
    """Without --api-key, control messages need the owner's token (engine/control_token.py):
    written for the SDK on this machine and user, handed to the front door in the environment
    (children copy it when they start)."""
    if config.api_key or config.tp_rank > 0:
        # NOTE: a token left by an engine that died on this port would be sent instead of the key
        control_token.path_for(config.zmq_port).unlink(missing_ok=True)
        yield
        return
    token = control_token.create(config.zmq_port)
    os.environ[control_token.ENV] = token
    try:
        yield
    finally:
        control_token.remove(config.zmq_port, token)


def _busy_endpoint(config: EngineConfig) -> str | None:
    """The first client endpoint (SDK, then HTTP) that cannot be bound, and why; else None."""
    for scheme, port in (("tcp", config.zmq_port), ("http", config.port)):
        busy = _port_in_use(config.host, port)
        if busy:
            return f"{scheme}://{config.host}:{port}: {busy}"
    return None


def _port_in_use(host: str, port: int) -> str | None:
    """Why the client endpoint cannot be bound (address in use, unknown host), else None.

    NOTE: a probe with SO_REUSEADDR, as libzmq binds: a port held only by TIME_WAIT connections
    is free for it. On BSD sockets (macOS) that bind also succeeds beside another socket listening
    on the wildcard address with the same port, so a connect finds that listener. The tokenizer
    still reports a port taken between this probe and its bind.
    """
    try:
        infos = socket.getaddrinfo(
            None if host in ("*", "") else host,
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )
        family, kind, proto, _, addr = infos[0]
        _bind_probe(family, kind, proto, addr)
    except OSError as e:
        reason = "address already in use" if e.errno == errno.EADDRINUSE else str(e)
        return f"{reason} ({type(e).__name__})"
    if _answers(family, addr):
        return f"address already in use (a listener answers on port {port})"
    return None


def _bind_probe(
    family: socket.AddressFamily, kind: socket.SocketKind, proto: int, addr: Any
) -> None:
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        probe.listen(1)


def _connect_target(family: socket.AddressFamily, addr: Any) -> Any:
    """`addr`, the wildcard address as the loopback one (where not every system connects to it)."""
    wildcard = {socket.AF_INET: "0.0.0.0", socket.AF_INET6: "::"}.get(family)
    loopback = {socket.AF_INET: "127.0.0.1", socket.AF_INET6: "::1"}.get(family)
    return (loopback, *addr[1:]) if addr[0] == wildcard else addr


def _answers(family: socket.AddressFamily, addr: Any) -> bool:
    """Does something listen at `addr`?"""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_PROBE_S)
        try:
            probe.connect(_connect_target(family, addr))
        except OSError:
            return False  # NOTE: refused: nothing listens; no answer in time: taken as free
        # NOTE: a connect to a free port of this host can meet itself (TCP simultaneous open
        # when the kernel picks that port as the source): nothing else listens there.
        return probe.getsockname()[:2] != probe.getpeername()[:2]


def _stop_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, started by the first spawn, and reap it.

    NOTE: it exits by itself only once every holder of its pipe has, which is after the
    launcher: a supervisor would see the launcher gone while a process it started still runs.
    Called only when every child has exited (the tracker waits for them to let go of its pipe).
    """
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    stop = getattr(tracker, "_stop", None)  # NOTE: private, present since Python 3.8
    if stop is not None and getattr(tracker, "_pid", None) is not None:
        stop()


@contextmanager
def _private_dir() -> Iterator[Path]:
    # NOTE: mkdtemp makes the directory 0700, so only this user can reach the ipc:// sockets.
    path = Path(tempfile.mkdtemp(prefix="mlx-engine-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def spawn(name: str, *args: Any, label: str | None = None) -> BaseProcess:
    """The one place a child starts (spawn context: portable, and nothing of MLX is inherited).

    NOTE: a child that needs its own environment (LD_PRELOAD of a faster BLAS for the scheduler)
    gets it here: `os.environ` is copied into the child when it starts. `label` names one of
    several children of a kind (tensor-parallel ranks).
    """
    process = mp.get_context("spawn").Process(
        target=_entry, args=(TARGETS[name], *args), name=f"mlx-engine-{label or name}"
    )
    process.start()
    return process


def _entry(target: str, *args: Any) -> None:
    from engine.child import entry

    entry(target, *args)


class Launcher:
    def __init__(self, config: EngineConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.endpoints = Endpoints.create(config, run_dir)
        self.ctx = zmq.Context()
        self.inbox: PullQueue[ToLauncher] = PullQueue(self.ctx, self.endpoints.launcher, ToLauncher)
        self.procs: dict[str, BaseProcess] = {}
        self.signals = 0
        self.shutdown_reason: str | None = None
        self.started_at = time.monotonic()
        self.ready_at: dict[str, float] = {}  # child -> when its READY came
        self.sched_facts: SchedulerFacts | None = None

    def run(self) -> int:
        self._install_signals()
        try:
            if not self._start():
                return 1
            if "tokenizer" not in self.procs:
                log.info(
                    "rank %d ready: a worker of the engine served by rank 0", self.config.tp_rank
                )
                return self._watch()
            http = f"http://{self.config.host}:{self.config.port}"
            log.info(
                "engine ready in %s: SDK endpoint %s, HTTP API %s",
                self._took(),
                self.endpoints.client,
                http,
            )
            return self._watch()
        finally:
            self._teardown()

    # --- signals --------------------------------------------------------------------------------

    def _install_signals(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        if self.shutdown_reason is None:
            self.shutdown_reason = signal.Signals(signum).name

    # --- start ----------------------------------------------------------------------------------

    def _start(self) -> bool:
        """Scheduler first (its READY carries the model dir and limits), then the other two.

        Tensor parallel: every local rank of the scheduler; a launcher without rank 0 (a worker
        host) starts nothing else.
        """
        pid = os.getpid()
        ranks = self._spawn_schedulers(pid)
        if ranks is None:
            return False
        facts = self._await_ready(ranks)
        if facts is None:
            return False
        if "scheduler" not in facts:
            return True
        sched = self.sched_facts = facts["scheduler"]
        self.procs["detokenizer"] = spawn("detokenizer", self.config, self.endpoints, pid, sched)
        self.procs["tokenizer"] = spawn("tokenizer", self.config, self.endpoints, pid, sched)
        return self._await_ready({"detokenizer", "tokenizer"}) is not None

    def _spawn_schedulers(self, pid: int) -> set[str] | None:
        from engine.distributed import topology

        try:
            topo = topology(self.config, self.run_dir)
        except ValueError as e:
            log.error("%s", e)
            return None
        if topo is None:
            self.procs["scheduler"] = spawn("scheduler", self.config, self.endpoints, pid)
            return {"scheduler"}
        log.info(
            "tensor parallel: %d ranks (%s), this host runs %s",
            topo.size,
            topo.backend,
            list(topo.local),
        )
        for rank in topo.local:
            name = "scheduler" if rank == 0 else f"scheduler-{rank}"
            plan = topo.plan(rank)
            self.procs[name] = spawn(
                "scheduler", self.config, self.endpoints, pid, plan, label=name
            )
        return set(self.procs)

    def _took(self) -> str:
        """How long start-up took and where it went, from the children's READY."""
        at = self.ready_at
        total = max(at.values()) - self.started_at
        sched = self.sched_facts
        parts = []
        if sched is not None:
            model = f"model {sched.model_s:.1f} s, " if sched.model_s >= 0.1 else ""
            parts.append(
                f"scheduler {at['scheduler'] - self.started_at:.1f} s ({model}load "
                f"{sched.load_s:.1f} s, warm-up {sched.warm_up_s:.1f} s)"
            )
        for name in ("detokenizer", "tokenizer"):
            if name in at and "scheduler" in at:
                parts.append(f"{name} +{at[name] - at['scheduler']:.1f} s")
        return f"{total:.1f} s ({', '.join(parts)})"

    def _await_ready(self, names: set[str]) -> dict[str, SchedulerFacts | None] | None:
        deadline = time.monotonic() + self.config.startup_timeout
        facts: dict[str, SchedulerFacts | None] = {}
        while len(facts) < len(names):
            msg = self.inbox.get(POLL_S)
            if isinstance(msg, Ready):
                log.info("%s ready (pid %d)", msg.process, msg.pid)
                facts[msg.process] = msg.facts
                self.ready_at[msg.process] = time.monotonic()
            elif isinstance(msg, StartFailed):
                log.error("%s failed to start: %s", msg.process, msg.error)
                return None
            if not self._starting_ok(names - set(facts), deadline):
                return None
        return facts

    def _starting_ok(self, pending: set[str], deadline: float) -> bool:
        if self.signals:
            log.warning("interrupted while starting")
            return False
        for name in pending:
            if not self.procs[name].is_alive():
                code = self.procs[name].exitcode
                log.error("%s exited with code %s before it was ready", name, code)
                return False
        if time.monotonic() > deadline:
            log.error("%s not ready within %.0fs", sorted(pending), self.config.startup_timeout)
            return False
        return True

    # --- watch ----------------------------------------------------------------------------------

    def _watch(self) -> int:
        while True:
            msg = self.inbox.get(POLL_S)
            if isinstance(msg, ShutdownRequested) and self.shutdown_reason is None:
                self.shutdown_reason = msg.reason
            if self.shutdown_reason is not None:
                return self._graceful()
            dead = self._dead()
            if dead and self._worker_done(dead):
                log.info("rank %d: the engine stopped at rank 0", self.config.tp_rank)
                return 0
            if dead:
                return self._fail(dead)

    def _worker_done(self, dead: list[str]) -> bool:
        """A worker host whose rank exited 0: rank 0 sent Exit (its engine shut down)."""
        return "tokenizer" not in self.procs and all(self.procs[n].exitcode == 0 for n in dead)

    def _dead(self) -> list[str]:
        return [name for name, p in self.procs.items() if not p.is_alive()]

    def _fail(self, dead: list[str]) -> int:
        codes = {name: self.procs[name].exitcode for name in dead}
        log.error("engine process died: %s; stopping the engine", codes)
        if "tokenizer" in self.procs and "tokenizer" not in dead:
            self._to_tokenizer(Control("fail", f"{', '.join(dead)} died"))
            self.procs["tokenizer"].join(FAIL_NOTICE_S)
        return 1

    # --- graceful shutdown ----------------------------------------------------------------------

    def _graceful(self) -> int:
        if "tokenizer" not in self.procs:
            # NOTE: a worker host cannot leave alone (rank 0 would block in its next collective):
            # its rank is killed, and rank 0 stops the engine with an error. Stop rank 0 instead.
            log.warning(
                "rank %d stopped (%s): the engine fails", self.config.tp_rank, self.shutdown_reason
            )
            return 1
        grace = self.config.shutdown_grace
        log.info("shutting down (%s): running requests get %.1fs", self.shutdown_reason, grace)
        self._to_tokenizer(Control("drain", self.shutdown_reason or ""))
        self._to_scheduler(Drain(grace))
        deadline = time.monotonic() + grace + EXIT_SLACK_S
        while any(p.is_alive() for p in self.procs.values()):
            if self.signals >= 2:
                log.warning("second signal: forcing exit")
                return 1
            if time.monotonic() > deadline:
                log.error("processes still running after %.1fs: forcing exit", grace + EXIT_SLACK_S)
                return 1
            time.sleep(POLL_S)
        return self._exit_code()

    def _exit_code(self) -> int:
        codes = {name: p.exitcode for name, p in self.procs.items()}
        if any(codes.values()):
            log.error("engine processes exited with %s", codes)
            return 1
        log.info("engine stopped")
        return 0

    def _to_tokenizer(self, msg: FromEngine) -> None:
        self._tell(self.endpoints.tokenizer, FromEngine, msg)

    def _to_scheduler(self, msg: ToScheduler) -> None:
        self._tell(self.endpoints.scheduler, ToScheduler, msg)

    def _tell(self, addr: str, union: Any, msg: Any) -> None:
        q: PushQueue[Any] = PushQueue(self.ctx, addr, union)
        q.put(msg)
        q.close(linger_ms=500)  # NOTE: a dead receiver must not hold the launcher's exit

    # --- teardown -------------------------------------------------------------------------------

    def _teardown(self) -> None:
        """Leave no child behind: children ignore SIGTERM (the launcher coordinates), so kill."""
        for name, p in self.procs.items():
            if p.is_alive():
                log.warning("killing %s (pid %s)", name, p.pid)
                p.kill()
        for p in self.procs.values():
            p.join(TEARDOWN_S)
        self.inbox.close()
        self.ctx.term()
        if not any(p.is_alive() for p in self.procs.values()):
            _stop_resource_tracker()
