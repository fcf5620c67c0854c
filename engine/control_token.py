"""The control token: without `--api-key`, only the engine's owner may stop it or read its stats.

Without a key, any local process could send `ShutdownEngine` to the SDK port (the engine exited
in 11 s, other clients' streams aborted) or read its stats; on a shared Mac or server, every
local user is such a process. The launcher writes a random token to a file only its user can
read (`path_for`: 0600 in a 0700 directory), hands it to the front door in the environment, and
the SDK reads it for control calls to that port. An engine with `--api-key` takes its key for
control messages, as before.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV = "MLX_ENGINE_CONTROL_TOKEN"
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def runtime_dir() -> Path:
    """The user's own runtime directory: `$XDG_RUNTIME_DIR/mlx-engine`, else
    `~/.cache/mlx-engine/run` (created 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "mlx-engine" if base else Path.home() / ".cache" / "mlx-engine" / "run"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def path_for(port: int) -> Path:
    return runtime_dir() / f"control-{port}.token"


def create(port: int) -> str:
    """A new token for the engine serving `port`, written 0600 (replacing an old one)."""
    token = secrets.token_urlsafe(32)
    path = path_for(port)
    path.unlink(missing_ok=True)  # NOTE: O_EXCL below: never write through someone's link
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read(port: int | None) -> str | None:
    """The token of the engine on `port`, when this user can read one."""
    if port is None:
        return None
    try:
        return path_for(port).read_text().strip() or None
    except OSError:
        return None


def remove(port: int, token: str) -> None:
    """Remove the token file if it is still this engine's."""
    if read(port) == token:
        path_for(port).unlink(missing_ok=True)


def port_of(address: str) -> int | None:
    """The TCP port of an SDK address (`tcp://host:port`); None for any other transport."""
    if not address.startswith("tcp://"):
        return None
    try:
        return int(address.rsplit(":", 1)[1])
    except ValueError:
        return None


def for_address(address: str) -> str | None:
    """The token of the engine an SDK address names, when that engine is on this machine (a
    token is never sent to another host, which could be anyone's engine on that port)."""
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return read(port_of(address)) if host in LOCAL_HOSTS else None
