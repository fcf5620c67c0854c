"""Whether a model's recurrent layers leave a row's state untouched at padded positions.

A prefill step pads every row to one width. mlx-lm's recurrent layers are told which positions
are real (`cache.lengths`, `make_mask`), but not every model honours it everywhere (nemotron_h's
Mamba scan takes no lengths: its state absorbs the padding). One probe forward at start-up
decides: a row padded at its end must end with the state of the same row unpadded. When it does
not, the scheduler runs equally long, unpadded chunks in each prefill step instead.
"""

from __future__ import annotations

import mlx.core as mx

from scheduler_proc.kv_cache import KVPool, StepRows
from scheduler_proc.kv_layout import Layout

_TOKENS = [[11, 12, 13, 14], [21, 22, 0, 0]]  # NOTE: row 1 has two real tokens, two pads
_ATOL, _RTOL = 1e-4, 1e-3


def padding_keeps_state(model, layout: Layout) -> bool:
    """True when padding a row leaves its recurrent state as it is without the padding."""
    if not layout.states:
        return True
    padded = _run(model, layout, _TOKENS, [4, 2])
    alone = _run(model, layout, [_TOKENS[1][:2]], [2])
    for got_layer, want_layer in zip(padded, alone, strict=True):
        for got, want in zip(got_layer, want_layer, strict=True):
            if not mx.allclose(got[1], want[0], atol=_ATOL, rtol=_RTOL).item():
                return False
    return True


def _run(model, layout: Layout, tokens: list[list[int]], lengths: list[int]):
    rows, width = len(tokens), len(tokens[0])
    pool = KVPool(layout, pages=rows, page_size=width, slots=rows, context=width, chunk=width)
    # NOTE: page 0 is scratch: row r writes page r + 1.
    plan = StepRows(list(range(rows)), [[r + 1] for r in range(rows)], [0] * rows, lengths, width)
    model(mx.array(tokens, dtype=mx.int32), cache=pool.ragged_view(plan, width))
    mx.eval(pool.state())
    return pool.states
