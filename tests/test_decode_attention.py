"""The fused decode attention: rows of different lengths read through a page table, no mask.

The kernel runs on CUDA only (checked there against the masked twin); the masked twin (checked
everywhere against MLX's attention over each row's keys assembled by hand from its pages) and the
plumbing (`PagedKeys`, the model's attention rebound, the start-up checks) run everywhere.
Greedy parity through it: tests/test_scheduler_parity.py.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx_lm.models.llama as llama_module
import pytest
from mlx_lm.models import base
from mlx_lm.utils import load_model

from scheduler_proc import decode_attention
from scheduler_proc.decode_attention import PagedKeys

CUDA = decode_attention.available()
cuda_only = pytest.mark.skipif(not CUDA, reason="the kernel runs on MLX's CUDA backend")

LENGTHS = [1, 0, 127, 128, 129, 600, 1000, 2, 1100, 31, 32, 33]
GARBAGE = 1e4  # NOTE: slots no row may read: one of them in a softmax swamps every other key
SCRATCH = 0  # NOTE: the page that pads every table row past the row's own pages


class Case:
    """Rows' pages shuffled across a pool, every slot outside a row's keys (the scratch page, the
    tails of rows' last pages, free pages) garbage; `slots[b]` row b's keys' slots, by hand."""

    def __init__(self, heads, kv_heads, dim, lengths, page_size, dtype, spare_pages=1):
        rng = random.Random(0)
        p = page_size
        need = [-(-n // p) for n in lengths]
        width = max(need) + spare_pages  # NOTE: padded past the longest row, as a bucket is
        pages = list(range(1, 1 + sum(need) + 5))  # NOTE: 5 free pages
        rng.shuffle(pages)
        self.table, self.slots = [], []
        for n, m in zip(lengths, need, strict=True):
            own, pages = pages[:m], pages[m:]
            self.table.append(own + [SCRATCH] * (width - m))
            self.slots.append([own[t // p] * p + t % p for t in range(n)])
        total = (1 + sum(need) + 5) * p
        mx.random.seed(0)
        real = mx.zeros((total,), dtype=mx.bool_)
        real[mx.array([s for row in self.slots for s in row], dtype=mx.int32)] = True
        shape = (1, kv_heads, total, dim)
        k, v = mx.random.normal(shape), mx.random.normal(shape)
        self.k = mx.where(real[:, None], k, GARBAGE).astype(dtype)
        self.v = mx.where(real[:, None], v, GARBAGE).astype(dtype)
        self.q = mx.random.normal((len(lengths), heads, 1, dim)).astype(dtype)
        self.lengths = lengths
        self.keys = PagedKeys(
            lengths=mx.array(lengths, dtype=mx.int32),
            max_len=max(lengths),
            table=mx.array(self.table, dtype=mx.int32),
            page_size=p,
        )

    def each_row(self, scale: float, sinks: mx.array | None = None) -> list[mx.array | None]:
        """MLX's own attention over exactly row b's keys (None: a pad row)."""
        out: list[mx.array | None] = []
        for b, slots in enumerate(self.slots):
            if not slots:
                out.append(None)
                continue
            idx = mx.array(slots, dtype=mx.int32)
            k, v = self.k[:, :, idx], self.v[:, :, idx]
            q = self.q[b : b + 1]
            out.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, sinks=sinks))
        return out


def _assert_rows_match(out: mx.array, want: list[mx.array | None], tol: float) -> None:
    assert not mx.any(mx.isnan(out)).item()
    for b, w in enumerate(want):
        if w is not None:
            got = out[b : b + 1].astype(mx.float32)
            assert mx.allclose(got, w.astype(mx.float32), atol=tol, rtol=tol).item(), b


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 32), (6, 2, 128)])
def test_the_masked_twin_attends_to_each_rows_own_keys(heads, kv_heads, dim, page_size):
    case = Case(heads, kv_heads, dim, LENGTHS, page_size, mx.float32)
    out = decode_attention._masked(case.q, case.k, case.v, case.keys, 0.125)
    _assert_rows_match(out, case.each_row(0.125), 1e-5)


def test_the_masked_twin_under_a_loose_bound_reads_the_table_to_its_end():
    """A bucketed `max_len` past every row (the table's whole width) changes nothing."""
    case = Case(4, 2, 64, LENGTHS, 16, mx.float32, spare_pages=3)
    loose = PagedKeys(case.keys.lengths, len(case.table[0]) * 16, case.keys.table, 16)
    out = decode_attention._masked(case.q, case.k, case.v, loose, 0.125)
    _assert_rows_match(out, case.each_row(0.125), 1e-5)


def test_the_masked_twin_of_a_step_of_pad_rows_only():
    """Every row padding (max_len 0): still one key per softmax row, so no NaN."""
    case = Case(4, 2, 64, [0, 0], 16, mx.float32)
    out = decode_attention._masked(case.q, case.k, case.v, case.keys, 0.125)
    assert out.shape == case.q.shape and not mx.any(mx.isnan(out)).item()


KERNELS = pytest.mark.parametrize("lanes", [False, True], ids=["tiles", "lanes"])


@cuda_only
@KERNELS
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(32, 8, 64), (16, 16, 128), (8, 1, 256), (9, 3, 64), (8, 2, 80)]
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_attends_to_each_rows_own_keys(heads, kv_heads, dim, dtype, lanes):
    """Few rows: each row's keys split across blocks and merged (rows of 0 to 1100 keys, so
    some splits get no key)."""
    _check_kernel(heads, kv_heads, dim, dtype, 32, splits=None, lanes=lanes)


