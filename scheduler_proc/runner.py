"""Builds a step's lazy graph on the slot KV cache and queues it with `mx.async_eval`."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from scheduler_proc.batch import Batch, Chunk
from scheduler_proc.kv_cache import KVPool, LayerCache
from scheduler_proc.request import Req
from scheduler_proc.sampling import RowParams, Sampled, build_state, sample


def row_params(req: Req) -> RowParams:
    return RowParams(req.params, req.seed, len(req.output_ids), req.input_ids, req.output_ids)


class Runner:
    def __init__(self, model: nn.Module, pool: KVPool, vocab: int) -> None:
        self.model, self.pool, self.vocab = model, pool, vocab

    def launch(self, batch: Batch, decode_inputs: mx.array | None) -> None:
        """Build every forward of the batch and queue it; nothing here blocks."""
        for chunk in batch.chunks:
            self._prefill(chunk)
        if batch.rows:
            batch.decode_out = self._decode(batch, decode_inputs)
        mx.async_eval(*_outputs(batch), *self.pool.state())

    def decode_inputs(self, batch: Batch) -> mx.array:
        last = [r.output_ids[-1] for r in batch.decode] + [r.input_ids[-1] for r in batch.joined]
        return mx.array(last, dtype=mx.int32)

    def _prefill(self, chunk: Chunk) -> None:
        req = chunk.req
        # NOTE: as mlx-lm does, the last prompt token runs on its own, so the LM head (the
        # costliest matmul at small sizes) is computed for one position, not the whole chunk.
        body_end = chunk.end - 1 if chunk.last else chunk.end
        if body_end > chunk.start:
            self._forward(req, chunk.start, body_end)
        req.kv_len = body_end
        if chunk.last and not chunk.joined:
            req.kv_len = chunk.end
            logits = self._forward(req, chunk.end - 1, chunk.end)
            state = build_state([row_params(req)], self.vocab)
            chunk.out = sample(logits[:, -1, :], state)

    def _forward(self, req: Req, start: int, end: int) -> mx.array:
        tokens = mx.array(req.input_ids[start:end], dtype=mx.int32)[None]
        return self.model(tokens, cache=self.pool.prefill_view(req.row, start))

    def _decode(self, batch: Batch, inputs: mx.array) -> Sampled:
        rows = batch.rows
        if batch.sampler is None:
            batch.sampler = build_state([row_params(r) for r in rows], self.vocab)
        offsets = [r.kv_len for r in rows]
        for r in rows:
            r.kv_len += 1
        logits = self.model(inputs[:, None], cache=self._decode_cache(offsets))
        return sample(logits[:, -1, :], batch.sampler)

    def _decode_cache(self, offsets: list[int]) -> list[LayerCache]:
        # NOTE: one row is row 0 with an int offset: mlx-lm's own single-stream path (slice write,
        # no mask), cheaper than the batched scatter + per-row length mask.
        if len(offsets) == 1:
            return self.pool.prefill_view(0, offsets[0])
        return self.pool.decode_view(offsets)


def _outputs(batch: Batch) -> list[mx.array]:
    outs = [c.out for c in batch.chunks if c.out is not None]
    if batch.decode_out is not None:
        outs.append(batch.decode_out)
    return [
        a for s in outs for a in (s.tokens, s.logprob, s.top_ids, s.top_logprobs) if a is not None
    ]
