"""Rank 0's inbox broadcast (scheduler_proc/broadcast.py) and the group helpers (engine/distributed.py).

The frame protocol runs here on a group of one and on two real ring ranks (subprocesses, each
bounded by a timeout): commands arrive in order one iteration after they are posted, and ranks
whose state differs stop with `Diverged`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest
from scheduler_util import tiny_model

from engine.distributed import Topology, check_shardable, frame_address, read_hostfile, topology
from engine.messages.to_ranks import Exit
from engine.messages.to_scheduler import Abort, TokenizedRequest
from engine.sampling_params import SamplingParams
from scheduler_proc.broadcast import Broadcast


def test_commands_arrive_in_order_one_iteration_later():
    bcast = Broadcast(mx.distributed.init())  # NOTE: no environment: a group of one
    # NOTE: ~5 MB encoded, beyond MAX_PAYLOAD: it goes alone, in a frame of its own size.
    big = TokenizedRequest("big", list(range(1 << 20, 2 << 20)), SamplingParams())
    posted = [Abort("a"), big, Abort("b"), Exit("done")]
    for cmd in posted:
        bcast.post(cmd)
    got: list = []
    for step in range(1, 6):
        bcast.start(step, 1234)
        got.append(bcast.finish())
    # NOTE: frame 1 only announces what frame 2 carries.
    assert got == [[], [posted[0]], [big], posted[2:], []]
    assert not bcast.busy()


TWO_RANKS = textwrap.dedent(
    """
    import json, os, sys, time
    from engine.config import EngineConfig
    from engine.distributed import RankPlan, join_group
    rank, hostfile, frames = int(sys.argv[1]), sys.argv[2], sys.argv[5]
    hosts = (("127.0.0.1:%s" % sys.argv[3],), ("127.0.0.1:%s" % sys.argv[4],))
    plan = RankPlan(rank, hosts, hostfile, "ring", 2, None)
    plan.enter()
    from engine.messages.to_scheduler import Abort, TokenizedRequest
    from engine.sampling_params import SamplingParams
    from scheduler_proc.broadcast import Diverged
    from scheduler_proc.rank import check_same_options, open_channel
    group = join_group(plan)
    bcast = open_channel(EngineConfig(tp_frames=frames), group, plan)
    # NOTE: what rank 0 posts before each step's frame; the ~5 MB prompt is more than a socket
    # buffer holds (the rest of its frame goes after the step).
    big = TokenizedRequest("big", list(range(1 << 20, 2 << 20)), SamplingParams())
    posts = {1: ["a"], 2: ["b", "c"], 4: [big], 5: ["d"]}
    applied = []
    for step in range(1, 8):
        for cmd in posts.get(step, []) if rank == 0 else []:
            bcast.post(Abort(cmd) if isinstance(cmd, str) else cmd)
        bcast.start(step, 7)
        if step == 3 and rank == 0:
            time.sleep(0.3)  # NOTE: a long step on rank 0: rank 1 sends step 4's header early
        applied.append([step, [c.rid for c in bcast.finish()]])
    print("APPLIED", json.dumps(applied), flush=True)
    try:
        # NOTE: the ranks' states differ at step 8; a worker stops there, rank 0 there or (on
        # host links, a worker's header being one step late at most) at the next step.
        for step in (8, 9):
            bcast.start(step, 7 + rank * (step == 8))
            bcast.finish()
    except Diverged as e:
        print("DIVERGED", e, flush=True)
    check_same_options(group, EngineConfig(seed=5))
    try:
        check_same_options(group, EngineConfig(seed=rank))
    except ValueError as e:
        print("OPTIONS", e, flush=True)
    from scheduler_proc.kv_budget import plan_kv
    from scheduler_proc.rank import agree_kv_plan
    tokens = 16384 if rank == 0 else 5632
    kv = EngineConfig(max_total_tokens=tokens, context_length=1024, max_running_requests=8)
    mine = plan_kv(kv, 64, None)
    agreed = agree_kv_plan(group, mine)
    print("KV", mine.pages, agreed.pages, agreed.slots, agreed.context, flush=True)
    if frames == "tcp":
        if rank == 1:
            os._exit(0)  # NOTE: a worker lost between two frames
        t0 = time.monotonic()
        try:
            bcast.start(10, 7)
            bcast.finish()
        except ConnectionError as e:
            print("LOST %.2f" % (time.monotonic() - t0), e, flush=True)
    """
)


@pytest.mark.parametrize("frames", ["tcp", "collective"])
def test_two_ring_ranks_share_the_inbox_agree_on_kv_and_catch_drift(frames: str, tmp_path: Path):
    from engine_harness import free_ports

    # NOTE: and the port above the highest, where rank 0 listens for the frame links
    ports = [str(p) for p in free_ports(3)[:2]]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(f'[["127.0.0.1:{ports[0]}"], ["127.0.0.1:{ports[1]}"]]')
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(r), str(hostfile), *ports, frames],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            p.kill()
    # NOTE: every rank applies each command at the same step: the step it was posted before on
    # host sockets, one later on the collective (its size is announced a frame ahead).
    late = 0 if frames == "tcp" else 1
    want = [[s, []] for s in range(1, 8)]
    for step, rids in {1: ["a"], 2: ["b", "c"], 4: ["big"], 5: ["d"]}.items():
        want[step - 1 + late][1] = rids
    for out in outs:
        assert "APPLIED " + json.dumps(want) in out, out
        assert "DIVERGED rank 1 is at step 8 with state 0x" in out, out
        assert out.count("OPTIONS the ranks were started with different") == 1, out
    # NOTE: rank 0 could hold 8 rows and a 1024-token store, rank 1 only 4 and 512: both allocate
    # rank 1's plan.
    assert "KV 511 175 8 1024" in outs[0] and "KV 175 175 8 1024" in outs[1], outs
    if frames == "tcp":
        lost = re.search(r"LOST (\d+\.\d+) rank 1's frame link closed", outs[0])
        assert lost and float(lost.group(1)) < 1.0, outs[0]


def test_heads_must_divide_by_the_ranks(tiny_weights_dir):
    model = tiny_model(tiny_weights_dir)  # NOTE: 4 attention heads, 2 KV heads
    check_shardable(model, 2)
    with pytest.raises(ValueError, match=r"KV heads \(2\) do not divide by 4"):
        check_shardable(model, 4)
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not divide by 3"):
        check_shardable(model, 3)


def test_topology_one_host_and_hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from engine.config import EngineConfig

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    one = topology(EngineConfig(tp=2), tmp_path)
    assert isinstance(one, Topology) and one.local == (0, 1)
    assert read_hostfile(one.hostfile) == one.hosts
    assert one.plan(1).env()["MLX_RANK"] == "1"
    assert one.plan(1).env()["CUDA_VISIBLE_DEVICES"] == "1"
    assert topology(EngineConfig(), tmp_path) is None
    hostfile = tmp_path / "h.json"
    hostfile.write_text('[["10.0.0.1:5000"], ["10.0.0.2:5000"]]')
    multi = topology(EngineConfig(tp_hostfile=str(hostfile), tp_rank=1), tmp_path)
    assert multi is not None and multi.local == (1,)
    assert multi.plan(1).env()["CUDA_VISIBLE_DEVICES"] == "0"  # NOTE: its host's first GPU
    assert multi.plan(1).env()["NCCL_HOST_IP"] == "10.0.0.1"
    # NOTE: the frame links' port is above every ring port, consecutive ones on one host too.
    assert frame_address(multi.hosts) == ("10.0.0.1", 5001)
    assert frame_address((("10.0.0.1:5000",), ("10.0.0.1:5001",))) == ("10.0.0.1", 5002)
    assert frame_address(one.hosts)[1] == 1 + max(int(h[0].split(":")[1]) for h in one.hosts)
    hostfile.write_text('["10.0.0.1"]')
    with pytest.raises(ValueError, match="ip:port"):
        topology(EngineConfig(tp_hostfile=str(hostfile)), tmp_path)


def test_the_fingerprint_reads_the_same_state_as_stats(tiny_weights_dir):
    """`ReplicatedLoop` fingerprints `state_stats()` (cheap) every iteration: the same values
    as `stats()` (which walks every frozen object), through prefill, decode, an abort and a
    prefix-cache hit."""
    import random

    from scheduler_util import make_scheduler, random_prompt

    from scheduler_proc.replicated import FINGERPRINT_KEYS

    sched = make_scheduler(tiny_model(tiny_weights_dir))
    rng = random.Random(5)
    shared = random_prompt(rng, 40)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for i in range(3):
        sched.submit(f"r{i}", shared + random_prompt(rng, 5), params)
    for step in range(40):
        if step == 2:
            sched.abort("r1")
        if step == 12:
            sched.submit("late", shared + random_prompt(rng, 3), params)
        if sched.has_work():
            sched.step()
        full, lean = sched.stats(), sched.state_stats()
        assert {k: full.get(k, 0) for k in FINGERPRINT_KEYS} == {
            k: lean.get(k, 0) for k in FINGERPRINT_KEYS
        }, step
    assert sched.stats()["prefix_cache_hit_tokens"] > 0 and sched.stats()["requests_aborted"] == 1


def test_bench_tp_frames_runs_on_the_cpu():
    """scripts/bench_tp_frames.py (the frame path alone, both carriers) at a toy size: the GPU
    run must not be its first run."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_tp_frames.py"
    cmd = [sys.executable, str(script), "--iterations", "60", "--dim", "16", "--layers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\| tcp \| \d+ \| \d+ \| \d+ \| \d+ \|", done.stdout), done.stdout
    assert re.search(r"\| collective \| \d+ \|", done.stdout), done.stdout
