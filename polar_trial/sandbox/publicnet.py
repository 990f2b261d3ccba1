"""Which addresses a sandbox's egress may reach, and how a name becomes one.

Build steps (and, under ``allow_internet = true`` with the run's flag, the agent phase) reach
*public* hosts through the egress proxy (``egress.py``). A public host is one whose resolved
address is global unicast: never loopback, link-local, private (RFC 1918, unique-local
``fc00::/7``, site-local ``fec0::/10``), carrier-grade NAT (``100.64.0.0/10``), unspecified
(``0.0.0.0``, ``::``), multicast, broadcast, documentation or otherwise reserved, nor an IPv4
address smuggled in an IPv6 one (v4-mapped ``::ffff:a.b.c.d``, v4-compatible ``::a.b.c.d``,
6to4 ``2002::/16``, Teredo, NAT64 ``64:ff9b::/96``: the v4 address inside is checked), nor any
address of this host (a bind to it succeeds: vLLM, the model proxy and its control API listen
on this host, on loopback or on every interface with ``--listen-host 0.0.0.0``).

The check is made on the address the name resolved to, once, and the proxy then connects to
that very address (``connect_checked``): a DNS answer that changes between a check and a second
lookup (DNS rebinding) never reaches anything, because there is no second lookup.

The registries the operator configures (``POLAR_SANDBOX_REGISTRIES``) are the operator's
choice: they may resolve to a private address (a mirror on the user's network), never to
loopback, link-local, unspecified, multicast or this host's own.

Names of RFC 6761's special-use domains (``.example``, ``.test``, ``.invalid``, ``.localhost``,
and ``.local``/``.internal``/``.home.arpa``) are refused without a lookup as public hosts: none is
one, and no query about them leaves this machine (a registry the operator names may be one).

Tests reach a fake "public" host through :func:`fake_public_hosts`, an in-process override that only
a pytest process can set (it raises elsewhere). Nothing a task controls reaches it: the proxy runs
in Polar's process, a task's ``ENV`` or ``[environment.env]`` only reaches the sandbox's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Iterator

#: in an allow list: any public host (the build's network, the agent's under allow_internet)
PUBLIC = "*"
#: a host that does not answer fails within this many seconds, naming it, instead of holding a
#: build step until its whole timeout (a build's default is 600 s)
CONNECT_TIMEOUT_S = 5.0
#: mail ports: a public host is reached on any port but these (a hostile build sends no spam)
REFUSED_PUBLIC_PORTS = (25, 465, 587)
SPECIAL_DOMAINS = ("example", "test", "invalid", "localhost", "local", "internal", "home.arpa", "localdomain")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SITE_LOCAL = ipaddress.ip_network("fec0::/10")

_override: dict | None = None


class Refused(PermissionError):
    """The egress policy refuses this destination (the message says why)."""


def embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, compatible, 6to4, Teredo client, NAT64)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # ::a.b.c.d (deprecated v4-compatible)
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def not_public(addr: str) -> str | None:
    """Why ``addr`` is not a public unicast address (None when it is). This host's own addresses
    are checked separately (:func:`this_host`)."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.version == 6:
        inner = embedded_v4(ip)
        if inner is not None:
            why = not_public(str(inner))
            return f"{why} inside an IPv6 address" if why else None
        if ip in _SITE_LOCAL:
            return "a site-local address"
    for what, hit in (("an unspecified address", ip.is_unspecified), ("a loopback address", ip.is_loopback),
                      ("a link-local address", ip.is_link_local), ("a multicast address", ip.is_multicast),
                      ("a carrier-grade NAT address", ip.version == 4 and ip in _CGNAT),
                      ("a private address", ip.is_private), ("a reserved address", ip.is_reserved)):
        if hit:
            return what
    if not ip.is_global:
        return "a non-global address"
    return None


