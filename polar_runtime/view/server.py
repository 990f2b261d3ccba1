"""``polar view RUN --serve``: the same page over HTTP on 127.0.0.1, its data made from the run
directory at each request, so that it follows a loop that is running.

What it answers, and nothing else: the page's three files and the vendored library (from this
package, never from the run directory), ``data/run.js`` (rebuilt when a file it reads changed:
:meth:`RunView.refresh`) and ``data/samples/<i>.js`` (built when asked). The run directory is read
only through :class:`RunFiles` (no link followed, sizes capped), and no path of a URL is ever
joined to a directory: the names are matched against that fixed list. It listens on the loopback
only and answers only requests addressed to it by that name (``Host: 127.0.0.1:PORT`` or
``localhost:PORT``: a page of another site whose name was made to resolve to 127.0.0.1 gets 403);
the responses carry the page's content security policy as a header too.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .chunks import ASSETS, STATIC, VENDOR, chunk

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         "": "text/plain; charset=utf-8"}
SAMPLE = re.compile(r"^/data/samples/(\d{1,9})\.js$")


def static_files() -> dict[str, Path]:
    """URL path -> file, fixed at start: the page's assets and every vendored file."""
    files = {f"/{name}": STATIC / name for name in ASSETS}
    files["/"] = STATIC / "index.html"
    for p in VENDOR.rglob("*"):
        if p.is_file():
            files["/vendor/" + p.relative_to(VENDOR).as_posix()] = p
    return files


def make_server(view: Any, port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server for ``view`` (a :class:`RunView`) on 127.0.0.1:``port`` (0: a free one)."""
    files = static_files()
    lock = threading.Lock()  # one RunView, its caches not thread-safe

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:  # quiet: the terminal shows the URL only
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            port = self.server.server_address[1]
            if self.headers.get("Host") not in (f"127.0.0.1:{port}", f"localhost:{port}"):
                # DNS rebinding: a web page whose name resolves to 127.0.0.1 would read the run
                return self._send(403, b"forbidden host", TYPES[""])
            try:
                if path in files:
                    p = files[path]
                    return self._send(200, p.read_bytes(), TYPES.get(p.suffix, "application/octet-stream"))
                if path == "/data/run.js":
                    with lock:
                        view.refresh()
                        body = chunk("run", view.summary)
                    return self._send(200, body, TYPES[".js"])
                m = SAMPLE.match(path)
                if m:
                    with lock:
                        view.refresh()
                        data = view.sample(int(m.group(1)))
                    if data is not None:
                        return self._send(200, chunk(f"sample/{m.group(1)}", data), TYPES[".js"])
                self._send(404, b"not found", TYPES[""])
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the server
                self._send(500, f"error: {type(exc).__name__}".encode(), TYPES[""])

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)
