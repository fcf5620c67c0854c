"""The prefix cache's disk tier (`--kv-cache-dir`): blocks written by one engine are read by the
next, answers unchanged; any file that is not exactly the block asked for is skipped.

Parity is checked against mlx-lm's own greedy generation on the tiny random llama that sees its
context (tests/test_context_sensitive.py): KV loaded into a wrong place, or another prompt's,
changes the tokens.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_harness import LaunchedEngine, bounded, post_json  # noqa: F401
from scheduler_util import (
    assert_pages_balanced,
    drive,
    greedy,
    make_scheduler,
    random_prompt,
    reference_greedy,
    tiny_model,
    tokens,
)

from engine.config import EngineConfig
from engine.random_model import TINY_LLAMA, make_random_model
from scheduler_proc import disk_tier, kv_files
from scheduler_proc.disk_cache import BlockFormat, DiskCache
from scheduler_proc.model_identity import fingerprint
from scheduler_proc.scheduler import DISK_BLOCK_TOKENS, Scheduler

pytestmark = pytest.mark.usefixtures("bounded")
PAGE = 16
B = DISK_BLOCK_TOKENS  # NOTE: a multiple of PAGE: blocks are whole pages


@pytest.fixture(scope="module")
def llama(tiny_weights_dir):
    return tiny_model(tiny_weights_dir)


def _engine(model, folder: Path, **overrides) -> Scheduler:
    return make_scheduler(model, page_size=PAGE, kv_cache_dir=str(folder), **overrides)


def _serve(sched: Scheduler, prompts: dict[str, list[int]], n: int = 6) -> dict[str, list]:
    outs = drive(sched, {0: [(rid, p, greedy(n)) for rid, p in prompts.items()]})
    return {rid: outs[rid] for rid in prompts}


def _stopped(sched: Scheduler) -> None:
    """What a clean stop does: queued blocks written, then the process would exit."""
    assert_pages_balanced(sched)
    sched.shutdown()


def _kv(sched: Scheduler, prefix: list[int]) -> list[np.ndarray]:
    """The cached K/V of `prefix` (every full layer), as the pool holds them."""
    assert sched.prefix is not None
    m = sched.prefix.tree.match_prefix(prefix)
    assert m.length == len(prefix), "not cached"
    return [np.array(a.astype(mx.float32)) for a in sched.pool.read_tokens(m.slots)]


def _systems(seed: int, n: int, length: int = 600) -> list[list[int]]:
    rng = random.Random(seed)
    return [random_prompt(rng, length) for _ in range(n)]


def test_a_restarted_engine_reads_the_prefix_from_disk_and_answers_the_same(llama, tmp_path):
    """An agent's system prompt served once; a new engine on the same folder (a restart) takes
    its whole blocks from disk for the next prompt sharing it: counted as cached tokens, and
    the answer is mlx-lm's token for token."""
    system = _systems(0, 1, 700)[0]
    rng = random.Random(1)
    first, second = system + random_prompt(rng, 20), system + random_prompt(rng, 40)
    before = _engine(llama, tmp_path)
    out = _serve(before, {"a": first})["a"]
    assert tokens(out) == reference_greedy(llama, first, 6)
    assert before.stats()["kv_disk_queued_blocks"] == 0, "blocks still locked after a settle"
    _stopped(before)
    spent = before.stats()
    assert spent["kv_disk_flushes"] >= 1 and spent["kv_disk_load_s"] == 0, spent
    assert spent["kv_disk_flush_s"] > 0 and spent["kv_disk_copy_s"] > 0, spent
    assert len(list(tmp_path.rglob("*.kv"))) == (700 + 20 + 5) // B  # NOTE: whole blocks
    shared = 700 // B * B  # NOTE: the next prompt's blocks: the system prompt's whole ones
    written = _kv(before, system[:shared])

    after = _engine(llama, tmp_path)
    out = _serve(after, {"b": second})["b"]
    assert tokens(out) == reference_greedy(llama, second, 6)
    assert out[-1].cached_tokens == shared
    for a, b in zip(written, _kv(after, system[:shared]), strict=True):
        assert np.array_equal(a, b), "the KV read back is not the KV written"
    stats = after.stats()
    assert stats["kv_disk_hit_tokens"] == shared and stats["kv_disk_skipped_files"] == 0
    assert stats["kv_disk_load_s"] > 0, "the load into pages went uncounted"
    _stopped(after)


