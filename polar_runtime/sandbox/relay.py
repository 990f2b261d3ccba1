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


#: The most connections one sandbox holds open through a host-side relay at once (a harness opens
#: a handful). Past it the next connection waits in the listen backlog: a sample opening 2,046
#: connections made 4,095 threads in the Polar process and starved the shared proxy.
MAX_CONNECTIONS = 64


class ConnectionSlots:
    """A bound on a relay's open connections: ``take()`` before accepting (False once closed),
    ``pair()`` a release that fires when both directions of a connection have ended."""

    def __init__(self, limit: int = MAX_CONNECTIONS):
        self._sem = threading.BoundedSemaphore(limit)
        self.closed = False

    def take(self) -> bool:
        while not self.closed:
            if self._sem.acquire(timeout=0.5):
                if self.closed:
                    self._sem.release()
                    return False
                return True
        return False

    def release(self) -> None:
        self._sem.release()

    def pair(self, on_last=None):
        """A callable to call once per direction; after the second call ``on_last()`` runs (close
        the two sockets) and the slot is freed."""
        left = [2]
        lock = threading.Lock()

        def done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    if on_last is not None:
                        on_last()
                finally:
                    self.release()
        return done


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
        self._slots = ConnectionSlots()
        self._thread = threading.Thread(target=self._serve, name=f"relay-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._slots.take():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                self._slots.release()
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                up.settimeout(None)
            except OSError:
                conn.close()
                self._slots.release()
                continue
            self.connections += 1
            with self._lock:
                self._open.update((conn, up))
            done = self._slots.pair(lambda conn=conn, up=up: self._ended(conn, up))
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b, done), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, done) -> None:
        try:
            pump(a, b)
        finally:
            done()

    def _ended(self, conn: socket.socket, up: socket.socket) -> None:
        with self._lock:
            self._open.difference_update((conn, up))
        for sock in (conn, up):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self._slots.closed = True
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
