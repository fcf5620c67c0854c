"""What a speculating step costs against a plain one, measured as the engine runs.

A speculating step breaks the overlap loop's chain (its next input is known only once its
proposal is verified) and runs every proposal position through the prompt path, so it costs more
wall time than a chained decode step: on a CPU, where the device sets the pace, 1.75x (the
default model, 153 against 87 ms); on a GPU, where the chain hides the host's work, ~8x (a 1B
model, one row: 19.3 against 2.5 ms; docs/benchmarks.md, session 47). A row
gains only where a step emits more tokens than that ratio (`break_even`), so the ratio is
measured, not assumed: the wall time between consecutive decode steps' tokens, with and without
speculation, each a moving average.

A plain pace needs plain steps: while every step speculates, every `PROBE_EVERY` speculating steps
without a plain one take `PROBE_STEPS` plain steps (chained after the first), a few tokens' cost.
"""

from __future__ import annotations

# NOTE: weight of a new sample in each moving average (the last ~20 steps count)
ALPHA = 0.1
# NOTE: speculating steps in a row after which plain steps are taken to measure their pace (the
# first time sooner: until then any accepted token counts as a gain)
PROBE_FIRST = 32
PROBE_EVERY = 256
# NOTE: plain steps of a probe: the first after a speculating step is fresh (not chained), so a
# probe has a few chained ones after it to measure
PROBE_STEPS = 6


class Pace:
    def __init__(self) -> None:
        self.spec_s: float | None = None  # wall seconds a speculating step
        self.plain_s: float | None = None  # wall seconds a chained plain step
        self._since_plain = 0  # speculating steps since the last plain sample
        self._probe = 0  # plain steps left to take

    def stepped(self, interval: float | None, speculated: bool, chained: bool) -> None:
        """A decode step's tokens came `interval` seconds after the previous decode step's
        (None: other work ran between them, or the step carried more than decoding);
        `speculated`: the step was planned to speculate."""
        if not speculated:
            self._probe = max(self._probe - 1, 0)
            if chained and interval is not None:
                self.plain_s = _average(self.plain_s, interval)
                self._since_plain = 0
            return
        if interval is not None:
            self.spec_s = _average(self.spec_s, interval)
        self._since_plain += 1
        due = PROBE_FIRST if self.plain_s is None else PROBE_EVERY
        if self._since_plain >= due:
            self._probe, self._since_plain = PROBE_STEPS, 0

    @property
    def probing(self) -> bool:
        """Whether the next steps must be plain, to measure their pace."""
        return self._probe > 0

    def break_even(self) -> float:
        """Tokens a speculating row must emit a step to beat decoding plainly: the ratio of the
        paces (1.0 until both are measured: any accepted token then counts as a gain)."""
        if self.spec_s is None or not self.plain_s:
            return 1.0
        return self.spec_s / self.plain_s


def _average(mean: float | None, x: float) -> float:
    return x if mean is None else mean + ALPHA * (x - mean)