def test_a_draft_model_speculates_on_a_prefix_read_from_disk(llama, tmp_path):
    """`--spec draft` with the disk tier: after a restart the prefix comes from disk (target
    KV only: the draft computes its own KV for a row's whole context when the row first
    speculates), and the draft, the model itself here, still has every proposal accepted:
    its KV over the loaded blocks is right, and the answer is mlx-lm's."""
    system = _systems(4, 1, 600)[0]
    rng = random.Random(5)
    first, second = system + random_prompt(rng, 12), system + random_prompt(rng, 30)
    spec = dict(spec="draft", draft_model="(in memory)", spec_k=4, draft=llama)
    before = _engine(llama, tmp_path, **spec)
    assert tokens(_serve(before, {"a": first}, 12)["a"]) == reference_greedy(llama, first, 12)
    _stopped(before)
    after = _engine(llama, tmp_path, **spec)
    out = _serve(after, {"b": second}, 12)["b"]
    assert tokens(out) == reference_greedy(llama, second, 12)
    stats = after.stats()
    assert out[-1].cached_tokens == 600 // B * B == stats["kv_disk_hit_tokens"]
    assert stats["spec_draft_caught_up_tokens"] >= len(second)
    assert 0 < stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"], stats
    _stopped(after)


def test_a_prefix_partly_in_memory_continues_from_disk(llama, tmp_path):
    """Memory holds a prompt's first 300 tokens (blocks and a part), the disk the blocks after:
    the next prompt sharing them takes both, the loaded blocks joining the tree after the
    cached part."""
    system = _systems(2, 1, 1100)[0]
    rng = random.Random(3)
    writer = _engine(llama, tmp_path)
    _serve(writer, {"w": system + random_prompt(rng, 10)})
    _stopped(writer)
    reader = _engine(llama, tmp_path)
    _serve(reader, {"short": system[:300]})
    first = 299 // B * B  # NOTE: its whole blocks, from disk
    assert reader.stats()["kv_disk_hit_tokens"] == first
    prompt = system + random_prompt(rng, 30)
    out = _serve(reader, {"long": prompt})["long"]
    assert tokens(out) == reference_greedy(llama, prompt, 6)
    assert out[-1].cached_tokens == 1100 // B * B
    assert reader.stats()["kv_disk_hit_tokens"] == first + 1100 // B * B - 300
    _stopped(reader)


