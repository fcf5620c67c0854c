"""Long work that says how far it got: a live bar on a terminal, a line every few seconds in a log.

Start-up spends most of its time in few places (a download, a GGUF conversion, the model load, the
warm-up's hundreds of step shapes on a GPU); a silent minute reads as a hang. Where the process's
stderr is a terminal (a person ran `./scripts/launch`; the children inherit the launcher's
stderr), `Progress` redraws one line in place, `convert x.gguf [#####.......] 41% 1.7 of 4.1 GB,
6 s`, at most `REDRAW_S` apart. Anywhere else (a file, a pipe, supervisord's log) it never writes
a control character: it logs `what: n of total unit, s` at most every `every_s` seconds.
`finish()` logs what was done and how long it took, in both cases.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

REDRAW_S = 0.2  # NOTE: 5 redraws a second reads as live; more would only cost the work's time
BAR_CELLS = 24
CLEAR_LINE = "\r\x1b[K"  # NOTE: back to column 0 and erase it (a shorter line leaves no tail)


class Progress:
    def __init__(
        self,
        log: logging.Logger,
        what: str,
        total: int,
        unit: str,
        every_s: float = 5.0,
        stream: TextIO | None = None,
    ) -> None:
        """`unit` "B" counts bytes (shown as kB, MB, GB); any other is a count's name."""
        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.every_s = every_s
        self.stream = sys.stderr if stream is None else stream
        self.bar = _is_terminal(self.stream)
        self.n = 0
        self.started = time.monotonic()
        self._next_log = self.started + every_s
        self._next_draw = self.started
        self._drawn = False
        self._closed = False
        # NOTE: hub downloads update from several threads
        self._lock = threading.RLock()
        self._guard = _ClearBeforeLog(self) if self.bar else None

    def step(self, n: int = 1) -> None:
        self.update(self.n + n)

    def update(self, n: int, total: int | None = None) -> None:
        """`n` done so far (of `total`, where the total grows as work is found)."""
        with self._lock:
            self.n = n
            if total is not None:
                self.total = total
            if self._closed:
                return
            now = time.monotonic()
            if self.bar and (self.n or self.total) and now >= self._next_draw:
                self._next_draw = now + REDRAW_S
                self._draw(now)
            elif not self.bar and now >= self._next_log and self.n < self.total:
                self._next_log = now + self.every_s
                self.log.info("%s: %s, %.0f s", self.what, self.amount(), now - self.started)

    def amount(self) -> str:
        """`12 of 40 step shapes`, `1.7 of 4.1 GB` (both in the total's scale)."""
        scale, name = _scale(self.unit, max(self.total, self.n))
        return f"{_number(self.n, scale)} of {_number(self.total, scale)} {name}"

    def close(self) -> float:
        """Take the bar off the terminal (idempotent); the seconds since the start."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._erase()
                if self._guard is not None:
                    self._guard.remove()
        return self.seconds

    def finish(self) -> float:
        """Close, and log `what: N unit in T s` (the time the work took)."""
        seconds = self.close()
        if self.n >= self.total:
            scale, name = _scale(self.unit, self.n)
            done = f"{_number(self.n, scale)} {name}"
        else:  # NOTE: stopped early (the warm-up's deadline): say how far it got
            done = self.amount()
        self.log.info("%s: %s in %.1f s", self.what, done, seconds)
        return seconds

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the terminal ----------------------------------------------------------------------------
    def _draw(self, now: float) -> None:
        if self.total > 0:
            full = min(BAR_CELLS, BAR_CELLS * self.n // self.total)
            cells = "#" * full + "." * (BAR_CELLS - full)
            share = f"[{cells}] {100 * self.n / self.total:3.0f}% "
        else:
            share = ""
        line = f"{self.what} {share}{self.amount()}, {now - self.started:.0f} s"
        self._write(CLEAR_LINE + line)
        self._drawn = True

    def _erase(self) -> None:
        if self._drawn:
            self._write(CLEAR_LINE)
            self._drawn = False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError) as e:  # NOTE: a closed terminal must not fail the work
            if isinstance(e, OSError) and e.errno is None:
                raise  # NOTE: not the terminal's: raised in a signal handler (a deadline)
            self.bar = False

    def erase_for_log(self) -> None:
        """A log line is about to be written to our stream: take the bar off first, and let the
        next update draw it again under the line."""
        with self._lock:
            self._erase()
            self._next_draw = 0.0


class _ClearBeforeLog(logging.Filter):
    """While a bar is drawn, a log line on the same terminal would be appended to it; this filter,
    on each handler writing to the bar's stream, erases the bar before the line is written."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress
        self.handlers = [
            h for h in logging.getLogger().handlers if getattr(h, "stream", None) is progress.stream
        ]
        for h in self.handlers:
            h.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        # NOTE: a handler asks its filters only for records it is about to write
        self.progress.erase_for_log()
        return True

    def remove(self) -> None:
        for h in self.handlers:
            h.removeFilter(self)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # NOTE: a closed or stand-in stream is no terminal
        return False


def _scale(unit: str, most: int) -> tuple[float, str]:
    """(divisor, unit name) for counts up to `most`: bytes in kB, MB or GB; any other unit as is."""
    if unit == "B":
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if most >= scale:
                return scale, name
    return 1.0, unit


def _number(n: int, scale: float) -> str:
    return f"{n / scale:.1f}" if scale >= 1e9 else f"{n / scale:.0f}"
