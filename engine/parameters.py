"""A model's lazy parameters evaluated group by group, each group a step of a `Progress`.

NOTE: mlx-lm's eager load (and any `mx.eval(model.parameters())`) computes every parameter in one
call: silent for as long as a large model takes to read from disk, or to dequantize on a CPU.
Evaluated a group at a time, the same work reports as it goes.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.progress import Progress

GROUP_BYTES = 256 << 20  # NOTE: a 4 GB model: 16 steps; a tiny one: one
LOG_EVERY_S = 5.0


def evaluate(net: Any, log: logging.Logger, what: str) -> float:
    """Evaluate `net`'s parameters, reporting bytes done of the total; logs and returns the
    seconds it took."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: dict[str, Any] = {}
    tree_flatten(net.parameters(), destination=flat)
    arrays = list(flat.values())
    progress = Progress(log, what, sum(a.nbytes for a in arrays), "B", LOG_EVERY_S)
    group: list[Any] = []
    size = 0
    for a in arrays:
        group.append(a)
        size += a.nbytes
        if size >= GROUP_BYTES:
            mx.eval(group)
            progress.step(size)
            group, size = [], 0
    mx.eval(group)
    progress.step(size)
    return progress.finish()