def not_for_registry(addr: str) -> str | None:
    """Why a configured registry may not be reached at ``addr`` (a private mirror may)."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    if ip.version == 6 and embedded_v4(ip) is not None:
        return not_for_registry(str(embedded_v4(ip)))
    for what, hit in (("an unspecified address", ip.is_unspecified), ("a loopback address", ip.is_loopback),
                      ("a link-local address", ip.is_link_local), ("a multicast address", ip.is_multicast)):
        if hit:
            return what
    return None


def this_host(addr: str) -> bool:
    """Whether ``addr`` is one of this host's own (a bind to it succeeds only then)."""
    ip = ipaddress.ip_address(addr.split("%")[0])
    fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(fam, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
            return True
        except OSError:
            return False


def special_name(host: str) -> bool:
    host = host.lower().rstrip(".")
    return any(host == d or host.endswith("." + d) for d in SPECIAL_DOMAINS)


def resolve(host: str, port: int, timeout_s: float | None = None, *, registry: bool = False) -> list[tuple[int, tuple]]:
    """(family, sockaddr) for each address of ``host``: the test override's when a test set one,
    the literal itself for an IP, else the system resolver's. Raises :class:`Refused` for a
    special-use name (no lookup at all)."""
    ov = _override
    if ov is not None and host.lower() in ov["hosts"]:
        ov["lookups"][host.lower()] = ov["lookups"].get(host.lower(), 0) + 1
        answer = ov["hosts"][host.lower()]
        return [_sockaddr(a, port) for a in (answer() if callable(answer) else answer)]
    try:
        ipaddress.ip_address(host.split("%")[0])
        return [_sockaddr(host, port)]
    except ValueError:
        pass
    if special_name(host) and not registry:  # a registry mirror the operator names may be mirror.internal
        raise Refused(f"{host} is a special-use name (RFC 6761), never a public host")
    out = []
    for fam, _, _, _, sa in _lookup(host, port, timeout_s if timeout_s is not None else CONNECT_TIMEOUT_S):
        if (fam, sa) not in out:
            out.append((fam, sa))
    return out


def _lookup(host: str, port: int, timeout_s: float) -> list:
    """``getaddrinfo`` within ``timeout_s`` (a resolver that does not answer would hold the phase for
    its own timeouts and attempts: 10 s and more), in a daemon thread left to finish on its own."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["r"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            box["e"] = exc
        done.set()

    threading.Thread(target=run, name="egress-dns", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{host}: no DNS answer within {timeout_s:g} s")
    if "e" in box:
        raise OSError(f"{host}: {box['e']}")
    return box["r"]


def _sockaddr(addr: str, port: int) -> tuple[int, tuple]:
    ip = ipaddress.ip_address(addr.split("%")[0])
    return (socket.AF_INET6, (addr, port, 0, 0)) if ip.version == 6 else (socket.AF_INET, (addr, port))


def check(addr: str, *, registry: bool) -> str | None:
    """Why the egress may not connect to ``addr`` (None: it may)."""
    ov = _override
    if ov is not None and addr in ov["public"]:
        return None  # a test's fake public host (a listener it started on loopback)
    why = not_for_registry(addr) if registry else not_public(addr)
    if why is None and this_host(addr):
        why = "an address of this host"
    return why


def connect_checked(host: str, port: int, *, registry: bool,
                    timeout_s: float | None = None) -> socket.socket:
    """A TCP connection to ``host``: resolved once, each address checked, the first allowed one
    connected to as resolved (pinned). Raises :class:`Refused` naming the address when none is
    allowed, ``TimeoutError`` naming the host when none answers within the connect timeout
    (``CONNECT_TIMEOUT_S`` for all its addresses together), ``OSError`` otherwise."""
    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    if not registry and port in REFUSED_PUBLIC_PORTS:
        raise Refused(f"{host}:{port}: mail ports are not reachable from a sandbox")
    deadline = time.monotonic() + timeout_s
    addrs = resolve(host, port, timeout_s, registry=registry)
    refused, last = [], None
    for fam, sa in addrs:
        why = check(sa[0], registry=registry)
        if why:
            refused.append(f"{sa[0]} ({why})")
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            break
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(left)
        try:
            s.connect(sa)
            s.settimeout(None)
            return s
        except TimeoutError:
            s.close()
            last = TimeoutError(f"{host}:{port} did not answer within {timeout_s:g} s")
        except OSError as exc:
            s.close()
            last = OSError(f"{host}:{port} ({sa[0]}): {exc.strerror or exc}")
    if last is not None:
        raise last
    if refused:
        raise Refused(f"{host} resolves to {', '.join(refused)}: not reachable from a sandbox")
    if addrs:
        raise TimeoutError(f"{host}:{port} did not answer within {timeout_s:g} s")
    raise OSError(f"{host}: no address")


@contextlib.contextmanager
def fake_public_hosts(hosts: dict, public: set[str] = frozenset()) -> Iterator[dict]:
    """Tests only: resolve ``hosts`` (name -> addresses, or a callable answering each lookup: a
    rebinding resolver) without DNS, and treat the addresses in
    ``public`` as public (a listener the test started on loopback stands in for a public host).
    Yields the override, whose ``lookups`` counts resolutions per name. Raises outside pytest."""
    global _override
    if "pytest" not in sys.modules:
        raise RuntimeError("publicnet.fake_public_hosts is for the test suite only")
    prev = _override
    _override = {"hosts": {k.lower(): v if callable(v) else list(v) for k, v in hosts.items()},
                 "public": set(public), "lookups": {}}
    try:
        yield _override
    finally:
        _override = prev
