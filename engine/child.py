"""What every engine child process shares: logging, signals, the READY handshake, orphan watch."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import zmq

from engine.errors import EngineError
from engine.ipc import PushQueue
from engine.messages.to_launcher import (
    Ready,
    SchedulerFacts,
    ShutdownRequested,
    StartFailed,
    ToLauncher,
)

PARENT_POLL_S = 0.5
ORPHAN_GRACE_S = 3.0


def setup(name: str, log_level: str) -> None:
    """Logging to stderr, and signals left to the launcher."""
    logging.basicConfig(
        stream=sys.stderr,
        level=log_level.upper(),
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s",
    )
    # NOTE: Ctrl-C reaches the whole process group; the launcher alone decides how to shut down
    # and tells each child in order, so children ignore SIGINT and SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Child:
    """A child's link to its launcher: READY / StartFailed reports and the orphan flag."""

    def __init__(self, name: str, launcher_addr: str, parent_pid: int) -> None:
        self.name = name
        self.orphaned = threading.Event()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._launcher: PushQueue[ToLauncher] = PushQueue(self._ctx, launcher_addr, ToLauncher)
        _watch_parent(parent_pid, self.orphaned)

    def ready(self, facts: SchedulerFacts | None = None) -> None:
        freeze_start_up()
        self._launcher.put(Ready(self.name, os.getpid(), facts))

    def send_launcher_shutdown(self, reason: str) -> None:
        self._launcher.put(ShutdownRequested(reason))

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Report an exception while starting to the launcher (with its cause), then exit 1."""
        try:
            yield
        except BaseException as e:
            # NOTE: a typed error (a model not found, a bad file) is the user's to fix: its
            # message says how; a traceback is for the engine's own faults.
            why = str(e) if isinstance(e, EngineError) else traceback.format_exc()
            logging.getLogger(self.name).error("failed to start: %s", why)
            self._launcher.put(StartFailed(self.name, f"{type(e).__name__}: {e}"))
            self._launcher.close()
            sys.exit(1)

    def close(self) -> None:
        self._launcher.close()


def _watch_parent(parent_pid: int, orphaned: threading.Event) -> None:
    """Set `orphaned` when the launcher dies; hard-exit if the process has not ended soon after.

    NOTE: polling the parent pid works on Linux and macOS alike; PR_SET_PDEATHSIG is Linux-only.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        logging.getLogger(__name__).error("launcher %d is gone; exiting", parent_pid)
        orphaned.set()
        time.sleep(ORPHAN_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# NOTE: counted once at the freeze; `gc.get_freeze_count()` walks them all (1.6 ms a call measured
# in a scheduler, paid by every stats query and tensor-parallel fingerprint)
frozen_objects = 0


def freeze_start_up() -> None:
    """What start-up built (the model's modules, the tokenizer, MLX's and transformers' objects:
    ~83,000 tracked objects in a scheduler) stays for the process's life; moved out of the
    collector's sight, a full collection no longer walks it. Measured in-process on this CPU, 500
    requests over 700 steps: gen-2 collections of up to 118 ms before, 0.4 ms after; such pauses
    were the flood's slow steps on the H200."""
    global frozen_objects
    gc.collect()
    gc.freeze()
    frozen_objects = gc.get_freeze_count()


def without_torch() -> None:
    """No engine process uses PyTorch, but where it is installed transformers imports it: the
    tokenizer and detokenizer became ready 11-13 s after the scheduler. Hidden here, `import
    torch` fails and transformers finds none; its advice that PyTorch is missing (a line each
    process printed at every start, which users read as an error) is silenced too."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def entry(target: str, *args: object) -> None:
    """A child's first frame: import `module:function` only here, so the launcher never imports
    MLX or a process's heavy dependencies."""
    import importlib

    without_torch()

    module, func = target.split(":")
    getattr(importlib.import_module(module), func)(*args)
