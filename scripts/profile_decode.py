"""Where a batched decode step's time goes: the engine's pieces timed one by one against mlx-lm.

  python3 scripts/profile_decode.py --random llama-1b --batch 64 --context 600   # a GPU

Each line is the median over `--steps` of one piece, synchronised (`.tolist()` / `mx.eval`):
mlx-lm's plain KVCache forward, the engine's forward on its paged pool (the KV length bucketed as
the scheduler does, and exact), without a mask, the sampler's state built from host lists, and the
sampler itself. The pool holds each row's pages as the allocator hands them (one run per row);
`--shuffle-pages` shuffles them across the pool, to see what the gather of scattered pages costs.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_proc.kv_cache import EntryCache, KVPool
    from scheduler_proc.kv_layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, steps: int) -> float:
    fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def paged_pool(
    layout: Layout, b: int, n: int, page: int, shuffle: bool
) -> tuple[KVPool, list[list[int]]]:
    """A pool for B rows of `n` tokens (and the step's one more) in a context of `n + 512`, as
    the ladders, and the rows' page tables: one run each as the allocator hands them, or
    shuffled across the pool."""
    from scheduler_proc.kv_cache import KVPool
    from scheduler_proc.pages import PageAllocator

    per_row = -(-(n + 1) // page)
    pool = KVPool(layout, b * per_row, page, slots=b, context=n + 512, chunk=512)
    pages = PageAllocator(pool.pages, page)
    ids = pages.alloc(b * per_row)
    if shuffle:
        random.Random(0).shuffle(ids)
    return pool, [ids[i * per_row : (i + 1) * per_row] for i in range(b)]


def override_mask(layers: list[EntryCache], mask: str) -> None:
    """The attention layers' masks for one forward: "none", or each layer's own as an additive
    bfloat16 mask. NOTE: set on this forward's cache objects, so no other forward sees it."""
    import mlx.core as mx

    from scheduler_proc.kv_cache import LayerCache

    for c in layers:
        if not isinstance(c, LayerCache):
            continue
        add = None
        if mask == "additive":
            add = mx.where(c.make_mask(1, True, None), 0.0, -mx.inf).astype(mx.bfloat16)
        c.make_mask = lambda *a, add=add, **k: add  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--random", choices=["llama-1b", "gemma3-small", "qwen3next-small"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV page")
    p.add_argument("--shuffle-pages", action="store_true", help="rows' pages shuffled")
    args = p.parse_args()
    from engine.cpu_backend import setup_cpu_backend

    setup_cpu_backend(None, log_line=False)
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.config import EngineConfig
    from engine.random_model import random_model_dir
    from engine.sampling_params import SamplingParams
    from scheduler_proc.kv_cache import StepRows
    from scheduler_proc.kv_layout import probe_model
    from scheduler_proc.model_loader import load_for_scheduler
    from scheduler_proc.sampling import RowParams, build_state, sample
    from scheduler_proc.shapes import Ladders

    path = str(random_model_dir(args.random)) if args.random else args.model
    model, _ = load_for_scheduler(path, EngineConfig())
    b, n = args.batch, args.context
    layout, vocab = probe_model(model)
    tokens = mx.zeros((b, 1), mx.int32)

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((b, n), mx.int32), cache=cache))

    def ref():
        logits = model(tokens, cache=cache)
        mx.argmax(logits[:, -1, :], axis=-1).tolist()
        # NOTE: stay at n tokens, so every call costs the same; a recurrent layer's state
        # (ArraysCache, no offset) costs the same whatever it holds.
        for c in cache:
            if hasattr(c, "offset"):
                c.offset -= 1

    pool, tables = paged_pool(layout, b, n, args.page_size, args.shuffle_pages)
    lad = Ladders.for_pool(b, n + 512, 512)
    plan = StepRows(list(range(b)), tables, [n] * b, [1] * b, width=1)

    def ours(kv_len: int, mask: str = "bool"):
        def run():
            layers = pool.ragged_view(plan, kv_len)
            if mask != "bool":
                override_mask(layers, mask)
            logits = model(tokens, cache=layers)
            mx.argmax(logits[:, -1, :], axis=-1).tolist()

        return run

    rows = [RowParams(SamplingParams(temperature=0.0), i, 3, [1, 2], [3]) for i in range(b)]
    state = build_state(rows, vocab)
    logits = mx.random.normal((b, vocab)).astype(mx.bfloat16)
    mx.eval(logits)
    order = "shuffled" if args.shuffle_pages else "one run per row"
    print(f"{mx.default_device()} B={b} context={n} pages of {args.page_size} ({order})")
    print(f"mlx-lm KVCache forward+argmax          {timed(ref, args.steps):8.2f} ms")
    bucket = lad.pad_kv(n + 1)
    print(f"engine forward, kv {bucket} (bucket)    {timed(ours(bucket), args.steps):8.2f} ms")
    print(f"engine forward, kv {n + 1} (exact)      {timed(ours(n + 1), args.steps):8.2f} ms")
    print(f"engine forward, exact, no mask        {timed(ours(n + 1, 'none'), args.steps):8.2f} ms")
    print(
        f"engine forward, exact, additive mask  {timed(ours(n + 1, 'additive'), args.steps):8.2f} ms"
    )
    step32 = lad.pad_decode_kv(n + 1)
    print(f"engine forward, kv {step32} (x32), bool mask {timed(ours(step32), args.steps):8.2f} ms")
    print(f"build_state from host lists           {timed(lambda: mx.eval(build_state(rows, vocab).seed), args.steps):8.2f} ms")  # fmt: skip
    print(f"sample (greedy)                       {timed(lambda: sample(logits, state).tokens.tolist(), args.steps):8.2f} ms")  # fmt: skip
    print(f"10 small host arrays                  {timed(lambda: mx.eval([mx.array(list(range(b))) for _ in range(10)]), args.steps):8.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
