"""The host half of the model-proxy relay: a job-private Unix socket forwarding to one host loopback
port (the proxy's). A sandbox without network reaches the proxy through it and nothing else: the
socket only ever connects to that one port, so other services on the host's loopback stay out of
reach. Threads, two per connection: a harness opens a handful of connections per sample.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                s.shutdown(how)


class UnixToTcpRelay:
    """Listen on ``path`` (mode 0600), forward every connection to 127.0.0.1:``port``."""

    def __init__(self, path: Path, port: int):
        self.path, self.port = Path(path), port
        self.connections = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(64)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"relay-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                up.settimeout(None)
            except OSError:
                conn.close()
                continue
            self.connections += 1
            with self._lock:
                self._open.update((conn, up))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        pump(a, b)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for s in self._open:
                with contextlib.suppress(OSError):
                    s.close()
            self._open.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=2)
