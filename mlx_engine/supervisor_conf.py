"""`mlx-engine supervisor-conf`: a supervisord program section that runs `launch` with the given
options and stops it the way the launcher expects (docs/operations.md explains each line); with
`--workers N --router smg`, a group of N engines on consecutive ports and smg in front of them
(docs/distributed.md, "Scale out")."""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

from engine.config import EngineConfig
from engine.models import engine_home
from mlx_engine import router_conf
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
        *_group_and_logs(log),
    ]
    # NOTE: supervisord's environment may lack HOME; pin where models were converted and cached.
    lines.append(f'environment=MLX_ENGINE_HOME="{engine_home()}"')
    return _section(lines)


def _group_and_logs(log: Path) -> list[str]:
    return [
        # NOTE: the launcher and its children are one process group; a SIGKILL after
        # stopwaitsecs must reach them all.
        "stopasgroup=true",
        "killasgroup=true",
        "redirect_stderr=true",
        f"stdout_logfile={log}",
        "stdout_logfile_maxbytes=50MB",
        "stdout_logfile_backups=10",
    ]


def _section(lines: list[str]) -> str:
    # NOTE: supervisord expands %(name)s in values; a literal % must be doubled.
    return "\n".join(line.replace("%", "%%") for line in lines) + "\n"


# --- a fleet: N engines and a router ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fleet:
    """`workers` engines on this host and, with `router` "smg", smg in front of them and of
    `remote` (engine URLs on other hosts) at `router_port`."""

    workers: int = 1
    router: str = "none"  # none | smg
    router_port: int = 8000
    remote: tuple[str, ...] = ()


def engine_configs(config: EngineConfig, workers: int) -> list[EngineConfig]:
    """Engine i serves HTTP on --port + i and the SDK on --zmq-port + i; when those two ranges
    would overlap (the defaults, 30000 and 30001, do), the SDK ports follow the HTTP ports.
    The engines share the host's memory: each takes its share of --mem-fraction."""
    http = range(config.port, config.port + workers)
    sdk = config.zmq_port if config.zmq_port not in _widen(http, workers) else http.stop
    if sdk + workers > 65536 or http.stop > 65536:
        raise ValueError(f"--workers {workers}: the ports run past 65535")
    # NOTE: each engine sizes its KV cache from the memory free when it starts; started
    # together, N engines would each take --mem-fraction of the same free memory.
    share = round(config.mem_fraction / workers, 4)
    return [
        dataclasses.replace(config, port=http[i], zmq_port=sdk + i, mem_fraction=share)
        for i in range(workers)
    ]


def _widen(ports: range, n: int) -> range:
    """The starts of an n-port range that would overlap `ports`."""
    return range(ports.start - n + 1, ports.stop)


def fleet_conf(
    config: EngineConfig, fleet: Fleet, name: str, log_dir: Path, start_secs: int = 10
) -> str:
    """A program per engine (`NAME-0`, ...), the router's (`NAME-router`), and their group."""
    if fleet.workers < 1:
        raise ValueError("--workers must be at least 1")
    if fleet.remote and fleet.router != "smg":
        raise ValueError("--remote-workers: engines elsewhere are reached through --router smg")
    configs = engine_configs(config, fleet.workers)
    names = [f"{name}-{i}" for i in range(fleet.workers)]
    head = [
        f"; {n}: HTTP port {c.port}, SDK port {c.zmq_port}"
        for n, c in zip(names, configs, strict=True)
    ]
    parts = [_engine(c, n, log_dir, start_secs) for c, n in zip(configs, names, strict=True)]
    if fleet.router == "smg":
        used = {c.port for c in configs} | {c.zmq_port for c in configs}
        router_ports = {fleet.router_port, fleet.router_port + router_conf.METRICS_PORT_OFFSET}
        if used & router_ports:
            raise ValueError(f"--router-port {fleet.router_port}: an engine listens there")
        head.append(f"; {name}-router: smg at port {fleet.router_port}")
        parts.append(_router(config, configs, fleet, f"{name}-router", log_dir))
        names.append(f"{name}-router")
    elif fleet.router != "none":
        raise ValueError(f"--router: {fleet.router!r} (smg or none)")
    group = _section([f"[group:{name}]", f"programs={','.join(names)}"])
    return "\n".join(["\n".join(head) + "\n", *parts, group])


def _engine(config: EngineConfig, name: str, log_dir: Path, start_secs: int) -> str:
    # NOTE: engines start before the router and stop after it (supervisord: lower first)
    return program_section(config, name, log_dir, start_secs) + "priority=100\n"


def _router(
    config: EngineConfig, engines: list[EngineConfig], fleet: Fleet, name: str, log_dir: Path
) -> str:
    urls = [router_conf.worker_url(c.host, c.port) for c in engines] + list(fleet.remote)
    cmd = router_conf.smg_command(
        urls,
        router_conf.model_name(config),
        host=config.host,
        port=fleet.router_port,
        api_key=config.api_key,
        grace_s=config.shutdown_grace,
    )
    lines = [
        f"[program:{name}]",
        f"command={shlex.join(cmd)}",
        f"directory={os.getcwd()}",
        "autostart=true",
        "autorestart=true",
        "startsecs=5",
        "startretries=3",
        "stopsignal=TERM",
        # NOTE: smg drains its requests for the grace period it was given, then exits
        f"stopwaitsecs={int(config.shutdown_grace) + STOP_MARGIN_S}",
        *_group_and_logs(Path(log_dir).absolute() / f"{name}.log"),
        "priority=200",
    ]
    return _section(lines)
