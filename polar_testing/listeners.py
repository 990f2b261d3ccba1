"""A loopback TCP listener for isolation tests: it counts the connections it accepts and answers
each with fixed bytes, so a test can assert that a sandboxed process did (or did not) reach it.

The sandbox and egress tests each had their own copy (four, differing only in the reply, the
backlog and whether they read first); this is the one they share. It binds to loopback (or an
address the test made in its own namespace), never another host.
"""

from __future__ import annotations

import socket
import threading


def http_reply(body: bytes) -> bytes:
    """A minimal HTTP/1.1 200 answer carrying ``body`` (then the connection closes)."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


class CountingListener:
    """Accepts on ``addr``:<free port>, counts in ``accepted``, answers ``reply``.

    ``read_first``: read the client's request before answering (an HTTP client sends first; a
    probe that only reads needs False). ``backlog=0``: listen but never accept, so the queue fills
    and later connection attempts hang (a host that takes no new connections)."""

    def __init__(self, reply: bytes = http_reply(b"OK"), addr: str = "127.0.0.1", backlog: int = 64,
                 read_first: bool = True) -> None:
        self.sock = socket.socket(socket.AF_INET)
        self.sock.bind((addr, 0))
        self.sock.listen(backlog)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.reply, self.read_first = reply, read_first
        if backlog > 0:
            threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                if self.read_first:
                    c.recv(4096)
                c.sendall(self.reply)
            except OSError:
                pass
            finally:
                c.close()

    def close(self) -> None:
        self.sock.close()
