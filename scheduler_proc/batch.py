"""One launched step: one model forward, either prefill chunks or a decode of every running row.

A step is a prefill step (prompt chunks of several requests, padded to one width, no logits
needed) or a decode step (every decoding row plus the prompts whose last token is due; the last
prompt token always runs here, so a prefill step never computes the LM head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from scheduler_proc.request import Req
from scheduler_proc.sampling import Sampled, SamplerState


@dataclass(eq=False)
class PromptSlice:
    """Prompt tokens `[start, end)` of one request, written to its row by a prefill step (a
    "prefill chunk"; the wire's `Chunk` is a text delta, another thing)."""

    req: Req
    start: int
    end: int
    lone: bool = False  # a lone chunk: padded to the lone width, attending over its row's keys


@dataclass(eq=False)
class Batch:
    """Forward rows are `decode` then `joined` (prefilling requests whose last fill token runs
    in this forward), in that order; padding rows follow."""

    decode: list[Req] = field(default_factory=list)
    joined: list[Req] = field(default_factory=list)
    slices: list[PromptSlice] = field(default_factory=list)
    sampler: SamplerState | None = None
    chained: bool = False
    step_index: int = -1  # stamped by prepare_launch
    launch_ts: float | None = None  # stamped by prepare_launch, before graph building
    decode_out: Sampled | None = None
    shape: tuple[int, ...] = ()  # its forward's (rows, width, keys), set by the runner
    new_shape: bool = False  # a shape first seen after warm-up
    allowed: np.ndarray | None = None  # constrained rows' packed token masks (grammar.py)
    logits: mx.array | None = None  # a chained forward whose sampling waits for its masks
    prompt_lps: list[mx.array] = field(default_factory=list)  # prompt logprobs it computes
    # NOTE: speculation (speculate.py): per row, its proposal ([] none; None: the row does not
    # speculate), and the tokens drawn at the proposal's positions, `(rows, width - 1)`, with
    # their logprobs when asked for, lazy
    proposals: list[list[int] | None] | None = None
    spec_out: Sampled | None = None
    # NOTE: constrained rows' masks at the proposal's positions, `(rows * (width - 1), words)`
    spec_allowed: np.ndarray | None = None
    # NOTE: a prefill step queued right after this chained decode step, riding its chain
    beside: Batch | None = None

    @property
    def rows(self) -> list[Req]:
        return self.decode + self.joined

    def reqs(self) -> list[Req]:
        side = self.beside.reqs() if self.beside is not None else []
        return self.rows + [c.req for c in self.slices] + side

    @property
    def is_prefill(self) -> bool:
        return bool(self.slices)

    @property
    def pure_decode(self) -> bool:
        return bool(self.decode) and not self.joined and not self.slices
