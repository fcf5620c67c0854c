"""`mlx-engine supervisor-conf` output: the launch options carried over, a stop timeout beyond the
launcher's own worst case, and values supervisord will not misread."""

from __future__ import annotations

import configparser
import shlex
import subprocess
import sys

from engine.config import EngineConfig
from mlx_engine.launch import EXIT_SLACK_S, TEARDOWN_S
from mlx_engine.supervisor_conf import launch_command, program_section


def _section(text: str) -> dict[str, str]:
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    return dict(parser["program:engine"])


def test_the_section_runs_launch_with_the_options_given(tmp_path):
    options = f"--name engine --log-dir {tmp_path} --zmq-port 31001 --shutdown-grace 20"
    cmd = [sys.executable, "-m", "mlx_engine.cli", "supervisor-conf", *options.split()]
    out = subprocess.run(
        [*cmd, "--disable-overlap"], capture_output=True, text=True, check=True
    ).stdout
    section = _section(out)
    args = shlex.split(section["command"])
    assert args[:4] == [sys.executable, "-m", "mlx_engine.cli", "launch"]
    assert args[4:] == ["--zmq-port", "31001", "--disable-overlap", "--shutdown-grace", "20.0"]
    assert int(section["stopwaitsecs"]) > 20 + EXIT_SLACK_S + TEARDOWN_S
    assert section["stopsignal"] == "TERM"
    assert section["stopasgroup"] == section["killasgroup"] == "true"
    assert section["autorestart"] == "unexpected" and section["exitcodes"] == "0"
    assert section["stdout_logfile"] == str(tmp_path / "engine.log")


def test_a_percent_sign_is_escaped_for_supervisord(tmp_path):
    config = EngineConfig(model=str(tmp_path / "100%model")).validate()
    text = program_section(config, "engine", tmp_path)
    assert "100%%model" in _section(text)["command"]
    assert launch_command(config)[-1].endswith("100%model")


def _fleet(*options: str) -> configparser.RawConfigParser:
    cmd = [sys.executable, "-m", "mlx_engine.cli", "supervisor-conf", *options]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    parser = configparser.RawConfigParser()
    parser.read_string(out)
    return parser


def _flag(args: list[str], flag: str) -> list[str]:
    """The values after `flag`, up to the next flag."""
    i = args.index(flag) + 1
    values = []
    while i < len(args) and not args[i].startswith("--"):
        values.append(args[i])
        i += 1
    return values


def test_a_fleet_is_engines_on_consecutive_ports_and_smg_in_front(tmp_path):
    model = tmp_path / "qwen3"
    conf = _fleet(
        *("--workers", "3", "--router", "smg", "--model", str(model), "--name", "fleet"),
        *("--log-dir", str(tmp_path), "--remote-workers", "http://10.0.0.2:30000"),
    )
    assert conf["group:fleet"]["programs"] == "fleet-0,fleet-1,fleet-2,fleet-router"
    ports = []
    for i in range(3):
        section = conf[f"program:fleet-{i}"]
        args = shlex.split(section["command"])
        config = dict(zip(args[4::2], args[5::2], strict=False))
        ports.append((int(config.get("--port", 30000)), int(config["--zmq-port"])))
        # NOTE: three engines on one host share its memory
        assert float(config["--mem-fraction"]) == round(0.5 / 3, 4)
        assert int(section["priority"]) < int(conf["program:fleet-router"]["priority"])
    assert [p for p, _ in ports] == [30000, 30001, 30002]
    # NOTE: the SDK ports follow the HTTP ports (the default 30001 is the second engine's HTTP)
    assert [z for _, z in ports] == [30003, 30004, 30005]
    router = shlex.split(conf["program:fleet-router"]["command"])
    assert router[:4] == [sys.executable, "-m", "smg", "launch"]
    assert _flag(router, "--worker-urls") == [
        "http://127.0.0.1:30000",
        "http://127.0.0.1:30001",
        "http://127.0.0.1:30002",
        "http://10.0.0.2:30000",
    ]
    assert _flag(router, "--policy") == ["cache_aware"]
    assert _flag(router, "--model-alias") == ["default=qwen3"]
    assert _flag(router, "--port") == ["8000"]
    assert int(_flag(router, "--health-check-interval-secs")[0]) <= 10


def test_a_fleet_refuses_a_router_port_an_engine_takes(tmp_path):
    cmd = [sys.executable, "-m", "mlx_engine.cli", "supervisor-conf", "--workers", "2"]
    cmd += ["--router", "smg", "--router-port", "30001", "--log-dir", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 2 and "--router-port 30001" in out.stderr