@cuda_only
@KERNELS
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 3], ids=["one-pass", "three"])
def test_the_kernel_in_one_pass_or_an_odd_split(splits, page_size, lanes):
    _check_kernel(32, 8, 64, mx.bfloat16, page_size, splits, lanes=lanes)


def test_the_lanes_kernel_takes_the_common_head_shapes():
    """Lanes over keys where a key's loads divide a warp and G * E values fit in registers;
    the tiled kernel for the rest (head dims 80 and 96, many query heads per KV head)."""
    fit = decode_attention.lanes_fit
    assert fit(4, 64, mx.bfloat16) and fit(8, 128, mx.bfloat16) and fit(8, 256, mx.float32)
    assert fit(1, 128, mx.float32) and fit(4, 64, mx.float16)
    assert not fit(4, 80, mx.bfloat16) and not fit(4, 96, mx.bfloat16)
    assert not fit(16, 128, mx.bfloat16)


def _check_kernel(
    heads, kv_heads, dim, dtype, page_size: int, splits: int | None, lanes: bool = False
) -> None:
    g = heads // kv_heads
    if lanes and not decode_attention.lanes_fit(g, dim, dtype):
        pytest.skip("the lanes kernel does not take this shape")
    case = Case(heads, kv_heads, dim, LENGTHS, page_size, dtype)
    if splits is None:
        assert decode_attention.split_count(len(LENGTHS) * kv_heads, max(LENGTHS)) > 1
    scale = dim**-0.5
    out = decode_attention.decode_attention(
        case.q, case.k, case.v, case.keys, scale, splits, lanes=lanes
    )
    q, k, v = (x.astype(mx.float32) for x in (case.q, case.k, case.v))
    want = decode_attention._masked(q, k, v, case.keys, scale)
    # NOTE: MLX's float32 attention on CUDA multiplies in TF32: the reference is the coarse one.
    tol = 2e-3 if dtype == mx.float32 else 2e-2
    _assert_rows_match(out, [None if n == 0 else want[b] for b, n in enumerate(LENGTHS)], tol)
    assert not mx.any(out[1] != 0).item()  # NOTE: a pad row gives zeros


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_passes_its_start_up_check(dtype):
    assert decode_attention.self_check(dtype)


