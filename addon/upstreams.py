"""The inference servers behind the proxy: choice, stickiness, health and backoff; what each one
serves (``model_info``); and the loopback relay that streams their answers (below).

Why sticky: consecutive calls of one harness run share a long prompt prefix; sending them to the
same server reuses its prefix cache. New sessions go to the least-loaded server (in-flight calls;
ties: fewer pinned sessions, then the order of ``polar_upstream``, so the choice is deterministic).
A server that refuses connections or answers 5xx is taken out and retried after an exponential
backoff; when every server is out, the one due soonest is tried anyway (the call is the probe).
A session whose server is out moves to another one and stays there (``pick`` leaves the server it
left in ``moved_from``; the record of a call that moved says so, since that server's prefix cache
is lost: not on a session's first call, which was pinned a moment before and has no cache yet). The
move costs no token fidelity: the prompt ids of every call come from the server that answered it,
and in exact-history mode the spliced ids come from the proxy's ledger, not from a server.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from polar_proxy import jsonutil


#: how a record's translation note says that its session left the server it was pinned to
SESSION_MOVED = "session moved"


def normalize_url(url: str) -> str:
    """``host:port`` or ``http://host:port/`` or ``http://host:port/v1`` -> ``http://host:port``."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) upstream URL: {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{host}:{port}{path}"


def parse_upstreams(value: str) -> list[str]:
    urls = [normalize_url(u) for u in value.split(",") if u.strip()]
    if len(set(urls)) != len(urls):
        raise ValueError(f"duplicate upstreams in {value!r}")
    return urls


@dataclass
class Upstream:
    url: str
    in_flight: int = 0
    healthy: bool = True
    failures: int = 0  # consecutive
    retry_at: float = 0.0
    last_error: str | None = None
    calls: int = 0
    errors: int = 0
    served_model: str | None = None
    max_model_len: int | None = None
    #: where the server's sampling defaults come from (engines.vllm.server_sampling); None: not asked yet
    sampling_server: dict[str, Any] | None = None
    sessions: int = 0  # sessions currently pinned here

    @property
    def host_port(self) -> tuple[str, int]:
        p = urlsplit(self.url)
        return p.hostname or "", p.port or (443 if p.scheme == "https" else 80)

    def status(self) -> dict:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "calls": self.calls,
            "errors": self.errors,
            "failures": self.failures,
            "retry_in": max(0.0, round(self.retry_at - time.monotonic(), 3)) if not self.healthy else 0.0,
            "last_error": self.last_error,
            "served_model": self.served_model,
            "max_model_len": self.max_model_len,
            "sessions": self.sessions,
        }


@dataclass
class UpstreamPool:
    urls: list[str]
    backoff_base: float = 0.5
    backoff_max: float = 30.0
    max_sticky: int = 100_000
    upstreams: list[Upstream] = field(init=False)
    _sticky: OrderedDict[str, Upstream] = field(init=False, default_factory=OrderedDict)
    #: set by every ``pick``: the server the session was pinned to and has just left, else None
    moved_from: Upstream | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("at least one upstream is needed")
        self.upstreams = [Upstream(u) for u in self.urls]

    def _eligible(self, up: Upstream, now: float) -> bool:
        return up.healthy or now >= up.retry_at

    def pick(self, session_id: str | None, exclude: set[str] | frozenset[str] = frozenset()) -> Upstream:
        """The server for this session's next call (sticky while healthy, else least loaded)."""
        now = time.monotonic()
        self.moved_from = pinned = None
        if session_id is not None:
            pinned = self._sticky.get(session_id)
            if pinned is not None and pinned.url not in exclude and self._eligible(pinned, now):
                self._sticky.move_to_end(session_id)
                return pinned
        candidates = [u for u in self.upstreams if u.url not in exclude and self._eligible(u, now)]
        if candidates:
            # Least in-flight; ties go to the one with fewer pinned sessions, then list order.
            up = min(candidates, key=lambda u: (not u.healthy, u.in_flight, u.sessions))
        else:
            rest = [u for u in self.upstreams if u.url not in exclude] or self.upstreams
            up = min(rest, key=lambda u: u.retry_at)
        if session_id is not None:
            if pinned is not None and pinned is not up:
                self.moved_from = pinned
            self._pin(session_id, up)
        return up

    def _pin(self, session_id: str, up: Upstream) -> None:
        old = self._sticky.get(session_id)
        if old is up:
            return
        if old is not None:
            old.sessions -= 1
        self._sticky[session_id] = up
        self._sticky.move_to_end(session_id)
        up.sessions += 1
        while len(self._sticky) > self.max_sticky:
            _, gone = self._sticky.popitem(last=False)
            gone.sessions -= 1

    def acquire(self, up: Upstream) -> None:
        up.in_flight += 1
        up.calls += 1

    def release(self, up: Upstream) -> None:
        up.in_flight = max(0, up.in_flight - 1)

    def mark_ok(self, up: Upstream) -> None:
        up.healthy = True
        up.failures = 0
        up.retry_at = 0.0

    def mark_failed(self, up: Upstream, error: str) -> None:
        """Take the server out; it becomes eligible again after an exponential backoff."""
        up.errors += 1
        up.failures += 1
        up.healthy = False
        up.last_error = error
        delay = min(self.backoff_max, self.backoff_base * (2 ** (up.failures - 1)))
        up.retry_at = time.monotonic() + delay

    def forget_session(self, session_id: str) -> None:
        up = self._sticky.pop(session_id, None)
        if up is not None:
            up.sessions -= 1

    def by_host_port(self) -> set[tuple[str, int]]:
        return {u.host_port for u in self.upstreams}

    def status(self) -> list[dict]:
        return [u.status() for u in self.upstreams]


