"""A loopback TCP proxy whose connections a test can reset (RST), as a flaky network would."""

from __future__ import annotations

import selectors
import socket
import struct
import threading

from engine_harness import free_port


class TcpProxy:
    """Forwards 127.0.0.1:`port` to `target_port`; `reset()` drops every open connection with a
    TCP RST and keeps accepting new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.resets = 0
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._reset_asked = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self._reset_asked.set()
        while self._reset_asked.is_set():
            self._thread.join(0.01)

    def close(self) -> None:
        self._stopping = True
        self._thread.join(5)
        self._listener.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        while not self._stopping:
            if self._reset_asked.is_set():
                self._drop_all(sel)
                self._reset_asked.clear()
            for key, _ in sel.select(0.02):
                if key.fileobj is self._listener:
                    self._accept(sel)
                elif key.fileobj in self._pairs:
                    # NOTE: both ends of a pair can be ready in one select; the first may have
                    # closed the pair already (that race killed this thread with a KeyError).
                    self._pump(sel, key.fileobj)  # type: ignore[arg-type]
        self._drop_all(sel)
        sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        for s in (client, upstream):
            s.setblocking(True)
            sel.register(s, selectors.EVENT_READ)
        self._pairs[client], self._pairs[upstream] = upstream, client

    def _pump(self, sel: selectors.BaseSelector, src: socket.socket) -> None:
        try:
            data = src.recv(65536)
            if data:
                self._pairs[src].sendall(data)
                return
        except OSError:
            pass
        self._close_pair(sel, src)

    def _drop_all(self, sel: selectors.BaseSelector) -> None:
        for s in list(self._pairs):
            if s in self._pairs:
                self.resets += 1
                self._close_pair(sel, s)

    def _close_pair(self, sel: selectors.BaseSelector, s: socket.socket) -> None:
        other = self._pairs.pop(s, None)
        if other is None:
            return
        self._pairs.pop(other, None)
        for sock in (s, other):
            sel.unregister(sock)
            # NOTE: SO_LINGER 0 makes close() send RST instead of FIN: a reset, not a goodbye.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