def _quantized(case: Case, bits: int, group: int):
    """The case's pages quantized: codes, `PagedKeys` with their scales and biases, and the
    values MLX's `dequantize` gives back (float32), which every reading must attend to."""
    k, v, keys = decode_attention._quantized(case.k, case.v, case.keys, bits, group)
    kd, vd = decode_attention._plain_values(k, v, keys.quant, mx.float32)
    return k, v, keys, kd, vd


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64])
def test_the_masked_twin_reads_quantized_pages_through_the_table(bits, group):
    """Codes, scales and biases each gathered through the table and dequantized: the attention
    over the values they stand for (garbage slots included, so a wrong slot shows)."""
    case = Case(4, 2, 64, LENGTHS, 16, mx.float32)
    k, v, keys, kd, vd = _quantized(case, bits, group)
    out = decode_attention._masked(case.q, k, v, keys, 0.125)
    plain = decode_attention._plain_keys(keys)
    want = decode_attention._masked(case.q, kd, vd, plain, 0.125)
    _assert_rows_match(out, [None if n == 0 else want[b] for b, n in enumerate(LENGTHS)], 1e-4)


@cuda_only
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 64), (16, 8, 128), (8, 2, 256)])
@pytest.mark.parametrize("splits", [None, 1], ids=["split", "one-pass"])
def test_the_quantized_kernel_attends_to_the_values_its_codes_stand_for(
    heads, kv_heads, dim, bits, group, splits
):
    """`--kv-bits`: the kernel maps codes back in registers; it attends as MLX's attention over
    MLX's `dequantize` of the same pages, in one pass and split."""
    if dim % group:
        pytest.skip("the group does not divide the head dim")
    case = Case(heads, kv_heads, dim, LENGTHS, 32, mx.bfloat16)
    k, v, keys, kd, vd = _quantized(case, bits, group)
    assert decode_attention.quant_fit(case.q, k, v, keys.quant)
    scale = dim**-0.5
    out = decode_attention.decode_attention(case.q, k, v, keys, scale, splits)
    plain = decode_attention._plain_keys(keys)
    want = decode_attention._masked(case.q.astype(mx.float32), kd, vd, plain, scale)
    _assert_rows_match(out, [None if n == 0 else want[b] for b, n in enumerate(LENGTHS)], 2e-2)
    assert not mx.any(out[1] != 0).item()  # NOTE: a pad row gives zeros


@cuda_only
@pytest.mark.parametrize("quant", [(8, 64), (4, 32)])
def test_the_quantized_kernel_passes_its_start_up_check(quant):
    assert decode_attention.self_check(mx.bfloat16, dim=64, quant=quant)


def test_few_rows_split_their_keys_across_blocks():
    """Enough blocks to fill a large GPU, never a split without a whole tile of keys."""
    assert decode_attention.split_count(blocks=512, max_len=2048) == 1
    assert decode_attention.split_count(blocks=512, max_len=4096) == 2  # NOTE: SPLIT_KEYS each
    assert decode_attention.split_count(blocks=16, max_len=4096) == 16
    assert decode_attention.split_count(blocks=8, max_len=4096) == 32
    assert decode_attention.split_count(blocks=16, max_len=1100) == 8
    # NOTE: short rows run in one pass whatever the row count: the merge would cost more
    assert decode_attention.split_count(blocks=8, max_len=600) == 1


