"""One request's text: a streaming detokenizer plus stop strings with hold-back.

The streaming detokenizers of mlx-lm only extend `.text` with whole characters, so slicing it never
splits a UTF-8 character. Stop strings may span tokens: the last `longest stop - 1` characters stay
held back until the next token shows whether they start a stop string.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, detokenizer: Any, stop: list[str], skip_ids: frozenset[int]) -> None:
        self._detok = detokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._skip = skip_ids
        self._sent = 0
        self._searched = 0

    def add(self, token_ids: list[int]) -> None:
        for t in token_ids:
            # NOTE: special tokens (EOS, chat markers) count as tokens but are not text.
            if t not in self._skip:
                self._detok.add_token(t)

    def take(self, final: bool) -> tuple[str, str | None]:
        """The next text delta, and the stop string that ended the text (None: none did)."""
        if final:
            self._detok.finalize()
        text = self._detok.text
        hit = self._find_stop(text)
        if hit is not None:
            return self._emit(text, hit[0]), hit[1]
        end = len(text) if final else len(text) - self._hold
        return self._emit(text, max(end, self._sent)), None

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string in the text starts, and which it is."""
        hits = [(i, s) for s in self._stop if (i := text.find(s, self._searched)) >= 0]
        # NOTE: a stop string that starts before the searched mark was already excluded, so the
        # next search may start `hold` characters back from the end.
        self._searched = max(0, len(text) - self._hold)
        return min(hits) if hits else None

    def _emit(self, text: str, end: int) -> str:
        delta = text[self._sent : end]
        self._sent = end
        return delta
