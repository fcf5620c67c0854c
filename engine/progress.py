"""Long work that says how far it got: a line every few seconds, never one per item.

Start-up spends most of its time in few places (a download, a GGUF conversion, the model load, the
warm-up's hundreds of step shapes on a GPU); a silent minute reads as a hang. `Progress` logs
`what: n of total unit, s` at most every `every_s` seconds, so a terminal and a log file read
the same.
"""

from __future__ import annotations

import logging
import time


class Progress:
    def __init__(
        self, log: logging.Logger, what: str, total: int, unit: str, every_s: float = 5.0
    ) -> None:
        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.every_s = every_s
        self.done = 0
        self.started = time.monotonic()
        self._next = self.started + every_s

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self._next and self.done < self.total:
            self._next = now + self.every_s
            self.log.info(
                "%s: %d of %d %s, %.0f s",
                self.what,
                self.done,
                self.total,
                self.unit,
                now - self.started,
            )

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started