async def model_info(http: aiohttp.ClientSession, up: Upstream, want: str, timeout: aiohttp.ClientTimeout) -> None:
    """Served model name and max_model_len from the upstream's /v1/models (cached per upstream).

    ``want``: the served model name the proxy was told (``polar_served_model``); empty: the first listed."""
    if up.served_model is not None:
        return
    async with http.get(up.url + "/v1/models", timeout=timeout) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                              message=f"/v1/models answered {resp.status}")
        data = orjson.loads(await resp.read()).get("data") or []
    card = next((c for c in data if c.get("id") == want), data[0] if data else {})
    up.served_model = want or card.get("id") or ""
    up.max_model_len = card.get("max_model_len")
    if not up.served_model:
        raise aiohttp.ClientError("upstream serves no model")
    up.sampling_server = await sampling_server(http, up, timeout)


async def sampling_server(http: aiohttp.ClientSession, up: Upstream, timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
    """Where the server's sampling defaults come from and which logprobs it returns (vLLM dev mode's
    ``/server_info``; see ``engines.vllm.server_sampling``); unknown when the server does not say."""
    from .engines.vllm import server_sampling

    try:
        async with http.get(up.url + "/server_info?config_format=json", timeout=timeout) as resp:
            info = orjson.loads(await resp.read()) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        info = None
    return server_sampling(info if isinstance(info, dict) else None)


# ----------------------------------------------------------------------------------------------
# The stream relay: how a streamed answer gets from the upstream to mitmproxy under our control.
#
# mitmproxy can only stream a response that comes from a server connection, and when that
# connection fails or stalls it answers with its own HTML 502 or just cuts the client off. So the
# addon performs the upstream exchange itself (aiohttp, with timeouts, health tracking and
# failover) and points the flow at this loopback relay, which replays the upstream's SSE bytes as
# they arrive. When the upstream stalls past the timeout or breaks mid-stream, the relay ends its
# response with one marker event that the flow's stream translator turns into the provider's own
# in-stream error. The relay lives in mitmproxy's event loop, in the same process.
# ----------------------------------------------------------------------------------------------

RELAY_TICKET_HEADER = "x-polar-relay-ticket"
RELAY_ERROR_EVENT = b"polar-relay-error"


def relay_error_event(kind: str, message: str) -> bytes:
    return b"event: " + RELAY_ERROR_EVENT + b"\ndata: " + jsonutil.dumps({"kind": kind, "message": message}) + b"\n\n"


class StreamRelay:
    """A minimal HTTP/1.1 server on loopback that serves registered upstream streams by ticket.

    ``pump(ticket, write)`` is supplied by the addon: it copies the upstream body with
    ``write(data, end=False)`` and returns when done (having written an error event itself when
    the upstream failed); False means the mitmproxy side went away.
    """

    def __init__(self, pump: Callable[..., Awaitable[bool]]):
        self._pump = pump
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1") -> None:
        self._server = await asyncio.start_server(self._handle, host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                headers = _head_fields(head)
                length = int(headers.get(b"content-length") or 0)
                if length:
                    await reader.readexactly(length)
                out = _RelayAnswer(writer, close=headers.get(b"connection", b"").lower() == b"close")
                ticket = headers.get(_TICKET, b"").decode("ascii", "replace")
                if not await self._pump(ticket, out.write):
                    return  # the mitmproxy side went away: drop the connection
                if not out.ended:
                    await out.write(b"", True)
                if out.close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


_TICKET = RELAY_TICKET_HEADER.encode()


def _head_fields(head: bytes) -> dict[bytes, bytes]:
    """Lower-cased header names -> values of a request head (the request line skipped)."""
    fields: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return fields


class _RelayAnswer:
    """One chunked answer of the relay: the head rides with the first write, the terminator with
    the last, so an answer that is already complete leaves in a single ``send``."""

    __slots__ = ("writer", "close", "pending", "ended")

    def __init__(self, writer: asyncio.StreamWriter, close: bool):
        self.writer = writer
        self.close = close
        self.ended = False
        self.pending = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                        b"transfer-encoding: chunked\r\n" + (b"connection: close\r\n" if close else b"") + b"\r\n")

    async def write(self, data: bytes, end: bool = False) -> None:
        if self.ended:
            return
        parts = [self.pending] if self.pending else []
        self.pending = b""
        if data:
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
        if end:
            parts.append(b"0\r\n\r\n")
            self.ended = True
        if parts:
            self.writer.write(b"".join(parts))
            await self.writer.drain()
