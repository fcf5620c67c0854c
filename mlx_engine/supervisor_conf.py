"""`mlx-engine supervisor-conf`: a supervisord program section that runs `launch` with the given
options and stops it the way the launcher expects (docs/operations.md explains each line)."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.models import engine_home
from mlx_engine.launch import EXIT_SLACK_S, TEARDOWN_S

# NOTE: beyond the launcher's own worst case (grace + exit slack + teardown), so supervisord's
# SIGKILL only ever lands on an engine that is truly stuck.
STOP_MARGIN_S = 10


def launch_command(config: EngineConfig) -> list[str]:
    """`python -m mlx_engine.cli launch` with every option that differs from its default."""
    args = [sys.executable, "-m", "mlx_engine.cli", "launch"]
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        args += [flag] if isinstance(value, bool) else [flag, str(value)]
    return args


def stop_wait_s(config: EngineConfig) -> int:
    return int(config.shutdown_grace + EXIT_SLACK_S + TEARDOWN_S + STOP_MARGIN_S)


def program_section(
    config: EngineConfig, name: str, log_dir: Path, start_secs: int = 10, directory: str = ""
) -> str:
    log = Path(log_dir).absolute() / f"{name}.log"
    lines = [
        f"[program:{name}]",
        f"command={shlex.join(launch_command(config))}",
        f"directory={directory or os.getcwd()}",
        "autostart=true",
        # NOTE: exit 0 is a shutdown someone asked for (signal, shutdown()); anything else is a
        # failure and is restarted.
        "autorestart=unexpected",
        "exitcodes=0",
        f"startsecs={start_secs}",
        "startretries=3",
        "stopsignal=TERM",
        f"stopwaitsecs={stop_wait_s(config)}",
        # NOTE: the launcher and its children are one process group; a SIGKILL after
        # stopwaitsecs must reach them all.
        "stopasgroup=true",
        "killasgroup=true",
        "redirect_stderr=true",
        f"stdout_logfile={log}",
        "stdout_logfile_maxbytes=50MB",
        "stdout_logfile_backups=10",
    ]
    # NOTE: supervisord's environment may lack HOME; pin where models were converted and cached.
    lines.append(f'environment=MLX_ENGINE_HOME="{engine_home()}"')
    # NOTE: supervisord expands %(name)s in values; a literal % must be doubled.
    return "\n".join(line.replace("%", "%%") for line in lines) + "\n"
