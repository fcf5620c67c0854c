"""The launcher's busy-port check (mlx_engine/launch.py): right on BSD sockets (macOS) too, where a
SO_REUSEADDR bind to 127.0.0.1 succeeds beside a listener on the wildcard address."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest
from engine_harness import free_port

from engine.config import EngineConfig
from mlx_engine import launch


@pytest.fixture
def wildcard_listener() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.fixture
def bsd_bind(monkeypatch):
    """The bind probe passes, as it does on macOS beside a wildcard listener of the same user."""
    monkeypatch.setattr(launch, "_bind_probe", lambda *args: None)


@pytest.mark.timeout(10)
def test_a_wildcard_listener_makes_the_loopback_port_busy(wildcard_listener):
    busy = launch._port_in_use("127.0.0.1", wildcard_listener)
    assert busy is not None and "address already in use" in busy


@pytest.mark.timeout(10)
def test_where_the_bind_passes_the_connect_finds_the_listener(wildcard_listener, bsd_bind):
    busy = launch._port_in_use("127.0.0.1", wildcard_listener)
    assert busy is not None and "address already in use" in busy


@pytest.mark.timeout(10)
def test_a_wildcard_host_finds_a_loopback_listener(bsd_bind):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert launch._port_in_use("0.0.0.0", port) is not None
        assert launch._port_in_use("*", port) is not None


@pytest.mark.timeout(10)
def test_a_wildcard_address_is_probed_on_the_loopback():
    assert launch._connect_target(socket.AF_INET, ("0.0.0.0", 5)) == ("127.0.0.1", 5)
    assert launch._connect_target(socket.AF_INET6, ("::", 5, 0, 0)) == ("::1", 5, 0, 0)
    assert launch._connect_target(socket.AF_INET, ("10.1.2.3", 5)) == ("10.1.2.3", 5)


@pytest.mark.timeout(10)
def test_a_free_port_is_free():
    assert launch._port_in_use("127.0.0.1", free_port()) is None


@pytest.mark.timeout(10)
def test_a_port_held_only_by_time_wait_connections_is_free():
    """SO_REUSEADDR is there for this: an engine restarted at once finds its old connections in
    TIME_WAIT on the port (the side that closes first keeps it)."""
    with socket.socket() as listener:
        # NOTE: as libzmq's and asyncio's listeners: on Linux a TIME_WAIT connection is reused
        # only when both it (from its listener) and the new socket have SO_REUSEADDR
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # NOTE: the server's side closes first: its end goes to TIME_WAIT
        assert client.recv(1) == b""
        client.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))  # NOTE: the case is real: without SO_REUSEADDR, in use
    assert refused.value.errno == errno.EADDRINUSE
    assert launch._port_in_use("127.0.0.1", port) is None


@pytest.mark.timeout(10)
def test_the_http_port_is_checked_too(wildcard_listener):
    config = EngineConfig(zmq_port=free_port(), port=wildcard_listener)
    busy = launch._busy_endpoint(config)
    assert busy is not None and busy.startswith(f"http://127.0.0.1:{wildcard_listener}: ")
    assert launch._busy_endpoint(EngineConfig(zmq_port=free_port(), port=free_port())) is None
