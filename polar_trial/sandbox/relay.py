"""The host half of the model-proxy relay: a job-private Unix socket forwarding to one host loopback
port (the proxy's). A sandbox without network reaches the proxy through it and nothing else: the
socket only ever connects to that one port, so other services on the host's loopback stay out of
reach. Threads, two per connection (at most 64 connections at once): a harness opens a handful.
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


#: The most connections one sandbox holds open through a host-side listener at once (a harness
#: opens a handful). Past it the next connection waits in the listen backlog: a sample opening
#: 2,046 connections made 4,095 threads in the Polar process and starved the shared proxy.
MAX_CONNECTIONS = 64


class UnixListener:
    """A job-private Unix socket (mode 0600) served by one thread per connection, at most
    ``MAX_CONNECTIONS`` at once; ``handle(conn)`` is the subclass's, and the sockets it registers
    with ``track`` are closed when it returns or the listener closes."""

    def __init__(self, path: Path, name: str, limit: int = MAX_CONNECTIONS):
        self.path = Path(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(64)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limit)
        self._mine = threading.local()  # the sockets of the connection this thread handles
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def track(self, *socks: socket.socket) -> None:
        """Close these with the connection being handled (and with the listener)."""
        self._mine.socks.extend(socks)
        with self._lock:
            self._open.update(socks)

    def _serve(self) -> None:
        while not self._closed:
            if not self._slots.acquire(timeout=0.5):
                continue
            try:
                conn, _ = self._sock.accept()
            except OSError:
                self._slots.release()
                return
            threading.Thread(target=self._in_slot, args=(conn,), daemon=True).start()

    def _in_slot(self, conn: socket.socket) -> None:
        self._mine.socks = []
        self.track(conn)
        try:
            self.handle(conn)
        except OSError:
            pass
        finally:
            mine = self._mine.socks
            with self._lock:
                self._open.difference_update(mine)
            for sock in mine:
                with contextlib.suppress(OSError):
                    sock.close()
            self._slots.release()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.close()
            self._open.clear()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=2)


def splice(conn: socket.socket, up: socket.socket) -> None:
    """Pump both directions until both have ended (one in a thread of its own, one here)."""
    t = threading.Thread(target=pump, args=(up, conn), daemon=True)
    t.start()
    pump(conn, up)
    t.join()


class UnixToTcpRelay(UnixListener):
    """Listen on ``path`` (mode 0600), forward every connection to 127.0.0.1:``port``."""

    def __init__(self, path: Path, port: int):
        self.port = port
        self.connections = 0
        super().__init__(path, f"relay-{port}")

    def handle(self, conn: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        up.settimeout(None)
        self.track(up)
        self.connections += 1
        splice(conn, up)
