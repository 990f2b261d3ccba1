"""The only way out of a sandbox besides the model: an HTTP proxy that lets through the package
registries Polar is configured with, and nothing else. Build steps and the verifier install
packages (pip, uv, apt, npm); the agent phase never gets it (it reaches only the model).

It listens on a job-private Unix socket (no host port at all, so nothing but that sandbox can use
it), relayed inside to ``127.0.0.1:<port>``, which the phase's ``HTTP(S)_PROXY`` names. A request
is let through when its host is one of the registries (or a subdomain of one) and its port is
80 or 443; the address the name resolves to must not be loopback, link-local or one of this
host's own, so neither a name that resolves to 127.0.0.1 nor the host's own address reaches the
model proxy's control API or vLLM's ``/pause`` and ``/update_weights``. Everything else gets ``403``
with a sentence that says why, which pip, apt and curl print. TLS stays end to end (``CONNECT``);
plain HTTP (apt's mirrors) is forwarded one request per connection.

The registries: ``DEFAULT_REGISTRIES``, or the comma-separated ``POLAR_SANDBOX_REGISTRIES``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from pathlib import Path

from polar_runtime.sandbox.relay import UnixListener, splice

#: PyPI (pip, uv), the npm registry, Debian's mirrors; what a Harbor task's build and tests install from
DEFAULT_REGISTRIES = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "deb.debian.org",
                      "security.debian.org")
PORTS = (80, 443)
HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT_S = 15.0


def registries() -> tuple[str, ...]:
    raw = os.environ.get("POLAR_SANDBOX_REGISTRIES")
    if raw is None:
        return DEFAULT_REGISTRIES
    return tuple(h.strip().lower().rstrip(".") for h in raw.split(",") if h.strip())


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


def allowed_host(host: str, allow: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return any(host == a or host.endswith("." + a) for a in allow)


def _reachable_target(addr: str) -> bool:
    """Not loopback, link-local, unspecified or multicast, and not an address of this host (vLLM
    and the proxy may listen on all interfaces): a bind to it fails unless it is one of ours. A
    private address (a registry mirror on the user's network) is allowed."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return False
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
            return False  # one of this host's own addresses
        except OSError:
            return True


class EgressProxy(UnixListener):
    """A filtering HTTP proxy on ``path`` (a Unix socket, 0600). ``allow_private`` (any address,
    loopback included) exists for the tests alone: their allowed host is a listener they started."""

    def __init__(self, path: Path, allow: tuple[str, ...], *, allow_private: bool = False,
                 ports: tuple[int, ...] = PORTS):
        self.allow, self.allow_private, self.ports = tuple(allow), allow_private, ports
        self.refused: list[str] = []
        self.passed: list[str] = []
        super().__init__(path, "egress")

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused.append(why)
        body = f"Polar sandbox: {why}\n".encode()
        with contextlib.suppress(OSError):
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.close()

    def _connect(self, host: str, port: int) -> socket.socket:
        """A connection to the first public address of ``host`` (never a loopback/private one)."""
        last: Exception | None = None
        for fam, typ, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            if not self.allow_private and not _reachable_target(addr[0]):
                last = PermissionError(f"{host} resolves to {addr[0]}, this host or its loopback")
                continue
            s = socket.socket(fam, typ, proto)
            s.settimeout(20)
            try:
                s.connect(addr)
                s.settimeout(None)
                return s
            except OSError as exc:
                s.close()
                last = exc
        raise last or OSError(f"{host}: no address")

    def handle(self, conn: socket.socket) -> None:
        conn.settimeout(HEAD_TIMEOUT_S)  # the request head must come in time; then no timeout
        try:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    conn.close()
                    return
                head += chunk
                if len(head) > HEAD_LIMIT:
                    return self._refuse(conn, "request head too large")
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
                host, _, port_s = hostport.partition(":")
                port_s = port_s or "80"
            else:
                return self._refuse(conn, f"{method} {target[:80]}: only CONNECT and absolute http:// requests are proxied")
            try:
                port = int(port_s)
            except ValueError:
                return self._refuse(conn, f"bad port in {target[:80]}")
            if not allowed_host(host, self.allow) or port not in self.ports:
                return self._refuse(conn, f"{host}:{port} is not a package registry this sandbox may reach "
                                          f"(allowed: {', '.join(self.allow) or 'none'} on ports 80/443)")
            try:
                up = self._connect(host, port)
            except PermissionError as exc:
                return self._refuse(conn, str(exc))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    conn.sendall(f"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\n\r\n{exc}\n".encode())
                conn.close()
                return
            self.passed.append(f"{host}:{port}")
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
            self.track(up)
            splice(conn, up)
        except OSError:
            pass
