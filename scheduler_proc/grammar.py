"""Token masks for constrained requests: one llguidance matcher per request, masks on the host.

A decode step with constrained rows gets a packed bitmask (rows x ceil(vocab / 32) int32, bit t
of a row set when token t may come next); unconstrained and pad rows are all ones. The sampler
expands it inside the step's graph (`sampling._masked`). A matcher needs its request's last
token before it can say what may follow it, so the scheduler computes a step's masks once the
previous step's tokens are on the host (docs/structured_output.md: how that sits in the overlap
chain).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from engine.constraints import field_of, grammar_of
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Grammars:
    """The model's llguidance tokenizer (built on first use) and the matchers made from it.

    NOTE: both are built on a worker thread (llguidance drops the GIL while it builds): on the
    scheduler's own thread a 190 KB schema's matcher held every decoding row 0.67 s, and the
    tokenizer 0.36-0.57 s."""

    def __init__(self, tokenizer_file: Path | None, vocab: int, eos: list[int]) -> None:
        self._file, self.vocab, self._eos = tokenizer_file, vocab, eos
        self._tokenizer: Any = None
        self._executor: Any = None
        self._builder: ThreadPoolExecutor | None = None
        self.mask_s = 0.0  # host time spent computing masks
        self.masks = 0  # rows masked

    def start(self, params: SamplingParams) -> Future[Any]:
        """A matcher for the request's constraint, built on the worker thread; its exception
        (`InvalidRequest`) is the request's. A model without tokenizer.json is refused here."""
        if self._file is None or not self._file.is_file():
            raise InvalidRequest(
                "grammar", "structured output needs the model's tokenizer.json, which it lacks"
            )
        if self._builder is None:
            self._builder = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._builder.submit(self.matcher, params)

    def close(self) -> None:
        if self._builder is not None:
            self._builder.shutdown(wait=False, cancel_futures=True)

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher for the request's constraint; `InvalidRequest` if it cannot be built."""
        from llguidance import LLMatcher

        grammar = grammar_of(params)
        assert grammar is not None, "an unconstrained request has no matcher"
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            field = field_of(params) or "grammar"
            raise InvalidRequest(field, f"cannot be compiled: {matcher.get_error().strip()}")
        return matcher

    def fill(self, matchers: list[Any | None]) -> np.ndarray | None:
        """The packed masks of one step's rows (None where no row is constrained)."""
        filled = self.fill_ahead(matchers, [[] for _ in matchers], 0)
        return None if filled is None else filled[0]

    def fill_ahead(
        self, matchers: list[Any | None], proposals: list[list[int]], w: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """A speculating step's masks: the rows' own, `(rows, words)`, and each proposal
        position's, `(rows * w, words)`: position j of row i is the mask after the row's matcher
        took proposal[: j + 1] (llguidance advances a copy of its state and rolls it back). A
        proposal must be one its matcher takes (`validate_tokens`); past it, and past a token
        that ends the grammar, everything is allowed (no such position is kept). None where no
        row is constrained."""
        pairs = enumerate(zip(matchers, proposals, strict=True))
        rows = [(m, i * (w + 1), p) for i, (m, p) in pairs if m is not None]
        if not rows:
            return None
        from llguidance.numpy import (
            fill_next_token_bitmask_par,
            fill_next_token_bitmask_par_with_draft_tokens,
        )

        t0 = time.perf_counter()
        words = (self.vocab + 31) // 32
        masks = np.full((len(matchers) * (w + 1), words), -1, dtype=np.int32)
        # NOTE: llguidance refuses an empty draft: a row without a proposal takes its own mask
        if drafts := [r for r in rows if r[2]]:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafts, masks)
        if plain := [(m, k) for m, k, p in rows if not p]:
            fill_next_token_bitmask_par(self._executor, plain, masks)
        self.mask_s += time.perf_counter() - t0
        self.masks += sum(1 + len(p) for _, _, p in rows)
        grid = masks.reshape(len(matchers), w + 1, words)
        return np.ascontiguousarray(grid[:, 0]), np.ascontiguousarray(grid[:, 1:]).reshape(
            -1, words
        )

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._build()
        return self._tokenizer

    def _build(self) -> Any:
        from llguidance import LLExecutor, LLTokenizer

        t0 = time.perf_counter()
        # NOTE: n_vocab is the model's logits width: ids past the tokenizer's are never allowed.
        tok = LLTokenizer(str(self._file), n_vocab=self.vocab, eos_token=self._eos or None)
        # NOTE: one thread: the scheduler's host work runs beside the device's, and on a small
        # CPU more threads only take cores from MLX (2 cores here).
        self._executor = LLExecutor(num_threads=1)
        log.info("structured output: tokenizer built in %.2f s", time.perf_counter() - t0)
        return tok