def _plant(folder: Path, rng: random.Random) -> dict[str, int]:
    """Every way a block file can be wrong, one per file found, and 100 junk files beside."""
    files = sorted(folder.rglob("*.kv"))
    kinds = ["truncate", "flip", "header", "foreign", "empty", "garbage"]
    planted: dict[str, int] = {}
    for i, path in enumerate(files):
        kind = kinds[i % len(kinds)]
        data = bytearray(path.read_bytes())
        if kind == "truncate":
            data = data[: rng.randrange(1, len(data))]
        elif kind == "flip":
            data[rng.randrange(len(data) // 2, len(data) - 40)] ^= 0x5A
        elif kind == "header":
            data[20] ^= 0x01
        elif kind == "foreign":  # NOTE: a whole, checked block, of another prefix
            data = bytearray(files[(i + 1) % len(files)].read_bytes())
        elif kind == "empty":
            data = bytearray()
        else:
            data = bytearray(rng.randbytes(len(data)))
        path.write_bytes(bytes(data))
        planted[kind] = planted.get(kind, 0) + 1
    sub = files[0].parent
    for i in range(100):
        junk = rng.randbytes(rng.randrange(0, 4096))
        (sub / f"{rng.randbytes(16).hex()}.kv").write_bytes(junk)
        (sub / f".x{i}.kv.123.abcd.tmp").write_bytes(junk)  # NOTE: a writer killed mid-write
    return planted


def test_corrupt_truncated_foreign_and_half_written_files_are_skipped(llama, tmp_path):
    """100 block files, each damaged one way (truncated, a flipped bit in KV or header, another
    block's file under its name, empty, random bytes), and 100 junk files and 100 temporary ones
    beside: the next engine skips every damaged block it is asked for with a log line, computes
    instead, and answers exactly what a cache-less engine does."""
    rng = random.Random(5)
    systems = [random_prompt(rng, B + 6) for _ in range(100)]
    writer = _engine(llama, tmp_path)
    _serve(writer, {f"p{i}": s + random_prompt(rng, 3) for i, s in enumerate(systems)}, n=2)
    _stopped(writer)
    assert len(list(tmp_path.rglob("*.kv"))) == 100  # NOTE: one whole block each
    planted = _plant(tmp_path, random.Random(6))
    assert sum(planted.values()) == 100 and len(planted) == 6

    reader = _engine(llama, tmp_path)
    again = {f"q{i}": s + random_prompt(rng, 4) for i, s in enumerate(systems)}
    outs = _serve(reader, again, n=4)
    for rid, prompt in again.items():
        assert tokens(outs[rid]) == reference_greedy(llama, prompt, 4), rid
        assert outs[rid][-1].cached_tokens == 0
    stats = reader.stats()
    assert stats["kv_disk_hit_tokens"] == 0 and stats["kv_disk_skipped_files"] == 100
    assert_pages_balanced(reader)
    _stopped(reader)


def test_another_model_never_reads_these_blocks(llama, tmp_path, tmp_path_factory):
    """Random weights of the same shape (same files, names and sizes) are another model: its
    engine on the same folder finds nothing, and writes beside, not over."""
    other_dir = make_random_model(tmp_path_factory.mktemp("other-llama"), TINY_LLAMA, seed=1)
    other = tiny_model(other_dir)
    assert fingerprint(other) != fingerprint(llama)
    prompt = _systems(7, 1)[0] + [1, 2, 3]
    first = _engine(llama, tmp_path)
    _serve(first, {"a": prompt})
    _stopped(first)
    second = _engine(other, tmp_path)
    out = _serve(second, {"b": prompt})["b"]
    assert tokens(out) == reference_greedy(other, prompt, 6)
    assert out[-1].cached_tokens == 0
    _stopped(second)
    assert len({p.parent for p in tmp_path.rglob("*.kv")}) == 2


def test_flush_cache_clears_the_disk_too(llama, tmp_path):
    sched = _engine(llama, tmp_path)
    _serve(sched, {"a": _systems(8, 1)[0]})
    sched.shutdown()  # NOTE: writes finished; the folder is then the engine's to flush
    assert list(tmp_path.rglob("*.kv"))
    sched.kv.flush()
    assert not list(tmp_path.rglob("*.kv"))
    assert sched.stats()["kv_disk_files"] == 0


def test_a_model_change_keys_blocks_by_the_new_model(llama, tmp_path, tmp_path_factory):
    """After a weight swap (admin.py calls `model_changed`), blocks are keyed by the new
    weights: the old model's blocks are not read."""
    sched = _engine(llama, tmp_path)
    prompt = _systems(9, 1)[0] + [5, 6]
    _serve(sched, {"a": prompt})
    old = sched.kv.disk.cache.folder
    other_dir = make_random_model(tmp_path_factory.mktemp("swap"), TINY_LLAMA, seed=2)
    sched.runner.model = tiny_model(other_dir)
    sched.model_changed()
    sched.kv.flush(disk=False)
    assert sched.kv.disk.cache.folder != old and list(old.glob("*.kv"))
    out = _serve(sched, {"b": prompt})["b"]
    assert out[-1].cached_tokens == 0
    sched.shutdown()


# -- the file format and the folder ----------------------------------------------------------------
FMT = BlockFormat(4, (("bfloat16", (2, 4, 3)), ("float32", (2, 4, 3))))


def _arrays(seed: int) -> list[np.ndarray]:
    r = np.random.default_rng(seed)
    return [r.integers(0, 2**16, (2, 4, 3), dtype=np.uint16), r.random((2, 4, 3), np.float32)]


def _header(key: str) -> dict:
    arrays = [["bfloat16", [2, 4, 3]], ["float32", [2, 4, 3]]]
    return {"identity": "m", "key": key, "tokens": [1, 2, 3, 4], "arrays": arrays}


def test_a_block_file_reads_back_exactly_and_refuses_any_cut(tmp_path):
    path = tmp_path / "b.kv"
    arrays = _arrays(0)
    size = kv_files.dump(path, _header("k"), arrays, ["bfloat16", "float32"])
    assert size == path.stat().st_size
    back = kv_files.load(path, _header("k"), 1 << 20)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, back, strict=True))
    assert back[0].dtype == np.uint16
    data = path.read_bytes()
    for cut in range(0, len(data), 7):
        path.write_bytes(data[:cut])
        with pytest.raises(kv_files.KVFileError):
            kv_files.load(path, _header("k"), 1 << 20)
    path.write_bytes(data)
    with pytest.raises(kv_files.KVFileError, match="key"):
        kv_files.load(path, _header("other"), 1 << 20)
    with pytest.raises(kv_files.KVFileError, match="larger"):
        kv_files.load(path, _header("k"), 100)
    assert not list(tmp_path.glob("*.tmp")), "a temporary file stayed behind"


