"""The only way out of a sandbox besides the model: an HTTP proxy on a job-private Unix socket.

Who reaches what (``allow``, per phase):

* **build steps**: public hosts and the package registries (``build_egress``), as Harbor builds
  with the network: a build runs the task author's Dockerfile before any sample exists, and
  public tasks fetch from GitHub, get.sdkman.io or deb.nodesource.com. ``POLAR_BUILD_NETWORK=
  registries`` restricts builds to the registries;
* **the verifier**: the package registries only (``registries``);
* **the agent phase**: nothing but the model; under a container backend's live trial the
  package registries too (``sandbox/trial.py``), and public hosts only where the task says
  ``allow_internet = true`` *and* the run allows it (``RolloutConfig.allow_internet``, off by
  default).

A registry is reached on ports 80/443 at any address but loopback, link-local or this host's (a
mirror on the user's network is fine); a public host on any port but mail's, at a public unicast
address only (``publicnet.py``: never loopback, link-local, private, unique-local, CGNAT,
multicast, unspecified, v4-in-v6 forms of those, nor any address of this host, where the model
proxy's control API and vLLM's ``/pause`` and ``/update_weights`` listen). The check is made on
the resolved address at connect time and the connection goes to that address (no second lookup:
no DNS rebinding). A host that does not answer fails within ``publicnet.CONNECT_TIMEOUT_S`` (5 s),
naming it, not after the build step's whole timeout; it is answered ``403`` (a status clients do
not retry: wget's 20 tries on a 504, with its back-off, took minutes) and remembered, so that
asking it again in the same phase is answered at once, not after another 5 s.

Hostile input: the request head must arrive within 15 s (a slow client holds no slot for long),
be at most 64 KiB, 100 header lines, 8 KiB a line; at most ``relay.MAX_CONNECTIONS`` (64)
connections are served at once per proxy, the next wait in the listen backlog. Everything
refused gets ``403`` with a sentence that says why, which pip, apt and curl print. TLS stays end
to end (``CONNECT``); plain HTTP (apt's mirrors) is forwarded one request per connection.

It listens on a job-private Unix socket (no host port at all, so nothing but that sandbox can use
it), relayed inside to ``127.0.0.1:<port>``, which the phase's ``HTTP(S)_PROXY`` names.

The registries: ``DEFAULT_REGISTRIES``, or the comma-separated ``POLAR_SANDBOX_REGISTRIES``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from polar_trial.sandbox.publicnet import PUBLIC, Refused, connect_checked
from polar_trial.sandbox.relay import UnixListener, splice

#: PyPI (pip, uv), the npm registry, Debian's mirrors; what a Harbor task's build and tests install from
DEFAULT_REGISTRIES = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org",
                      "security.debian.org")
PORTS = (80, 443)
HEAD_LIMIT = 64 * 1024
HEAD_LINES = 100
LINE_LIMIT = 8 * 1024
HEAD_TIMEOUT_S = 15.0
#: ``registries`` restricts build steps to the package registries; ``public`` (the default) opens
#: them to public hosts as well
BUILD_NETWORK_ENV = "POLAR_BUILD_NETWORK"


def registries() -> tuple[str, ...]:
    raw = os.environ.get("POLAR_SANDBOX_REGISTRIES")
    if raw is None:
        return DEFAULT_REGISTRIES
    return tuple(h.strip().lower().rstrip(".") for h in raw.split(",") if h.strip())


def builds_reach_public_hosts() -> bool:
    """Whether build steps reach public hosts (``POLAR_BUILD_NETWORK``, read from Polar's own
    environment: a task's ENV never reaches it)."""
    value = os.environ.get(BUILD_NETWORK_ENV, "public").strip().lower()
    if value not in ("public", "registries"):
        raise ValueError(f"{BUILD_NETWORK_ENV} must be 'public' or 'registries', not {value!r}")
    return value == "public"


def build_egress() -> tuple[str, ...]:
    """What build steps reach: the registries, and public hosts unless restricted."""
    return registries() + ((PUBLIC,) if builds_reach_public_hosts() else ())


#: where the filtering proxy is seen inside a sandbox (its own network namespace: any free port)
INSIDE_PORT = 3128


def egress_port(spec) -> int:
    return INSIDE_PORT if spec.proxy_port != INSIDE_PORT else INSIDE_PORT + 1


def egress_env(port: int) -> dict[str, str]:
    """The phase's proxy variables: pip, uv, apt, npm and curl all read them."""
    url = f"http://127.0.0.1:{port}"
    out = {k: url for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
    out.update(NO_PROXY="localhost,127.0.0.1", no_proxy="localhost,127.0.0.1")
    return out


def is_registry(host: str, allow: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == a or host.endswith("." + a) for a in allow if a != PUBLIC)


def allowed_host(host: str, allow: tuple[str, ...]) -> bool:
    """Whether ``allow`` lets ``host`` through by name (its address is checked at connect)."""
    return PUBLIC in allow or is_registry(host, allow)


class EgressProxy(UnixListener):
    """A filtering HTTP proxy on ``path`` (a Unix socket, 0600). ``allow_private`` (any address,
    loopback included, for the registries) exists for the tests alone: their allowed host is a
    listener they started. ``connect_timeout_s``: None for ``publicnet.CONNECT_TIMEOUT_S``."""

    def __init__(self, path: Path, allow: tuple[str, ...], *, allow_private: bool = False,
                 ports: tuple[int, ...] = PORTS, connect_timeout_s: float | None = None):
        self.allow, self.allow_private, self.ports = tuple(allow), allow_private, ports
        self.connect_timeout_s = connect_timeout_s
        self.dead: dict[tuple[str, int], str] = {}  # (host, port) that did not answer -> why
        self.refused: list[str] = []
        self.passed: list[str] = []
        super().__init__(path, "egress")

    def _answer(self, conn: socket.socket, status: str, why: str) -> None:
        self.refused.append(why)
        body = f"Polar sandbox: {why}\n".encode()
        with contextlib.suppress(OSError):
            conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nConnection: close\r\n".encode()
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.close()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self._answer(conn, "403 Forbidden", why)

    def _read_head(self, conn: socket.socket) -> bytes | str | None:
        """The request head (bytes), a refusal (str), or None when the client went away."""
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            head += chunk
            if len(head) > HEAD_LIMIT and b"\r\n\r\n" not in head[:HEAD_LIMIT + 4]:
                return "request head too large"
        block = head.partition(b"\r\n\r\n")[0]
        lines = block.split(b"\r\n")
        if len(lines) > HEAD_LINES + 1:
            return f"more than {HEAD_LINES} header lines"
        if any(len(line) > LINE_LIMIT for line in lines):
            return f"a header line over {LINE_LIMIT} bytes"
        return head

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(HEAD_TIMEOUT_S)  # the request head must come in time; then no timeout
        try:
            head = self._read_head(conn)
            if head is None:
                conn.close()
                return
            if isinstance(head, str):
                return self._answer(conn, "431 Request Header Fields Too Large", head)
            block, _, extra = head.partition(b"\r\n\r\n")  # extra: what the client sent past the head
            line, _, header_block = block.partition(b"\r\n")
            parts = line.decode("latin-1").split()
            if len(parts) != 3:
                return self._refuse(conn, "not an HTTP proxy request")
            method, target, version = parts
            if method == "CONNECT":
                host, _, port_s = target.rpartition(":")
                host = host.strip("[]")
            elif target.startswith("http://"):
                hostport = target[7:].split("/", 1)[0]
                if hostport.startswith("["):
                    host, _, port_s = hostport[1:].partition("]")
                    port_s = port_s.lstrip(":")
                else:
                    host, _, port_s = hostport.partition(":")
                port_s = port_s or "80"
            else:
                return self._refuse(conn, f"{method} {target[:80]}: only CONNECT and absolute http:// requests are proxied")
            try:
                port = int(port_s)
                if not 0 < port < 65536 or not host:
                    raise ValueError
            except ValueError:
                return self._refuse(conn, f"bad host or port in {target[:80]}")
            registry = is_registry(host, self.allow)
            if not registry and PUBLIC not in self.allow:
                return self._refuse(conn, f"{host}:{port} is not a package registry this sandbox may reach "
                                          f"(allowed: {', '.join(self.allow) or 'none'} on ports 80/443)")
            if registry and port not in self.ports and PUBLIC not in self.allow:
                return self._refuse(conn, f"{host}:{port}: a package registry is reached on ports 80/443 only")
            if (host.lower(), port) in self.dead:
                return self._refuse(conn, self.dead[(host.lower(), port)] + " (asked again: answered at once)")
            try:
                if self.allow_private:
                    up = socket.create_connection((host, port), timeout=self.connect_timeout_s or 5)
                    up.settimeout(None)
                else:
                    up = connect_checked(host, port, registry=registry and port in self.ports,
                                         timeout_s=self.connect_timeout_s)
            except Refused as exc:
                return self._refuse(conn, str(exc))
            except TimeoutError as exc:
                self.dead[(host.lower(), port)] = str(exc) or f"{host}:{port} did not answer"
                return self._refuse(conn, self.dead[(host.lower(), port)])
            except OSError as exc:
                return self._answer(conn, "502 Bad Gateway", f"{host}:{port}: {exc}")
            self.passed.append(f"{host}:{port}")
            self.track(up)
            conn.settimeout(None)
            if method == "CONNECT":
                conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                if extra:
                    up.sendall(extra)
            else:
                path = "/" + target[7:].split("/", 1)[1] if "/" in target[7:] else "/"
                headers = [h for h in header_block.split(b"\r\n")
                           if h and not h.lower().startswith((b"connection:", b"proxy-", b"keep-alive:"))]
                up.sendall(f"{method} {path} {version}\r\n".encode() + b"".join(h + b"\r\n" for h in headers)
                           + b"Connection: close\r\n\r\n" + extra)
            splice(conn, up)
        except OSError:
            pass
