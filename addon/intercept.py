"""Which traffic is a model call: the hosts intercepted in regular mode, and who may use the
control API.

In reverse mode every request is for the upstream. In regular mode (HTTPS_PROXY) only the hosted
model APIs (``polar_intercept_hosts``), the upstreams themselves and the proxy's own address are
intercepted; TLS to any other host stays an opaque tunnel, never decrypted.
"""

from __future__ import annotations

from collections.abc import Iterable

from mitmproxy import http
from mitmproxy.proxy import mode_specs

from .upstreams import UpstreamPool

DEFAULT_INTERCEPT_HOSTS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost")


class Interception:
    """The intercepted hosts (exact ``host`` / ``host:port``, or ``*.domain`` suffixes)."""

    def __init__(self, hosts: Iterable[str] = DEFAULT_INTERCEPT_HOSTS) -> None:
        self.hosts: set[str] = set()
        self.suffixes: tuple[str, ...] = ()
        self.set_hosts(hosts)

    def set_hosts(self, values: Iterable[str]) -> None:
        """Replace the host list; ValueError (and nothing changed) on a malformed entry."""
        hosts, suffixes = set(), []
        for h in values:
            h = h.strip().lower()
            if not h or any(c in h for c in "/ "):
                raise ValueError(f"bad host {h!r}")
            if h.startswith("*."):
                suffixes.append(h[1:])
            else:
                hosts.add(h)
        self.hosts, self.suffixes = hosts, tuple(suffixes)

    def host(self, host: str, port: int, flow: http.HTTPFlow | None, pool: UpstreamPool | None) -> bool:
        """Is a request to ``host:port`` intercepted (a listed host, an upstream, the proxy itself)?"""
        host = (host or "").lower().strip("[]")
        if host in self.hosts or f"{host}:{port}" in self.hosts:
            return True
        if any(host.endswith(s) for s in self.suffixes):
            return True
        if pool is not None and (host, port) in pool.by_host_port():
            return True
        if flow is not None:
            sock = flow.client_conn.sockname
            if sock and port == sock[1] and (host in LOOPBACK or host == sock[0]):
                return True  # addressed to the proxy itself
        return False

    def flow(self, flow: http.HTTPFlow, pool: UpstreamPool | None) -> bool:
        if isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            return True
        return self.host(flow.request.host, flow.request.port, flow, pool)

    def control_allowed(self, flow: http.HTTPFlow, pool: UpstreamPool | None) -> bool:
        """The control API answers loopback clients only, addressed to the proxy (or an intercepted host)."""
        peer = flow.client_conn.peername
        if not peer or peer[0] not in LOOPBACK:
            return False
        if isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            return True
        host = flow.request.host.lower()
        return host in LOOPBACK or host == "polar" or self.host(flow.request.host, flow.request.port, flow, pool)
