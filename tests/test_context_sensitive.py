"""The test models must see their context, or a KV bug (a wrong mask, position or row) goes unseen.

Also checked here: decode-step logprobs equal mlx-lm's own, and a step's cost does not depend on
the size of the KV pool (one forward per step, KV written in place).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from scheduler_util import drive, make_scheduler, random_prompt, reference_greedy, tiny_model

from engine.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_weights_dir, tiny_qwen3_weights_dir):
    return tiny_model(tiny_weights_dir if request.param == "llama" else tiny_qwen3_weights_dir)


def test_earlier_tokens_change_the_greedy_output(model):
    """Changing only the first prompt token changes what the model generates."""
    rng = random.Random(0)
    changed = 0
    for _ in range(12):
        prompt = random_prompt(rng, rng.randint(3, 60))
        other = [(prompt[0] + 1) % 49152, *prompt[1:]]
        changed += reference_greedy(model, prompt, 6) != reference_greedy(model, other, 6)
    assert changed >= 11


def _reference_logprobs(model, prompt: list[int], n: int) -> list[tuple[int, float]]:
    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [(int(tok), float(lp[int(tok)])) for tok, lp in steps]


def test_decode_logprobs_equal_mlx_lm(model):
    """Staggered requests in one batch: each token's logprob is mlx-lm's, to float tolerance."""
    rng = random.Random(1)
    prompts = [random_prompt(rng, rng.randint(1, 90)) for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    sched = make_scheduler(model, chunked_prefill_size=16)
    outs = drive(sched, {2 * i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)})
    for i, prompt in enumerate(prompts):
        got = [
            (t, lp.logprob)
            for o in outs[f"r{i}"]
            for t, lp in zip(o.token_ids, o.logprobs, strict=True)
        ]
        want = _reference_logprobs(model, prompt, 8)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


def _prompt_peak_bytes(
    model,
    rows: int,
    prompt_len: int,
    requests: int = 1,
    max_tokens: int = 1,
    fused: str = "off",
    prepare: Callable[[Scheduler], None] | None = None,
) -> tuple[int, int]:
    """Peak memory over the scheduler's run (beyond what was held before), and its pool's bytes;
    `prepare`: called with the scheduler before it runs."""
    sched = make_scheduler(
        model,
        max_running_requests=rows,
        max_total_tokens=(rows + 1) * 2048,
        context_length=2048,
        disable_radix_cache=True,
        fused_decode=fused,
    )
    rng = random.Random(2)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    arrivals = {i: [(f"p{i}", random_prompt(rng, prompt_len + i), params)] for i in range(requests)}
    if prepare is not None:
        prepare(sched)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    drive(sched, arrivals)
    return mx.get_peak_memory() - base, sched.pool.nbytes


def test_a_prompt_costs_no_copy_of_the_pool(model):
    """Peak memory while a prompt runs is the same with a large pool as with a small one.

    NOTE: the first design ran one forward per prefill chunk; a later forward's in-place write
    was lost while an earlier one still read the buffer, so MLX copied each layer's whole K/V.
    """
    for n in (2, 40, 300):
        small, _ = _prompt_peak_bytes(model, rows=3, prompt_len=n)
        big, pool = _prompt_peak_bytes(model, rows=63, prompt_len=n)
        assert big - small < pool / 16, (n, small, big, pool)


@pytest.mark.parametrize("fused", ["off", "on"], ids=["masked", "fused"])
def test_decode_steps_cost_no_copy_of_the_pool(model, fused):
    """Ragged decode steps (rows of different lengths), masked or through the fused path's
    whole-buffer reads: peak memory does not grow with the pool."""
    small, _ = _prompt_peak_bytes(
        model, rows=5, prompt_len=30, requests=4, max_tokens=8, fused=fused
    )
    # NOTE: the smaller of two runs: whether MLX's CPU backend still holds a buffer when the
    # next step writes it is a matter of timing (a loaded full suite copied one layer once here,
    # 2026-12-04, and passed alone 3 of 3); a copy every step shows in both runs, and
    # `test_a_decode_step_leaves_the_kv_buffers_free_for_the_next` checks the cause directly.
    # Three runs: a loaded CI run (2026-12-05) copied a layer in both of two.
    big, pool = min(
        _prompt_peak_bytes(model, rows=63, prompt_len=30, requests=4, max_tokens=8, fused=fused)
        for _ in range(3)
    )
    assert big - small < pool / 16, (small, big, pool)


@pytest.mark.parametrize("fused", ["off", "on"], ids=["masked", "fused"])
def test_a_decode_step_leaves_the_kv_buffers_free_for_the_next(model, fused, monkeypatch):
    """A chained decode step's first writes reuse their layer's buffer only if nothing still
    holds it; MLX's CPU backend holds what `async_eval` was given until the whole step has
    run, so a decode step that asked for the KV buffers (its writes are read by its attention
    anyway) made the next step copy a layer, or not, by timing. Checked where it is decided:
    no decode step asks for them."""
    sched = make_scheduler(model, max_running_requests=4, fused_decode=fused)
    kv = sched.pool.keys + sched.pool.values
    asked: list[tuple[int, bool]] = []  # NOTE: (KV buffers asked for, by a decode launch)
    launching: list[bool] = []
    real, launch = mx.async_eval, sched.runner.launch

    def spy(*arrays):
        asked.append((sum(any(a is b for b in kv) for a in arrays), launching == [True]))
        return real(*arrays)

    def tracked(batch, *a, **k):
        launching.append(not batch.is_prefill)
        try:
            return launch(batch, *a, **k)
        finally:
            launching.pop()

    monkeypatch.setattr(sched.runner, "launch", tracked)
    monkeypatch.setattr(mx, "async_eval", spy)
    rng = random.Random(4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    drive(sched, {i: [(f"r{i}", random_prompt(rng, 20 + i), params)] for i in range(3)})
    decodes = [n for n, decode in asked if decode]
    assert decodes and all(n == 0 for n in decodes), asked
    assert any(n == len(kv) for n, decode in asked if not decode), asked  # NOTE: prefill asks


def _prefill_beside_a_decode_peak(model, context: int) -> tuple[int, int]:
    sched = make_scheduler(
        model,
        max_running_requests=8,
        max_total_tokens=9 * context,
        context_length=context,
        disable_radix_cache=True,
    )
    rng = random.Random(3)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=1, temperature=0.0)
    # NOTE: the later prompts take rows after the decoding one: their prefill reads a gather of
    # rows, not a slice from row 0.
    arrivals = {
        0: [("decoding", random_prompt(rng, 20), long)],
        3: [(f"p{i}", random_prompt(rng, 30), short) for i in range(6)],
    }
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    drive(sched, arrivals)
    layer = sched.pool.shapes[0]
    return mx.get_peak_memory() - base, layer.kv_heads * layer.k_dim * layer.dtype.size


def test_a_prefill_beside_decoding_rows_reads_no_whole_rows(model):
    """A prefill step's rows after a decoding row are gathered with their keys sliced first:
    `buf[rows, :, :keys]` gathered each whole row (the context length) before slicing, which
    made such steps 3x slower per token on this CPU with 4096-token rows."""
    short, per_token = _prefill_beside_a_decode_peak(model, context=256)
    long, _ = _prefill_beside_a_decode_peak(model, context=4096)
    rows = 6 * (4096 - 256) * per_token  # NOTE: one layer's K of the 6 rows, long minus short
    assert long - short < rows / 4, (short, long, rows)


class _MetalHolds:
    """MLX's Metal backend keeps every input of a command buffer alive until the buffer has run;
    this CPU backend does not. Emulated: each queued decode step holds its layers' KV buffers
    (lazy views of them) until the host learns the step has run, by waiting on it (`mx.eval`)
    or reading its tokens (`_host`)."""

    def __init__(self, sched, monkeypatch) -> None:
        import scheduler_proc.scheduler as scheduler_module

        self.pool, self.held = sched.pool, []  # NOTE: (the step's tokens, its held views)
        real_eval, real_async, real_host = mx.eval, mx.async_eval, scheduler_module._host
        real_launch = sched.runner.launch
        decoding: list[bool] = []

        def launch(batch, *a, **k):
            decoding.append(not batch.is_prefill)
            try:
                return real_launch(batch, *a, **k)
            finally:
                decoding.pop()

        def async_eval(*arrays):
            real_async(*arrays)
            if decoding == [True]:
                bufs = self.pool.keys + self.pool.values
                self.held.append((arrays[0], [b.reshape(b.shape) for b in bufs]))

        def wait(*arrays):
            real_eval(*arrays)
            self.held.clear()  # NOTE: one in-order stream: whatever was queued before has run

        def host(out):
            mine = [i for i, (tokens, _) in enumerate(self.held) if tokens is out.tokens]
            if mine:
                del self.held[: mine[0] + 1]
            return real_host(out)

        monkeypatch.setattr(sched.runner, "launch", launch)
        monkeypatch.setattr(mx, "async_eval", async_eval)
        monkeypatch.setattr(mx, "eval", wait)
        monkeypatch.setattr(scheduler_module, "_host", host)


def _chained_peak_under_metal_holds(model, rows: int, monkeypatch) -> tuple[int, Scheduler]:
    """Peak memory of 4 requests decoding 12 tokens under `_MetalHolds`, and the scheduler."""
    ran: list[Scheduler] = []
    with monkeypatch.context() as patch:

        def prepare(sched: Scheduler) -> None:
            _MetalHolds(sched, patch)
            ran.append(sched)

        peak, _ = _prompt_peak_bytes(model, rows, 30, requests=4, max_tokens=12, prepare=prepare)
    return peak, ran[0]


@pytest.mark.timeout(300)
def test_chained_decode_writes_in_place_while_the_device_sets_the_pace(model, monkeypatch):
    """Under Metal's rule (a queued step holds its inputs until it has run), a chained decode
    step queued while the step before it still ran made each layer's write copy the whole
    buffer; off CUDA the chained step is queued only once the step before has run, so peak
    memory does not grow with the pool."""
    small, _ = _chained_peak_under_metal_holds(model, 5, monkeypatch)
    big, sched = _chained_peak_under_metal_holds(model, 63, monkeypatch)
    layer = max(b.nbytes for b in sched.pool.keys)
    assert sched.stats()["steps_chained"] > 0
    assert big - small < layer / 2, (small, big, layer)
