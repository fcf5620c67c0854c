"""Prompt lookup (issue 40): a request's next tokens proposed from its own prompt and output.

The proposal is what followed the latest earlier occurrence of the request's last n tokens,
longest n first. An agent's edit re-emits much of a file that sits in its prompt, so after a few
tokens of a line its continuation is found there. A continuation that runs into the request's end
goes on as the repetition it is (a loop of p tokens proposes k tokens, not the p up to the end).
Pure host code: no MLX, no scheduler state.
"""

from __future__ import annotations

from collections.abc import Sequence

# NOTE: one-token matches (" the", a newline) propose a wrong continuation far more often than
# a right one; a proposal is tried from the longest n down to this.
MIN_NGRAM = 2


class NgramIndex:
    """One request's tokens and, for each n, n-gram -> the position right after its latest
    occurrence, extended as the request's tokens grow (they only ever grow: a preempted request
    recomputes the same prompt + output)."""

    def __init__(self, longest: int) -> None:
        self.sizes = list(range(longest, min(MIN_NGRAM, longest) - 1, -1))
        self.tokens: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # NOTE: continuation positions below this are in `_after`

    def extend(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Take in the tokens of prompt + output not seen yet."""
        if not self.tokens:
            self.tokens = list(prompt)
        seen = len(self.tokens) - len(prompt)
        self.tokens.extend(output[seen:])

    def propose(self, k: int) -> list[int]:
        """At most `k` tokens that followed the latest earlier occurrence of the last n tokens
        (the longest n that occurred); [] when none did. Past the end, the continuation copies
        itself: from an occurrence `end - at` tokens back, each proposed token is the one that
        many before it, as the sequence would go on if it repeats."""
        toks, end = self.tokens, len(self.tokens)
        # NOTE: continuation positions i < end are known; the suffix itself (continued at `end`)
        # is indexed only once its next token is.
        for i in range(max(self._indexed, 1), end):
            for n in self.sizes:
                if i >= n:
                    self._after[n][tuple(toks[i - n : i])] = i
        self._indexed = max(self._indexed, end)
        if k <= 0:
            return []
        for n in self.sizes:
            if end > n:
                at = self._after[n].get(tuple(toks[end - n :]))
                if at is not None:
                    return _continued(toks, at, k)
        return []


def _continued(toks: list[int], at: int, k: int) -> list[int]:
    """`k` tokens from `at` on, the ones past the end repeating with period `len(toks) - at`."""
    period = len(toks) - at
    known = toks[at:]
    return [known[j % period] for j in range(k)]
