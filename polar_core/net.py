"""Loopback networking every area shares: free ports, and the one HTTP JSON client.

The client never goes through ``HTTP(S)_PROXY``: a harness environment (and a test that runs one)
may point those at the Polar proxy itself, and control traffic (vLLM's API, the proxy's
``/_polar`` endpoints) must reach its server directly.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from typing import Any

#: urllib without the environment's proxies.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HTTPStatusError(OSError, RuntimeError):
    """The server answered with an HTTP error status; ``status`` and ``body`` say what it was.

    An ``OSError`` like urllib's own ``HTTPError`` (callers that treat "the server is not there
    yet" and "it said no" alike keep one ``except``), and a ``RuntimeError`` for the rest."""

    def __init__(self, method: str, url: str, status: int, body: bytes):
        super().__init__(f"{method} {url} -> HTTP {status}: {body.decode(errors='replace')[:2000]}")
        self.method, self.url, self.status, self.body = method, url, status, body


def http_request(url: str, body: Any | None = None, *, method: str | None = None, timeout: float = 30.0,
                 raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Send ``body`` as JSON (or ``raw`` bytes as they are); GET when there is neither. Returns the
    status and the body, error statuses included (connection failures raise ``OSError``)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_json(url: str, body: Any | None = None, *, method: str | None = None, timeout: float = 30.0) -> Any:
    """GET (or POST ``body`` as JSON) and decode the JSON answer (None for an empty one); an HTTP
    error status raises ``HTTPStatusError``."""
    status, data = http_request(url, body, method=method, timeout=timeout)
    if not 200 <= status < 300:
        raise HTTPStatusError(method or ("GET" if body is None else "POST"), url, status, data)
    return json.loads(data) if data.strip() else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now on ``host`` (the OS picks it, so parallel runs do not collide;
    the caller retries if someone else takes it before it binds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something listens on (host, port) or the port cannot be bound.

    SO_REUSEADDR mirrors what uvicorn does, so a port left in TIME_WAIT by a server we just
    stopped counts as free (a restart on the same port must work).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
