"""`mlx-engine bench`: its arithmetic on a known timeline, its workloads, and a real short run."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mlx_engine.bench.client import RequestResult, Target, request_body
from mlx_engine.bench.metrics import percentile, step_figures, summarize
from mlx_engine.bench.workload import (
    jsonl_workload,
    multiturn_workload,
    parse_range,
    random_workload,
)


def test_percentile_interpolates_between_ranks():
    xs = [float(x) for x in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def _req(start, first, tokens, step, prompt=10, error=None):
    """A request that starts at `start`, shows text at `first`, then one token every `step`."""
    times = [first + i * step for i in range(tokens)]
    r = RequestResult(0, 0, start, end=times[-1] + 0.01, first=first, chunk_times=times)
    r.prompt_tokens, r.completion_tokens, r.error = prompt, tokens, error
    return r


def test_summary_on_a_known_timeline():
    # NOTE: two requests over [0, 2.01]: TTFTs 0.5 and 1.0, 0.1 and 0.2 s per token.
    a = _req(0.0, 0.5, tokens=11, step=0.1)  # ends 1.51
    b = _req(0.2, 1.2, tokens=5, step=0.2)  # ends 2.01
    failed = _req(0.1, 0.3, tokens=3, step=0.1, error="HTTP 500")
    s = summarize([a, b, failed])
    assert (s.requests, s.errors, s.output_tokens, s.first_error) == (3, 1, 16, "HTTP 500")
    assert s.duration_s == pytest.approx(2.01)
    assert s.request_throughput == pytest.approx(2 / 2.01)
    assert s.output_throughput == pytest.approx(16 / 2.01)
    assert s.total_throughput == pytest.approx((16 + 20) / 2.01)
    assert s.ttft["p50"] == pytest.approx(0.75)
    assert s.ttft["p99"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert s.itl["p50"] == pytest.approx(0.15)
    assert s.e2e["p90"] == pytest.approx(1.51 + 0.9 * (1.81 - 1.51))


def test_workloads_are_deterministic_for_a_seed(tmp_path):
    a = random_workload(20, (4, 12), (2, 6), seed=7)
    assert a == random_workload(20, (4, 12), (2, 6), seed=7)
    assert a != random_workload(20, (4, 12), (2, 6), seed=8)
    for s in a.sessions:
        assert 4 <= len(s.turns[0].split()) - 1 <= 12 and 2 <= s.max_tokens <= 6
    chat = multiturn_workload(3, 4, system_len=50, user_len=(5, 5), output_len=8, seed=1)
    assert chat == multiturn_workload(3, 4, system_len=50, user_len=(5, 5), output_len=8, seed=1)
    assert chat.num_requests == 12 and len({s.system for s in chat.sessions}) == 1
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "hi"}, {"messages": [{"role": "system", "content": "s"}]}]
    lines[1]["messages"].append({"role": "user", "content": "q"})
    path.write_text("\n".join(json.dumps(x) for x in lines))
    js = jsonl_workload(path, 5, (3, 3), seed=2)
    assert js == jsonl_workload(path, 5, (3, 3), seed=2) and js.num_requests == 5
    assert {(s.turns, s.chat, s.system) for s in js.sessions} == {
        (("hi",), False, ""),
        (("q",), True, "s"),
    }
    assert parse_range("5") == (5, 5) and parse_range("2:9") == (2, 9)
    with pytest.raises(ValueError):
        parse_range("9:2")


def test_a_multiturn_workload_draws_every_turns_length_from_its_range():
    """`--input-len LOW:HIGH` per turn (an agent's tool results vary): only the low bound was
    used, for every turn of every user."""
    chat = multiturn_workload(16, 4, system_len=5, user_len=(10, 60), output_len=4, seed=3)
    lengths = [len(t.split()) for s in chat.sessions for t in s.turns]
    assert min(lengths) >= 10 and max(lengths) <= 60 and len(set(lengths)) > 16, lengths


def test_step_figures_come_from_the_counters_over_the_run():
    before = {"prefill_tokens": 100, "steps_prefill": 2, "steps_chained": 5, "steps_launched": 10}
    after = {"prefill_tokens": 4100, "steps_prefill": 4, "steps_chained": 35, "steps_launched": 50}
    figs = step_figures(before, after)
    assert figs == {"prefill_tokens_per_step": 2000.0, "chained_share": 0.75}
    assert all(math.isnan(v) for v in step_figures({}, {}).values())


def test_request_body_carries_history_and_the_servers_fields():
    chat = multiturn_workload(1, 2, system_len=3, user_len=(2, 2), output_len=4).sessions[0]
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    history.append({"role": "user", "content": "c"})
    body = request_body(chat, history, Target("x", "http://h", {"ignore_eos": True}))
    assert body["messages"][0]["role"] == "system" and body["messages"][1:] == history
    assert body["ignore_eos"] and body["stream"] and body["max_tokens"] == 4


def test_bench_against_a_tiny_engine_and_mlx_lm(tiny_model_dir, tmp_path):
    """The CLI end to end: our engine launched with a small pool and mlx_lm.server beside it,
    the same workload through the one client, all three outputs written."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "mlx_engine.cli", "bench", "--model", str(tiny_model_dir)]
    cmd += ["--launch-args", "--max-total-tokens 2048 --context-length 256"]
    cmd += ["--compare", "mlx-lm", "--concurrency", "1,2", "--num-requests", "4"]
    cmd += ["--input-len", "4:8", "--output-len", "5", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=110)
    except subprocess.TimeoutExpired:
        # NOTE: SIGTERM, not the kill of subprocess.run's timeout: the bench then stops its servers.
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"bench ran past 110 s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    assert "mlx-engine" in stdout and "mlx_lm.server (as shipped)" in stdout
    assert "vs mlx_lm.server (as shipped)" in stdout and "cold" in stdout
    report = json.loads((out / "bench.json").read_text())
    # NOTE: the engine's step figures from its own counters; a peer has none (null)
    ours, peer = (
        report["engines"][0]["levels"][0]["warm"],
        report["engines"][1]["levels"][0]["warm"],
    )
    assert ours["prefill_tokens_per_step"] > 0 and 0 <= ours["chained_share"] <= 1, ours
    assert peer["prefill_tokens_per_step"] is None and peer["chained_share"] is None
    for engine in report["engines"]:
        # NOTE: the cold wave is the first request after start (--concurrency 1,2 starts at 1),
        # then every level runs the whole workload; every request gives exactly 5 tokens on every
        # server (ignore_eos, or mlx_lm.server's end tokens biased away).
        assert engine["cold"]["requests"] == 1 and engine["cold"]["output_tokens"] == 5
        for level in engine["levels"]:
            assert (level["warm"]["requests"], level["warm"]["errors"]) == (4, 0)
            assert level["warm"]["output_tokens"] == 4 * 5, engine["name"]
    assert set(report["ratios"]) >= {"mlx_lm.server (as shipped)"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_of_a_single_load_level(tmp_path):
    """A level with no answered request (then: all of it counted as the cold wave) crashed the
    plot's log axis, and, as the plot came first, lost the table and JSON too."""
    from mlx_engine.bench.client import Load
    from mlx_engine.bench.report import EngineResult, Level, plot

    level = Level(Load(16), summarize([]))
    plot(tmp_path / "one.png", [EngineResult("a", levels=[level])], "t")
    assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS + float32 peer is Linux CPU's")
@pytest.mark.parametrize(
    "compare,peers",
    [((), 0), (("mlx-lm",), 2), (("mlx-lm-env",), 1), (("mlx-lm", "mlx-lm-env"), 2)],
)
def test_compare_starts_the_peers_asked_for(compare, peers, tiny_model_dir):
    """`mlx-lm-env`: only mlx_lm.server in the engine's environment (the shipped one is slow)."""
    from engine.cpu_backend import BackendInfo
    from mlx_engine.bench import run

    cfg = run.BenchConfig(model=str(tiny_model_dir), compare=compare).validate()
    started = list(run._servers(cfg, BackendInfo(blas="OpenBLAS", optimized=True)))
    assert len(started) == 1 + peers  # NOTE: the engine, then the peers (none started here)


@pytest.mark.parametrize("listed,sent", [(["only"], {"model": "only"}), (["a", "b"], {}), ([], {})])
def test_a_url_that_lists_one_model_gets_its_name_in_every_request(listed, sent):
    """A router (smg) refuses a request without a model; a server listing several (mlx_lm.server:
    every model it could load, and it loads the one a request names) gets none."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from mlx_engine.bench.client import served_model

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"object": "list", "data": [{"id": m} for m in listed]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert served_model(f"http://127.0.0.1:{server.server_port}") == sent
    finally:
        server.shutdown()
        server.server_close()


DYING_SERVER = """
import json, os, socket, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else json.dumps({"data": []}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        print("dying on the first request", flush=True)
        # NOTE: its clients see the connections drop (and the next ones refused) a moment
        # before the process is gone
        self.server.socket.close()
        self.connection.shutdown(socket.SHUT_RDWR)
        time.sleep(1.0)
        os._exit(3)

HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_that_dies_mid_run_is_reported_with_its_first_error_and_its_log(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A peer crashed halfway through an agents run and the table said only '32/32' errors:
    now each run with errors names its first one, the table says the server exited and with
    which code, and the server's output is kept in a file beside the results."""
    from mlx_engine.bench import run, servers

    script = tmp_path / "dying.py"
    script.write_text(DYING_SERVER)
    monkeypatch.setattr(
        servers,
        "engine_command",
        lambda model, args, port: [sys.executable, str(script), str(port)],
    )
    out = tmp_path / "out"
    cfg = run.BenchConfig(
        model=str(tiny_model_dir),
        concurrency=(2,),
        num_requests=3,
        input_len="4:8",
        output_len="4",
        out_dir=out,
        progress=False,
    ).validate()
    (result,) = run.run_bench(cfg)
    assert result.cold is not None and result.cold.errors == 2
    assert result.levels[0].warm.errors == 3 and result.exit_code == 3
    text = "\n".join(result.error_lines())
    assert "cold wave: 2 of 2 requests failed; the first: " in text, text
    assert "exited with code 3 during the run" in text and str(out / "mlx-engine.log") in text
    assert "dying on the first request" in (out / "mlx-engine.log").read_text()