def test_the_folder_keeps_its_budget_least_recently_used_first(tmp_path):
    tokens = list(range(10, 50))

    def write(cache: DiskCache, keys: list[bytes], k: int) -> None:
        cache.store(tokens, keys, {k: lambda: _arrays(k)})
        cache._writer.submit(lambda: None).result()  # NOTE: one writer thread: in order
        time.sleep(0.01)

    probe = DiskCache(tmp_path / "probe", 1 << 20, FMT, "m")
    write(probe, probe.keys(tokens, 1), 0)
    size = probe.bytes
    probe.close()
    cache = DiskCache(tmp_path / "c", 3 * size + 10, FMT, "m")
    keys = cache.keys(tokens, 10)
    for k in range(5):
        write(cache, keys, k)
    assert cache.stats()["kv_disk_files"] == 3 and cache.bytes <= cache.capacity
    assert cache.evicted_files == 2
    assert [cache.has(key) for key in keys[:5]] == [False, False, True, True, True]
    assert len(cache.load(tokens, keys, 2, 1).result().blocks) == 1  # NOTE: now the newest
    cache.close()
    later = DiskCache(tmp_path / "c", 2 * size + 10, FMT, "m")  # NOTE: restarted, less room
    assert [later.has(key) for key in keys[:5]] == [False, False, True, False, True]
    later.close()


def test_a_load_joins_each_array_across_its_blocks_up_to_the_first_bad_one(tmp_path):
    """What a load hands the step's thread is one array a layer's K or V holding every block's
    tokens in order (the readers copied them into place), ending where a damaged file ends
    the load: the blocks after it are not there, even though they were read."""
    tokens = list(range(10, 50))
    cache = DiskCache(tmp_path, 1 << 20, FMT, "m")
    keys = cache.keys(tokens, 5)
    cache.store(tokens, keys, {k: (lambda k=k: _arrays(k)) for k in range(5)})
    cache._writer.submit(lambda: None).result()
    whole = cache.load(tokens, keys, 1, 4).result()
    for i, joined in enumerate(whole.joined):
        assert joined.shape == (2, 16, 3)
        want = np.concatenate([_arrays(k)[i] for k in range(1, 5)], axis=1)
        assert np.array_equal(joined, want)
    damaged = cache._path(keys[3])
    damaged.write_bytes(damaged.read_bytes()[:-7])
    cut = cache.load(tokens, keys, 1, 4).result()
    assert len(cut.blocks) == 2 and [a.shape[1] for a in cut.joined] == [8, 8]
    for i, joined in enumerate(cut.joined):
        assert np.array_equal(joined, whole.joined[i][:, :8])
    cache.close()


