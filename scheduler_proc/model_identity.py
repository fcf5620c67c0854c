"""A model's identity for KV kept beyond the process (the disk tier): what its weights are.

Two models whose KV differ must never share a key, whatever their paths: a fine-tune, another
quantization, a LoRA adapter on top, random test weights of the same shape. So the identity is
read from the loaded parameters themselves (names, shapes, dtypes, and a strided sample of every
tensor's bits), not from file names or times: a weight swap or an adapter changes it, a copy of
the same model to another folder does not.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SAMPLES = 256  # NOTE: values read per tensor; a fine-tune changes nearly every one


def fingerprint(model) -> str:
    """A hex digest of the model's parameters (one evaluation of their samples)."""
    digest = hashlib.blake2b(digest_size=16)
    samples = []
    params: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for name, p in params:
        digest.update(f"{name}:{p.dtype}:{tuple(p.shape)};".encode())
        flat = p.reshape(-1)
        step = max(1, flat.size // SAMPLES)
        samples.append(flat[::step][:SAMPLES].view(mx.uint8))
    if samples:
        digest.update(np.array(mx.concatenate(samples)).tobytes())
    return digest.hexdigest()
