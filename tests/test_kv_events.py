"""KV events (`--kv-events-endpoint`): a subscriber rebuilds the engine's cached blocks from the
events alone (tests/kv_subscriber.py, written from vLLM's wire format) and must hold exactly the
blocks of the engine's radix cache.

- the log over a bare radix tree, randomised: inserts that split nodes, locks, evictions and
  flushes, each batch through the wire in both layouts, compared after every step;
- a launched engine with a small KV pool: a mixed workload (shared prefixes, distinct prompts,
  evictions), then a flush, checked against the engine's own cache (`get_cached_blocks`); the
  replay socket returns batches a late subscriber missed.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgspec
import pytest
from engine_harness import LaunchedEngine
from kv_subscriber import Rebuilt, Subscription, block_hash, catch_up

from engine.kv_events import EventBatch, Stored, chain_hashes, wire_events
from scheduler_proc.kv_event_log import KVEventLog, cached_hashes
from scheduler_proc.radix_cache import RadixCache

PAGE = 4


class WireSink:
    """The publisher's encoding without its sockets: each batch encoded, decoded by the
    subscriber's own structs and applied."""

    def __init__(self, layout: str) -> None:
        self.layout, self.rebuilt = layout, Rebuilt()
        self.encoder = msgspec.msgpack.Encoder()
        from kv_subscriber import DECODERS

        self.decode = DECODERS[layout].decode
        self.accept = True

    def __call__(self, seq: int, events: list) -> bool:
        if not self.accept:
            return False
        payload = self.encoder.encode(EventBatch(1.0, wire_events(events, self.layout, PAGE), 0))
        self.rebuilt.apply(seq, self.decode(payload))
        return True


def _flush(tree: RadixCache) -> None:
    """`PrefixCache.flush` over the bare tree."""
    while tree.evict(tree.total_tokens):
        pass
    if tree.observer is not None:
        tree.observer.flushed()


@pytest.mark.parametrize("layout", ["array", "map"])
def test_rebuilt_blocks_follow_the_tree_through_random_steps(layout: str) -> None:
    rng = random.Random(7)
    tree = RadixCache()
    sink = WireSink(layout)
    log = KVEventLog(tree, PAGE, sink)
    slots = iter(range(10**9))
    locks = []
    for step in range(3000):
        op = rng.random()
        if op < 0.5:
            # NOTE: a small alphabet and shared stems: inserts that split nodes mid-page
            stem = [rng.randrange(3) for _ in range(rng.choice([0, 3, 5, 8]))]
            tokens = stem + [rng.randrange(3) for _ in range(rng.randint(1, 14))]
            tree.insert(tokens, [next(slots) for _ in tokens])
        elif op < 0.65:
            tokens = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
            m = tree.match_prefix(tokens)  # NOTE: splits too
            if m.length and len(locks) < 4:
                tree.lock(m.node)
                locks.append(m.node)
        elif op < 0.75 and locks:
            tree.unlock(locks.pop(rng.randrange(len(locks))))
        elif op < 0.97:
            tree.evict(rng.randint(1, 20))
        else:
            _flush(tree)
        log.publish()
        assert sink.rebuilt.hashes() == cached_hashes(tree, PAGE), f"step {step}"
    assert sink.rebuilt.events > 1000


def test_a_flush_that_empties_the_cache_is_one_clear() -> None:
    tree = RadixCache()
    sink = WireSink("array")
    log = KVEventLog(tree, PAGE, sink)
    log.publish()  # NOTE: the first batch clears (a restarted engine's subscribers start over)
    tree.insert(list(range(9)), list(range(9)))
    log.publish()
    assert len(sink.rebuilt.blocks) == 2
    _flush(tree)
    assert [type(e).__name__ for e in log._pending] == ["Cleared"]
    log.publish()
    assert sink.rebuilt.hashes() == [] and sink.rebuilt.seq == 2


def test_a_dropped_batch_is_made_good_by_a_resync() -> None:
    """The publisher's queue full: the next batch clears and stores every cached block."""
    tree = RadixCache()
    sink = WireSink("array")
    log = KVEventLog(tree, PAGE, sink)
    tree.insert(list(range(9)), list(range(9)))
    log.publish()
    sink.accept = False
    tree.insert([0, 1, 2, 3, 7, 7, 7, 7], list(range(100, 108)))
    log.publish()  # NOTE: dropped: the subscriber would see a gap in the sequence
    sink.accept = True
    assert log.dropped == 1
    sink.rebuilt.seq += 1  # NOTE: the gap, as a subscriber would skip it
    log.publish()
    assert sink.rebuilt.hashes() == cached_hashes(tree, PAGE) and len(sink.rebuilt.blocks) == 3


def test_block_hashes_are_the_documented_chain() -> None:
    tokens = [5, 1, 150_000, 2, 9, 9, 9, 9, 3]
    hashes = chain_hashes(None, tokens, PAGE)
    assert len(hashes) == 2
    assert hashes[0] == block_hash(None, tokens[:4])
    assert hashes[1] == block_hash(hashes[0], tokens[4:8])
    assert chain_hashes(hashes[0], tokens[4:8], PAGE) == hashes[1:]