def test_a_snapshot_file_is_found_by_its_anchor_after_a_restart_and_read_back(tmp_path):
    """A slot's snapshot (its tail's K/V and the slot's arrays) hangs from the key of the last
    whole block before it: indexed there when written and when the folder is scanned at start,
    read back exactly, and gone from the index with its file."""
    fmt = BlockFormat(4, FMT.arrays, (("float32", (1, 5)),))
    tokens = list(range(10, 50))
    r = np.random.default_rng(0)
    arrays = [
        r.integers(0, 2**16, (2, 2, 3), dtype=np.uint16),
        r.random((2, 2, 3), np.float32),
        r.random((1, 5), np.float32),
    ]
    cache = DiskCache(tmp_path, 1 << 20, fmt, "m")
    keys = cache.keys(tokens, 2)
    anchor = cache.anchor(keys, 10)  # NOTE: 10 tokens: two whole blocks of 4, a tail of 2
    assert anchor == keys[1]
    cache.store_snapshot(tokens, 10, anchor, lambda: arrays)
    cache.close()
    later = DiskCache(tmp_path, 1 << 20, fmt, "m")
    key = later.snapshot_key(tokens, 10, anchor)
    assert later.snapshots(anchor) == [(10, key)]
    assert later.snapshots(later.anchor(keys, 3)) == [], "another anchor holds nothing"
    loaded = later.load(tokens, keys, 0, 2, snapshot=10).result()
    assert loaded.blocks == [] and loaded.snapshot is None, "no block: the snapshot is not read"
    later.store(tokens, keys, {0: lambda: _arrays(0), 1: lambda: _arrays(1)})
    later._writer.submit(lambda: None).result()
    loaded = later.load(tokens, keys, 0, 2, snapshot=10).result()
    assert loaded.snapshot is not None
    for a, b in zip(arrays, loaded.snapshot, strict=True):
        assert np.array_equal(a, b)
    assert later.clear() == 3 and later.snapshots(anchor) == []
    later.close()


def test_a_dead_writers_temporary_files_go_at_start_and_a_live_ones_stay(tmp_path):
    sub = tmp_path / "x"
    sub.mkdir()
    old, new = sub / ".a.kv.1.ab.tmp", sub / ".b.kv.2.cd.tmp"
    old.write_bytes(b"partial")
    new.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    DiskCache(tmp_path, 1 << 20, FMT, "m").close()
    assert not old.exists() and new.exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"disable_radix_cache": True}, "radix cache"),
        ({"kv_cache_disk_gb": 0}, "kv_cache_disk_gb"),
        ({"tp": 2}, "tensor parallel"),
    ],
)
def test_options_that_cannot_go_with_a_disk_tier_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_cache_dir=str(tmp_path), **overrides).validate()


