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