def test_the_replay_socket_answers_a_long_request_in_parts() -> None:
    """600 batches from 0, sent while the publisher's loop goes on (256 frames an iteration),
    in order, then the end marker; a start past the last batch gets the marker alone."""
    from engine_harness import free_port

    from scheduler_proc.kv_publisher import REPLAY_FRAMES, KVEventPublisher

    sub = Subscription("map").start()
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventPublisher(sub.endpoint, replay, "", "map", PAGE)
    try:
        for seq in range(600):
            assert pub.put(
                seq, [Stored(chain_hashes(None, [seq] * PAGE, PAGE), None, [seq] * PAGE)]
            )
        got: list = []
        asker = threading.Thread(target=lambda: got.extend(sub.replay(replay, 0)))
        asker.start()
        iterations = 0
        while asker.is_alive():
            pub.serve_replays()
            iterations += 1
            time.sleep(0.001)
        assert [n for n, _ in got] == list(range(600))
        assert got[7][1].events[0].token_ids == [7] * PAGE
        assert iterations >= 600 // REPLAY_FRAMES
        late = threading.Thread(target=lambda: got.append(sub.replay(replay, 600)))
        late.start()
        while late.is_alive():
            pub.serve_replays()
            time.sleep(0.001)
        assert got[-1] == []
    finally:
        pub.close()
        sub.close()


# -- a launched engine --------------------------------------------------------------------------
SYSTEMS = 3
# NOTE: a small pool (64 pages of 16 tokens) under prompts of 100-300 tokens: evictions happen.
LAUNCH = ("--max-total-tokens", "1024", "--page-size", "16", "--max-running-requests", "4")


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Shared system prompts with distinct tails, repeated conversations, and loners."""
    systems = [
        [rng.randrange(1000, 20000) for _ in range(rng.randint(40, 120))] for _ in range(SYSTEMS)
    ]
    seen: list[list[int]] = []
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            p = rng.choice(systems) + [
                rng.randrange(1000, 20000) for _ in range(rng.randint(5, 80))
            ]
        elif kind < 0.75 and seen:
            p = rng.choice(seen) + [rng.randrange(1000, 20000) for _ in range(rng.randint(1, 30))]
        else:
            p = [rng.randrange(1000, 20000) for _ in range(rng.randint(20, 250))]
        seen.append(p)
        out.append(p)
    return out


def _run(client, prompts: list[list[int]], concurrency: int = 4) -> None:
    todo = list(prompts)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            try:
                client.generate(input_ids=p, max_tokens=8, temperature=0.0, ignore_eos=True)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.fixture(scope="module")
def subscribed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """An engine connecting its PUB socket to this test's bound SUB socket, replay on."""
    from engine_harness import free_port

    sub = Subscription("array", b"kv")
    endpoint = sub.endpoint
    replay = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path_factory.mktemp("kv-events") / "engine.log"
    args = ["--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay]
    engine = LaunchedEngine(tiny_model_dir, log_path, *LAUNCH, *args, "--kv-events-topic", "kv")
    try:
        sub.start()
        engine.wait_ready()
        yield engine, sub, replay
    finally:
        engine.stop()
        sub.close()


def _check(client, sub: Subscription, rebuilt: Rebuilt, replay: str | None) -> dict:
    got = client.get_cached_blocks()
    catch_up(sub, rebuilt, got["kv_events_seq"], replay, timeout=30.0)
    assert rebuilt.hashes() == got["block_hashes"]
    return got


@pytest.mark.timeout(600)
def test_a_subscriber_rebuilds_the_engines_cache(subscribed) -> None:
    from engine.client import EngineClient

    engine, sub, replay = subscribed
    rebuilt = Rebuilt()
    rng = random.Random(3)
    with EngineClient(engine.address, timeout=60.0) as client:
        # NOTE: the first batches may go out before the PUB socket's connection carries this
        # subscription (ZeroMQ's late joiner): the replay socket fills the gap from batch 0.
        for n in (12, 12, 12):
            _run(client, _prompts(rng, n))
            _check(client, sub, rebuilt, replay)
        stats = client.stats()
        assert stats["prefix_cache_evicted_tokens"] > 0, "no eviction: the pool is too large"
        assert stats["kv_events_dropped"] == 0
        assert client.flush_cache()["flushed_tokens"] > 0
        got = _check(client, sub, rebuilt, replay)
        assert got["block_hashes"] == [] and rebuilt.blocks == {}
        _run(client, _prompts(rng, 8))
        _check(client, sub, rebuilt, replay)


def test_replay_returns_every_buffered_batch(subscribed) -> None:
    """A subscriber that joins late asks for everything from batch 0 and rebuilds the same."""
    from engine.client import EngineClient

    engine, _, replay = subscribed
    late = Subscription("array", b"kv", bind=False)
    try:
        with EngineClient(engine.address, timeout=60.0) as client:
            got = client.get_cached_blocks()
            rebuilt = Rebuilt()
            batches = late.replay(replay, 0)
            assert [n for n, _ in batches] == list(range(len(batches)))
            for n, batch in batches:
                if n <= got["kv_events_seq"]:
                    rebuilt.apply(n, batch)
            assert rebuilt.seq == got["kv_events_seq"]
            assert rebuilt.hashes() == got["block_hashes"]
            assert late.replay(replay, got["kv_events_seq"] + 10**6) == []
    finally:
        late.close()