def test_a_folder_that_cannot_be_made_is_refused_before_the_model_loads(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_cache_dir"):
        EngineConfig(kv_cache_dir=str(blocker / "sub")).validate()


# -- as users run it -------------------------------------------------------------------------------
WORDS = "the agent reads a file then edits a line and runs the tests again".split()


def _metric(engine: LaunchedEngine, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(engine.http + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _complete(engine: LaunchedEngine, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, reply = post_json(engine, "/v1/completions", body)
    assert status == 200, reply
    return reply


def test_the_cache_survives_kill_9_and_a_restart(tiny_model_dir, tmp_path):
    """`mlx-engine launch --kv-cache-dir`: a long system prompt served, the whole engine killed
    with SIGKILL once its blocks are written, started again on the folder: the next request
    sharing the prompt reports the blocks as cached tokens, /metrics as disk hits."""
    rng = random.Random(0)
    system = " ".join(rng.choice(WORDS) for _ in range(700))
    folder = tmp_path / "kv"
    args = ("--kv-cache-dir", str(folder), "--warmup", "off")
    first = LaunchedEngine(tiny_model_dir, tmp_path / "1.log", *args).wait_ready()
    try:
        reply = _complete(first, system + " first question")
        blocks = reply["usage"]["prompt_tokens"] // B
        assert blocks * B > 512
        deadline = time.monotonic() + 30
        while _metric(first, "mlx_engine_kv_disk_files") < blocks:
            assert time.monotonic() < deadline, "no block written"
            time.sleep(0.1)
    finally:
        first.stop()  # NOTE: SIGKILL to the whole process group
    second = LaunchedEngine(tiny_model_dir, tmp_path / "2.log", *args).wait_ready()
    try:
        reply = _complete(second, system + " another question")
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
        assert _metric(second, "mlx_engine_kv_disk_hit_tokens_total") >= 512
        assert _metric(second, "mlx_engine_kv_disk_skipped_files_total") == 0
    finally:
        second.stop()


@pytest.fixture(scope="module", params=["gemma3_text", "qwen3_next"])
def slotted(request, tmp_path_factory):
    """A windowed model (rings of 16 tokens beside full layers) and a hybrid one (recurrent
    state beside full layers): a hit needs the slot's snapshot, not pages alone."""
    from engine.random_model import TINY_FAMILIES

    folder = tmp_path_factory.mktemp(request.param)
    return tiny_model(make_random_model(folder, TINY_FAMILIES[request.param]))


def _snapshot(sched: Scheduler, prefix: list[int]) -> list[np.ndarray]:
    """The slot's snapshot at `prefix` the engine keeps in memory."""
    assert sched.kv.snapshots is not None
    arrays = sched.kv.snapshots.get(prefix)
    assert arrays is not None, "no snapshot"
    return [np.array(a.astype(mx.float32)) for a in arrays]


def test_a_snapshot_at_a_blocks_end_goes_to_disk_and_back(slotted, tmp_path):
    """A snapshot taken where a block ends has no tokens after the block (its K/V tail is
    empty): it is written all the same, and after a restart a prompt sharing that prefix hits
    there. (An empty tail once failed the write, and such a prefix was computed again.)"""
    rng = random.Random(17)
    first = random_prompt(rng, 2 * B + 1)  # NOTE: its body, all but the last token: 2 blocks
    before = _engine(slotted, tmp_path)
    _serve(before, {"a": first})
    _stopped(before)
    assert any(f"+{2 * B}+" in f.name for f in tmp_path.rglob("*.kv")), "no snapshot at 2B"
    taken = _snapshot(before, first[:-1])
    # NOTE: the same with its blocks on disk already: the snapshot alone is written
    for f in tmp_path.rglob(f"*+{2 * B}+*.kv"):
        f.unlink()
    again = _engine(slotted, tmp_path)
    _serve(again, {"a": first})
    _stopped(again)
    assert any(f"+{2 * B}+" in f.name for f in tmp_path.rglob("*.kv")), "not written again"

    other = first[:-1] + random_prompt(rng, 7)
    alone = make_scheduler(slotted, page_size=PAGE, disable_radix_cache=True)
    want = tokens(_serve(alone, {"other": other})["other"])
    after = _engine(slotted, tmp_path)
    got = _serve(after, {"other": other})["other"]
    assert tokens(got) == want and got[-1].cached_tokens == 2 * B
    for a, b in zip(taken, _snapshot(after, first[:-1]), strict=True):
        assert np.array_equal(a, b), "the slot read back is not the slot written"
    _stopped(after)


def test_a_restart_reads_a_slots_snapshot_with_the_blocks_before_it(slotted, tmp_path):
    """An agent's turn served, the engine restarted on the same folder: the next turn (the
    last prompt, the reply and a new message) loads the blocks and the snapshot taken when the
    turn finished, a prompt sharing only the first turn's prompt the snapshot taken when it was
    cached; each a hit there, answering as an engine without any cache."""
    rng = random.Random(11)
    first = random_prompt(rng, 150)
    before = _engine(slotted, tmp_path)
    reply = tokens(_serve(before, {"a": first})["a"])
    assert before.stats()["kv_disk_queued_blocks"] == 0
    _stopped(before)
    snaps = [f for f in tmp_path.rglob("*.kv") if "+" in f.name]
    assert len(snaps) == 2, "a snapshot at the prompt's body and one at the turn's end"
    taken = _snapshot(before, first + reply[:-1])

    turn = first + reply + random_prompt(rng, 12)
    other = first[:-1] + random_prompt(rng, 9)
    alone = make_scheduler(slotted, page_size=PAGE, disable_radix_cache=True)
    want = {rid: tokens(o) for rid, o in _serve(alone, {"turn": turn, "other": other}).items()}
    after = _engine(slotted, tmp_path)
    got = _serve(after, {"turn": turn})["turn"]
    assert tokens(got) == want["turn"]
    assert got[-1].cached_tokens == len(first) + len(reply) - 1  # NOTE: the last reply token
    for a, b in zip(taken, _snapshot(after, first + reply[:-1]), strict=True):
        assert np.array_equal(a, b), "the slot read back is not the slot written"
    got = _serve(after, {"other": other})["other"]
    assert tokens(got) == want["other"]
    assert got[-1].cached_tokens == len(first) - 1
    stats = after.stats()
    assert stats["kv_disk_hit_tokens"] == len(first) + len(reply) - 1
    assert stats["kv_disk_skipped_files"] == 0
    _stopped(after)


def test_a_slots_snapshot_that_is_damaged_is_skipped_and_the_prompt_computed(slotted, tmp_path):
    """A snapshot file cut short: skipped with its count, no hit, the answer unchanged."""
    rng = random.Random(12)
    first = random_prompt(rng, 150)
    before = _engine(slotted, tmp_path)
    reply = tokens(_serve(before, {"a": first})["a"])
    _stopped(before)
    for f in tmp_path.rglob("*.kv"):
        if "+" in f.name:
            f.write_bytes(f.read_bytes()[:-7])
    turn = first + reply + random_prompt(rng, 12)
    alone = make_scheduler(slotted, page_size=PAGE, disable_radix_cache=True)
    want = tokens(_serve(alone, {"turn": turn})["turn"])
    after = _engine(slotted, tmp_path)
    got = _serve(after, {"turn": turn})["turn"]
    assert tokens(got) == want and got[-1].cached_tokens == 0
    assert after.stats()["kv_disk_skipped_files"] == 1  # NOTE: the longest; the load stops there
    _stopped(after)


def test_a_second_conversation_hits_at_the_system_prompts_snapshot(slotted, tmp_path):
    """`shared` (the front door's count of a chat's system-prompt tokens): the first
    conversation snapshots its slot there, so the next one under that system prompt hits there,
    in memory and after a restart from disk; without it the second computed everything."""
    rng = random.Random(13)
    system = random_prompt(rng, 130)
    asks = {f"c{i}": system + random_prompt(rng, 10 + i) for i in range(3)}
    alone = make_scheduler(slotted, page_size=PAGE, disable_radix_cache=True)
    want = {rid: tokens(o) for rid, o in _serve(alone, asks).items()}

    def ask(sched: Scheduler, rid: str, shared: int) -> list:
        sched.submit(rid, asks[rid], greedy(6), shared=shared)
        outs: list = []
        while sched.has_work():
            outs += [c for c in sched.step() if c.rid == rid]
        assert tokens(outs) == want[rid]
        return outs

    blind = _engine(slotted, tmp_path / "blind")
    ask(blind, "c0", 0)
    assert ask(blind, "c1", 0)[-1].cached_tokens == 0, "no snapshot where they part"
    _stopped(blind)
    before = _engine(slotted, tmp_path / "kv")
    ask(before, "c0", len(system))
    assert ask(before, "c1", len(system))[-1].cached_tokens == len(system)
    _stopped(before)
    after = _engine(slotted, tmp_path / "kv")
    assert ask(after, "c2", len(system))[-1].cached_tokens == len(system)
    assert after.stats()["kv_disk_hit_tokens"] == len(system)
    _stopped(after)


def test_the_front_door_tells_a_slotted_model_where_the_system_prompt_ends(
    default_model_dir, tmp_path
):
    """Launched, a hybrid model with the default tokenizer: the second chat under the same
    system prompt reports the system prompt's tokens as cached, the third after `kill -9` and
    a restart too (from disk)."""
    from engine.random_model import TINY_FAMILIES

    model = make_random_model(
        tmp_path / "m", TINY_FAMILIES["qwen3_next"], tokenizer_from=default_model_dir
    )
    rng = random.Random(1)
    system = " ".join(rng.choice(WORDS) for _ in range(300))
    args = ("--kv-cache-dir", str(tmp_path / "kv"), "--warmup", "off")

    def chat(engine: LaunchedEngine, question: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"messages": messages, "max_tokens": 4, "temperature": 0}
        status, reply = post_json(engine, "/v1/chat/completions", body)
        assert status == 200, reply
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = LaunchedEngine(model, tmp_path / "1.log", *args).wait_ready()
    try:
        assert chat(first, "first question") == 0
        assert chat(first, "another one") > 300
        deadline = time.monotonic() + 30
        while _metric(first, "mlx_engine_kv_disk_files") < 3:
            assert time.monotonic() < deadline, "nothing written"
            time.sleep(0.1)
    finally:
        first.stop()
    second = LaunchedEngine(model, tmp_path / "2.log", *args).wait_ready()
    try:
        assert chat(second, "a third") > 300
    finally:
        second.stop()


def test_a_burst_after_a_restart_reads_the_shared_system_prompt_once(llama, tmp_path):
    """Eight requests arriving together on a restarted engine, one system prompt on disk: one
    of them loads its blocks, the others wait for them and hit them in memory (each read
    them, 8x the bytes, before); every answer is mlx-lm's."""
    system = _systems(7, 1, 700)[0]
    rng = random.Random(8)
    writer = _engine(llama, tmp_path)
    _serve(writer, {"w": system + random_prompt(rng, 5)})
    _stopped(writer)
    burst = {f"b{i}": system + random_prompt(rng, 6 + i) for i in range(8)}
    after = _engine(llama, tmp_path)
    outs = _serve(after, burst)
    for rid, prompt in burst.items():
        assert tokens(outs[rid]) == reference_greedy(llama, prompt, 6)
        assert outs[rid][-1].cached_tokens >= 700 // B * B
    stats = after.stats()
    blocks = 700 // B
    assert stats["kv_disk_read_bytes"] == blocks * after.kv.disk.cache.fmt.nbytes
    assert stats["kv_disk_hit_tokens"] == blocks * B
    _stopped(after)


class _WatchedNumpy:
    """numpy, with the threads that bring MLX arrays to the host written down."""

    def __init__(self, seen: list[str]) -> None:
        self._seen = seen

    def __getattr__(self, name: str):
        real = getattr(np, name)
        if name not in ("array", "asarray"):
            return real

        def to_host(a, *args, **kwargs):
            if isinstance(a, mx.array):
                self._seen.append(threading.current_thread().name)
            return real(a, *args, **kwargs)

        return to_host


def test_kv_reaches_the_host_on_the_writers_thread_never_the_steps(llama, tmp_path, monkeypatch):
    """On CUDA bringing an array to the host is a synchronous copy that steps in flight wait
    behind (made on the step's thread, 128 agents ran at 0.68x with the disk tier on): the
    blocks gathered for disk are copied to the host by the writer, and read back exactly."""
    seen: list[str] = []
    monkeypatch.setattr(disk_tier, "np", _WatchedNumpy(seen))
    system = _systems(11, 1, 300)[0]
    sched = _engine(llama, tmp_path)
    out = _serve(sched, {"a": system})["a"]
    assert tokens(out) == reference_greedy(llama, system, 6)
    _stopped(sched)
    assert seen and all(name.startswith("kv-disk-write") for name in seen), seen
    after = _engine(llama, tmp_path)
    prompt = system + random_prompt(random.Random(12), 9)
    out = _serve(after, {"b": prompt})["b"]
    assert tokens(out) == reference_greedy(llama, prompt, 6)
    assert out[-1].cached_tokens == 300 // B * B
    _stopped(after)


def test_flushes_wait_their_turn_while_requests_run_and_drain_when_idle(
    llama, tmp_path, monkeypatch
):
    """While requests run, flushes take a bounded share of the time (`FLUSH_SHARE`): what the
    pace holds back stays queued until the engine is idle, and then every block is written,
    one flush after another (`FLUSH_BYTES`), without a request to drive the steps."""
    monkeypatch.setattr(disk_tier, "FLUSH_SHARE", 1e-9)  # NOTE: one flush, then a long pause
    monkeypatch.setattr(disk_tier, "FLUSH_BYTES", 1)  # NOTE: one queued job a flush
    rng = random.Random(13)
    prompts = {f"s{i}": random_prompt(rng, 2 * B + 5) for i in range(3)}
    sched = _engine(llama, tmp_path, disable_overlap=True)  # NOTE: a settle every step
    sched.submit("long", random_prompt(rng, 20), greedy(80))
    for rid, prompt in prompts.items():
        sched.submit(rid, prompt, greedy(2))
    done: set[str] = set()
    for _ in range(12):
        done |= {c.rid for c in sched.step() if c.finish_reason is not None}
    assert done == set(prompts), "the short requests finish first"
    assert sched.stats()["kv_disk_queued_blocks"] > 0, "flushed at every break while busy"
    while sched.has_work():
        sched.step()
    assert sched.stats()["kv_disk_queued_blocks"] == 0, "queued blocks left behind when idle"
    sched.kv.disk.cache.close()
    assert len(list(tmp_path.rglob("*.kv"))) == 3 * 2 + (20 + 80) // B
    _stopped(sched)