def test_one_long_row_among_many_short_ones_splits_its_keys():
    """The split count is the batch's: 64 chats and one row of 30k keys (a long prompt's last
    token, then its decode) split the long row's keys, SPLIT_KEYS a block at most, not one
    block per KV head walking all of them (H200: 40-70 ms steps beside 8 ms ones)."""
    blocks = 65 * 8
    n = decode_attention.split_count(blocks, max_len=30016)
    assert n == 16 and -(-30016 // n) <= decode_attention.SPLIT_KEYS
    assert decode_attention.split_count(blocks, max_len=640) == 1  # NOTE: the chats alone
    assert decode_attention.split_count(blocks, max_len=200_000) == 32


def _fake_kernel(shift: int = 0, pad_zeros: bool = True):
    """The masked twin with the kernel's zeros for pad rows; `shift` moves each length."""

    def run(q, k, v, keys, scale, splits=None):
        moved = PagedKeys(keys.lengths + shift, keys.max_len + 1, keys.table, keys.page_size)
        out = decode_attention._masked(q, k, v, moved, scale)
        return mx.where((keys.lengths > 0)[:, None, None, None], out, 0) if pad_zeros else out

    return run


@pytest.mark.parametrize(
    "kernel,agrees",
    [
        (_fake_kernel(), True),
        (_fake_kernel(shift=1), False),
        (_fake_kernel(pad_zeros=False), False),
        (None, False),
    ],
    ids=["right", "one-key-past", "pad-rows-not-zero", "fails-to-build"],
)
def test_the_start_up_check_turns_a_wrong_kernel_away(monkeypatch, kernel, agrees):
    """Off CUDA with a stand-in kernel: the check passes only one that agrees with the twin."""

    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: error")

    monkeypatch.setattr(decode_attention, "available", lambda: True)
    monkeypatch.setattr(decode_attention, "decode_attention", kernel or broken)
    assert decode_attention.self_check(mx.float32) is agrees


def test_off_cuda_the_start_up_check_runs_nothing(monkeypatch):
    monkeypatch.setattr(decode_attention, "available", lambda: False)
    monkeypatch.setattr(decode_attention, "decode_attention", None)  # NOTE: a call would raise
    assert decode_attention.self_check() is True


class _Paged:
    """A layer cache in a fused decode step."""

    def __init__(self, keys: PagedKeys | None) -> None:
        self.keys = keys

    def fused_lengths(self) -> PagedKeys | None:
        return self.keys


@pytest.mark.parametrize("cache", [object(), _Paged(None)], ids=["no-fused-lengths", "not-fused"])
def test_attention_outside_a_fused_decode_is_mlx_lms(monkeypatch, cache):
    seen = []

    def mlx_lms(*args):
        seen.append(args)
        return "mlx-lm"

    monkeypatch.setattr(base, "scaled_dot_product_attention", mlx_lms)
    before = decode_attention.counts.calls
    q = mx.zeros((1, 2, 1, 8))
    assert decode_attention.attention(q, q, q, cache, 0.5, "causal") == "mlx-lm"
    assert len(seen) == 1 and seen[0][3:] == (cache, 0.5, "causal", None)
    assert decode_attention.counts.calls == before


@pytest.mark.parametrize(
    "dim,sinks,masked",
    [(64, False, False), (64, True, True), (288, False, True)],
    ids=["fits", "sinks", "too-wide"],
)
def test_attention_in_a_fused_decode_reads_the_pages(dim, sinks, masked):
    """The kernel where it fits (its twin off CUDA), the masked twin with sinks or a head too
    wide; every call counted, those that took the masked path too."""
    case = Case(4, 2, dim, [5, 0, 40], 16, mx.float32)
    sink = mx.array([0.5, -1.0, 2.0, 0.0]) if sinks else None
    before = (decode_attention.counts.calls, decode_attention.counts.masked)
    out = decode_attention.attention(case.q, case.k, case.v, _Paged(case.keys), 0.125, None, sink)
    _assert_rows_match(out, case.each_row(0.125, sink), 1e-5)
    assert decode_attention.counts.calls == before[0] + 1
    assert decode_attention.counts.masked == before[1] + masked


def test_install_rebinds_mlx_lms_name_in_the_models_modules(tiny_weights_dir, monkeypatch):
    model = load_model(tiny_weights_dir)[0]
    # NOTE: recorded, so the rebinding is undone after the test
    monkeypatch.setattr(
        llama_module, "scaled_dot_product_attention", base.scaled_dot_product_attention
    )
    assert decode_attention.install(model) >= 1
    assert llama_module.scaled_dot_product_attention is decode_attention.attention
    assert decode_attention.install(model) >= 1  # NOTE: installed twice: still counted


def test_a_model_whose_attention_is_not_mlx_lms_keeps_the_mask(tiny_weights_dir, monkeypatch):
    """The start-up check: a layer that bypasses the rebound name would read whole buffers
    unmasked, so the runner keeps the masked path for such a model."""
    # NOTE: imported here: only this test needs the scheduler
    from scheduler_util import make_scheduler, tiny_model

    model = tiny_model(tiny_weights_dir)

    def own_attention(queries, keys, values, cache, scale, mask, sinks=None):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    monkeypatch.setattr(llama_module, "scaled_dot_product_attention", own_attention)
    assert make_scheduler(model, fused_decode="on").runner.fused_decode is False
    monkeypatch.undo()
    assert make_scheduler(model, fused_decode="on").runner.fused_decode is True
    assert make_scheduler(model, fused_decode="off").runner.fused_decode is False


def test_the_start_up_check_runs_the_models_own_head_shape(tiny_weights_dir, monkeypatch):
    """Which kernel runs depends on the head shape (`lanes_fit`), so the start-up check runs
    the model's (query heads, KV heads, head dim, dtype, page size), not only its own case; a
    kernel wrong for that shape alone keeps the masked path."""
    from scheduler_util import make_scheduler, tiny_model

    model = tiny_model(tiny_weights_dir)
    args = model.args
    dim = args.hidden_size // args.num_attention_heads
    seen: list[dict] = []

    def check(**case):
        seen.append(case)
        return case.get("dim") != dim  # NOTE: wrong for the model's shape only

    monkeypatch.setattr(decode_attention, "self_check", check)
    sched = make_scheduler(model, fused_decode="on")
    assert sched.runner.fused_decode is False
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    assert {
        "heads": heads,
        "kv_heads": kv,
        "dim": dim,
        "page_size": sched.pool.page_size,
    }.items() <= seen[-1].items()


@pytest.mark.parametrize("mask", ["none", "causal", "lengths", "2-d"])
def test_one_token_rows_attend_the_same_with_their_query_heads_folded(mask):
    """`folded` (the CPU's one-token rows: the query heads of a KV head as one product's rows)
    against MLX's attention as mlx-lm calls it; each KV head's keys differ, so a head read
    against another's keys, or a row seeing keys its mask hides, shows."""
    rng = random.Random(1)
    n = 40
    q = mx.random.normal((3, 8, 1, 16), key=mx.random.key(rng.randrange(1 << 30)))
    k = mx.random.normal((3, 2, n, 16), key=mx.random.key(rng.randrange(1 << 30)))
    v = mx.random.normal((3, 2, n, 16), key=mx.random.key(rng.randrange(1 << 30)))
    m = {
        "none": None,
        "causal": "causal",
        "lengths": (mx.arange(n)[None] < mx.array([n, 7, 1])[:, None])[:, None, None],
        "2-d": mx.arange(n)[None] >= 3,  # NOTE: mlx-lm's window mask at one query: (1, N)
    }[mask]
    assert decode_attention.foldable(q, k, m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = decode_attention.folded(q, k, v, 0.25, m)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def test_only_one_token_rows_of_grouped_heads_are_folded():
    q1, q4, k = mx.zeros((2, 8, 1, 16)), mx.zeros((2, 8, 4, 16)), mx.zeros((2, 2, 9, 16))
    assert not decode_attention.foldable(q4, k, None)  # NOTE: a chunk: its rows see different keys
    assert not decode_attention.foldable(mx.zeros((2, 2, 1, 16)), k, None)  # NOTE: no groups
    assert not decode_attention.foldable(q1, k, mx.zeros((2, 8, 1, 9)))  # NOTE: a mask per head
    assert decode_attention.foldable(q1, k, mx.zeros((2, 1, 1, 9)))
    assert decode_attention.foldable(q1, k, mx.zeros((1, 9)))
    assert not decode_attention.foldable(q1, k, mx.zeros((8, 1, 9)))  # NOTE: per head again


def test_on_the_cpu_attention_folds_one_token_rows(monkeypatch):
    """Off a fused decode, a one-token row with grouped heads takes `folded` on the CPU (the
    default device here), and anything else still mlx-lm's attention."""
    monkeypatch.setattr(decode_attention, "_fold_heads", lambda: True)
    seen = []
    monkeypatch.setattr(base, "scaled_dot_product_attention", lambda *a: seen.append(a) or "mlx-lm")
    k = mx.random.normal((1, 2, 9, 16))
    one = decode_attention.attention(mx.ones((1, 8, 1, 16)), k, k, object(), 0.5, None)
    assert isinstance(one, mx.array) and one.shape == (1, 8, 1, 16) and not seen
    chunk = mx.ones((1, 8, 4, 16))
    assert decode_attention.attention(chunk, k, k, object(), 0.5, "causal") == "mlx-lm"
