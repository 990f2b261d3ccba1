"""The Polar mitmproxy addon: every model call of an unmodified harness, captured at the token level.

Per intercepted request (hooks named after mitmproxy events):

``request``   control API (``/_polar/...``), side calls (model lists, token counts), provider
              detection and normalization (translators), session resolution, the pause gate,
              then the upstream exchange, performed by the addon itself (aiohttp) so that refused
              connections, 5xx, 429 and timeouts become errors in the harness's own shape.
              Non-streaming and ``synthetic`` answers are set on the flow right there; a true
              stream is handed to the loopback relay (see ``upstreams.StreamRelay``), unless it
              has wholly arrived already (a proxy that is behind): then it is translated and
              answered in one piece (``polar_stream_at_once``).
``responseheaders``  for relayed streams, installs the stream translator as
              ``flow.response.stream``: chat SSE in, the provider's SSE out, chunk by chunk, token
              ids and logprobs collected from every chunk.
``error``     a client that went away mid-call still leaves a record with what was sampled;
``client_disconnected`` does the same at once for calls still waiting on the upstream.

Each call's record is written (one line, one ``os.write``) before the harness gets its last byte;
nothing of a finished call stays in memory. Flows carry Polar annotations (metadata, comment).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional

import aiohttp
import orjson

from polar_proxy import jsonutil
from mitmproxy import command, ctx, exceptions, http
from mitmproxy.net.http import status_codes
from mitmproxy.proxy import mode_specs

from polar_analysis.schema import CallRecord, valid_session_id
from polar_runtime import paths

from . import budget, sampling
from .capture import CaptureError, CaptureWriter
from .engines import ENGINES, TokenData, get_engine
from .engines.base import Engine
from .exact_history import ExactHistory
from .providers import media
from .providers.base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .sessions import (
    SECRET_HEADERS,
    SECRET_QUERY,
    SessionError,
    harness_name,
    resolve_session,
    scrub_query_string,
)
from .upstreams import (
    RELAY_ERROR_EVENT,
    RELAY_TICKET_HEADER,
    StreamRelay,
    Upstream,
    UpstreamPool,
    parse_upstreams,
    relay_error_event,
)

log = logging.getLogger("polar")

DEFAULT_INTERCEPT_HOSTS = ("api.openai.com", "api.anthropic.com", "generativelanguage.googleapis.com")
STREAM_MODES = ("passthrough", "synthetic")
CONTROL_PREFIX = "/_polar/"
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost")
_CONTEXT_MARKERS = ("maximum context length", "context length", "longer than the maximum model length",
                    "prompt is too long", "too many tokens", "exceeds the model")


def _providers() -> tuple[dict[str, Provider], Any]:
    """The translators' registry (written concurrently by another area; imported lazily)."""
    from . import providers as pkg

    registry = getattr(pkg, "PROVIDERS", {}) or {}
    if not isinstance(registry, dict):
        registry = {p.name: p for p in registry}
    return registry, getattr(pkg, "detect_provider", None)


def _is_context_error(message: str) -> bool:
    m = message.lower()
    return any(k in m for k in _CONTEXT_MARKERS)


class ChatAccumulator:
    """Output text, reasoning, tool calls, finish reason and usage of one chat answer (or stream)."""

    __slots__ = ("content", "reasoning", "tools", "finish_reason", "usage")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            r = delta.get("reasoning") or delta.get("reasoning_content")
            if r:
                self.reasoning.append(r)
            for tc in delta.get("tool_calls") or ():
                slot = self.tools.setdefault(tc.get("index", len(self.tools)), {"id": "", "name": "", "arguments": ""})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def feed_whole(self, response: dict[str, Any]) -> None:
        self.usage = response.get("usage") or {}
        for choice in response.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            msg = choice.get("message") or {}
            if msg.get("content"):
                self.content.append(msg["content"] if isinstance(msg["content"], str) else jsonutil.dumps(msg["content"]).decode())
            r = msg.get("reasoning") or msg.get("reasoning_content")
            if r:
                self.reasoning.append(r)
            for i, tc in enumerate(msg.get("tool_calls") or ()):
                fn = tc.get("function") or {}
                self.tools[i] = {"id": tc.get("id") or "", "name": fn.get("name") or "", "arguments": fn.get("arguments") or ""}
            self.finish_reason = choice.get("finish_reason")

    def fill(self, rec: CallRecord) -> None:
        rec.output_text = "".join(self.content)
        rec.output_reasoning = "".join(self.reasoning)
        rec.output_tool_calls = [self.tools[k] for k in sorted(self.tools)]
        rec.finish_reason = self.finish_reason
        rec.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(self.usage.get("completion_tokens") or 0)


def synthetic_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat.completion replayed as the chunk sequence a streaming server would send."""
    base = {"id": response.get("id", ""), "object": "chat.completion.chunk", "created": response.get("created", 0),
            "model": response.get("model", "")}
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        chunks.append({**base, "choices": [{"index": 0, "delta": {"reasoning": reasoning}, "finish_reason": None}]})
    if msg.get("content"):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": msg["content"]}, "finish_reason": None}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": tc.get("id"), "type": "function",
             "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}}]}, "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason") or "stop"}]})
    if response.get("usage"):
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return chunks


class Call:
    """The state of one in-flight model call (dropped as soon as its record is written)."""

    def __init__(self, record: CallRecord, provider: Provider, flow: http.HTTPFlow):
        self.record = record
        self.provider = provider
        self.flow = flow
        self.tokens = TokenData()
        self.acc = ChatAccumulator()
        self.upstream: Upstream | None = None
        self.translator: StreamTranslator | None = None
        self.upstream_response: aiohttp.ClientResponse | None = None
        self.normalized: NormalizedCall | None = None
        self.ticket: str | None = None
        self.finalized = False
        self.stream_done = False  # [DONE] seen, or an error emitted: ignore what follows
        self.cancelled = False  # the harness went away: a broken upstream read is our doing
        self.native_size = 0  # bytes of the harness's request body
        self.max_tokens_sent: int | None = None  # None: the engine's default (the room left)
        self.relay_restore: tuple | None = None  # the request's own target and body while relayed


class SSEStream:
    """``flow.response.stream`` callable: upstream chat SSE bytes -> the provider's SSE bytes.

    Events may be split anywhere across chunks (even inside ``\\r\\n``), so bytes are buffered
    until a blank line ends an event. The capture record is written when ``[DONE]`` (or an error)
    arrives, before the closing bytes are returned to mitmproxy.
    """

    def __init__(self, addon: "Polar", call: Call):
        self.addon = addon
        self.call = call
        self.buf = bytearray()

    def __call__(self, data: bytes) -> list[bytes]:
        # A list, never b"": mitmproxy would send an empty bytes chunk to an HTTP/1 client as
        # "0\r\n\r\n", the end of a chunked body, and the harness would stop reading.
        call = self.call
        if data:
            self.buf += data
            out = self._drain()
        else:
            out = self._drain(final=True)
            if not call.stream_done:
                call.stream_done = True
                out += self.addon._stream_failed(call, "upstream_error", "upstream stream ended before [DONE]")
        return [out] if out else []

    def _drain(self, final: bool = False) -> bytes:
        # Scan from an offset and cut the consumed prefix once: deleting each event from the
        # front moved the rest of the buffer every time (quadratic on a 60 kB first chunk).
        out = bytearray()
        buf = self.buf
        pos = 0
        while True:
            end, sep_len = _event_end(buf, pos)
            if end < 0:
                break
            out += self._event(bytes(buf[pos:end]))
            pos = end + sep_len
        if pos:
            del buf[:pos]
        if final and buf.strip():
            event = bytes(buf)
            buf.clear()
            out += self._event(event)
        return bytes(out)

    def _event(self, event: bytes) -> bytes:
        call = self.call
        if call.stream_done:
            return b""
        name = b""
        if event.startswith(b"data:") and b"\n" not in event:  # the usual event: one data line
            payload = event[5:].lstrip(b" ").rstrip(b"\r")
        else:
            data_lines = []
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    data_lines.append(line[5:].lstrip(b" "))
                elif line.startswith(b"event:"):
                    name = line[6:].strip()
            if not data_lines:
                return b""
            payload = b"\n".join(data_lines)
        if name == RELAY_ERROR_EVENT:
            info = orjson.loads(payload)
            call.stream_done = True
            return self.addon._stream_failed(call, info.get("kind", "upstream_error"), info.get("message", ""))
        if payload[:1] != b"{" and payload.strip() == b"[DONE]":
            call.stream_done = True
            return self.addon._stream_finished(call)
        try:
            chunk = self.addon.engine.parse(payload, call.tokens)
        except orjson.JSONDecodeError:
            call.stream_done = True
            return self.addon._stream_failed(call, "upstream_error", f"malformed upstream chunk: {payload[:200]!r}")
        if "error" in chunk and not chunk.get("choices"):
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            call.stream_done = True
            msg = str(err.get("message", "upstream error"))
            return self.addon._stream_failed(call, "context_length" if _is_context_error(msg) else "upstream_error", msg)
        self.addon.engine.read_chunk(chunk, call.tokens)  # ids first: kept even if translation fails
        self.addon._budget_cut(call, chunk)
        try:
            call.acc.feed_chunk(chunk)
            assert call.translator is not None
            return call.translator.feed(chunk)
        except Exception as exc:  # a translator bug must end this stream cleanly, not the proxy
            log.warning(f"polar: {call.provider.name} stream translation failed: {exc!r}")
            call.stream_done = True
            return self.addon._stream_failed(call, "upstream_error", f"could not translate the stream: {exc}")


def _event_end(buf: bytearray, start: int = 0) -> tuple[int, int]:
    """Where the first event at or after ``start`` ends, and the length of the blank line after it
    (``\\n\\n``, ``\\r\\n\\r\\n`` or a mix); ``(-1, 0)`` while the event is incomplete.

    Looks for single ``\\n`` bytes (a memchr): a two-byte search is ~50x slower, and a first
    chunk carrying a 10k-token prompt's ids is 60 kB without one line break."""
    n = len(buf)
    i = buf.find(b"\n", start)
    while i >= 0:
        j = i + 1
        if j < n and buf[j] == 13:  # \r
            j += 1
        if j >= n:
            return -1, 0
        if buf[j] == 10:  # \n: a blank line
            end = i - 1 if i > start and buf[i - 1] == 13 else i
            return end, j + 1 - end
        i = buf.find(b"\n", j)
    return -1, 0


class Polar:
    """The addon. One instance per mitmproxy process."""

    def __init__(self) -> None:
        self.proxy_id = uuid.uuid4().hex[:12]
        self.writer: CaptureWriter | None = None
        self.pool: UpstreamPool | None = None
        self.engine: Engine = ENGINES["vllm"]
        self.timeout = 600.0
        self._timeout_obj: aiohttp.ClientTimeout | None = None
        self.pause_timeout = 0.0
        self.stream_mode = "passthrough"
        self.max_tokens_cap = 0
        self.sampling: dict[str, Any] = {}
        self.passthrough = False
        self.stream_at_once = True
        self.media_mode = "placeholder"
        self.intercept_hosts: set[str] = set(DEFAULT_INTERCEPT_HOSTS)
        self.intercept_suffixes: tuple[str, ...] = ()
        self.policy_version: int | None = None
        self.http: aiohttp.ClientSession | None = None
        self.relay: StreamRelay | None = None
        self._open = asyncio.Event()  # set = not paused
        self._open.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self.calls: dict[str, Call] = {}  # in flight, by flow id
        self.exact: ExactHistory | None = None  # polar_exact_history: token-in/token-out via the ledger
        self.tickets: dict[str, Call] = {}
        self.session_calls: OrderedDict[str, int] = OrderedDict()
        self.registry: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.conn_proxy_auth: dict[str, str] = {}
        self.stats = {"calls": 0, "errors": 0, "captured": 0, "capture_errors": 0, "streamed": 0, "streamed_at_once": 0,
                      "side_calls": 0, "passthrough": 0, "refused": 0, "waiting": 0}
        self.max_sessions = 100_000

    # -- options -----------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        loader.add_option("polar_upstream", str, "",
                          "Inference server base URL(s), comma-separated (e.g. http://127.0.0.1:8000). "
                          "Empty: the reverse-mode target.")
        loader.add_option("polar_served_model", str, "",
                          "Model name the upstream serves. Empty: ask the upstream's /v1/models.")
        loader.add_option("polar_engine", str, "vllm", "Inference engine dialect for token ids and logprobs.",
                          choices=sorted(ENGINES))
        loader.add_option("polar_capture_dir", str, "",
                          "Directory for capture records (<dir>/sessions/<session>.jsonl). "
                          "Empty: $POLAR_HOME/captures.")
        loader.add_option("polar_intercept_hosts", Sequence[str], list(DEFAULT_INTERCEPT_HOSTS),
                          "Hosts whose API calls are intercepted in regular mode (host, host:port or *.domain). "
                          "Calls addressed to an upstream or to the proxy itself are always intercepted.")
        loader.add_option("polar_passthrough", bool, True,
                          "Regular mode: pass traffic to other hosts through untouched (never captured). "
                          "False: refuse it.")
        loader.add_option("polar_stream_mode", str, "passthrough",
                          "passthrough: stream the upstream's tokens as they come; synthetic: call the upstream "
                          "non-streaming and replay the answer as a stream.", choices=list(STREAM_MODES))
        loader.add_option("polar_upstream_timeout", str, "600",
                          "Seconds to wait for the upstream's next byte (connect, headers, each stream chunk).")
        loader.add_option("polar_max_tokens_cap", int, 0,
                          "Upper bound for max_tokens sent upstream (0: only the context limit).")
        loader.add_option("polar_sampling", Optional[str], None,
                          "Sampling parameters enforced on every call, whatever the harness sends, e.g. "
                          "'temperature=1,top_p=1,top_k=-1,seed=7' (seed: a base, each call gets its own seed "
                          "derived from it, the session and the call index). Unset: the harness's (or vLLM's "
                          "generation-config defaults).")
        loader.add_option("polar_media", str, "placeholder",
                          "Images and documents in requests: placeholder (a short text in their place, for a "
                          "text-only served model) or pass (images reach a model that reads them).",
                          choices=list(media.MODES))
        loader.add_option("polar_fsync", bool, False, "fsync the capture file after every record (slow).")
        loader.add_option("polar_stream_at_once", bool, True,
                          "A stream that has wholly arrived when the proxy first looks (the proxy is behind) "
                          "is answered in one piece instead of through the relay (false: always relay).")
        loader.add_option("polar_pause", bool, False, "Hold new model calls (weights are being swapped).")
        loader.add_option("polar_pause_timeout", str, "0",
                          "Seconds a held call waits before an 'overloaded' error (0: wait for resume).")
        loader.add_option("polar_policy_version", int, -1,
                          "Policy (weights) version recorded with each call (-1: unknown).")
        loader.add_option("polar_proxy_id", str, "", "Identifier of this proxy in capture records (default: random).")
        loader.add_option("polar_exact_history", bool, False,
                          "Exact multi-turn history: prompt the model with its own sampled ids for every answer "
                          "the harness re-sends (vLLM render/generate/derender; vLLM needs --enable-scale-out). "
                          "Off: the chat template re-renders each answer from its text.")

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        # The options read on every call, kept as attributes (an option lookup is a few calls).
        self.stream_mode = o.polar_stream_mode
        self.max_tokens_cap = o.polar_max_tokens_cap
        self.passthrough = o.polar_passthrough
        self.stream_at_once = o.polar_stream_at_once
        self.media_mode = o.polar_media
        if "polar_upstream_timeout" in updated:
            self.timeout = _positive_float(o.polar_upstream_timeout, "polar_upstream_timeout")
        if "polar_pause_timeout" in updated:
            self.pause_timeout = _positive_float(o.polar_pause_timeout, "polar_pause_timeout", allow_zero=True)
        if "polar_engine" in updated:
            try:
                self.engine = get_engine(o.polar_engine)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "polar_sampling" in updated:
            try:
                self.sampling = sampling.parse(o.polar_sampling)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "polar_max_tokens_cap" in updated and o.polar_max_tokens_cap < 0:
            raise exceptions.OptionsError("polar_max_tokens_cap must be >= 0")
        if "polar_intercept_hosts" in updated:
            hosts, suffixes = set(), []
            for h in o.polar_intercept_hosts:
                h = h.strip().lower()
                if not h or any(c in h for c in "/ "):
                    raise exceptions.OptionsError(f"polar_intercept_hosts: bad host {h!r}")
                if h.startswith("*."):
                    suffixes.append(h[1:])
                else:
                    hosts.add(h)
            self.intercept_hosts, self.intercept_suffixes = hosts, tuple(suffixes)
        if "polar_upstream" in updated or "mode" in updated:
            value = o.polar_upstream or self._reverse_target()
            if value:
                try:
                    urls = parse_upstreams(value)
                except ValueError as exc:
                    raise exceptions.OptionsError(f"polar_upstream: {exc}") from None
                if self.pool is None or self.pool.urls != urls:
                    self.pool = UpstreamPool(urls)
            elif self.pool is None and "polar_upstream" in updated and o.polar_upstream == "" and self._is_regular():
                log.warning("polar: no polar_upstream set; model calls will be answered with errors")
        if "polar_capture_dir" in updated and o.polar_capture_dir:
            # An empty value means the default, created lazily (options may still be arriving).
            try:
                writer = CaptureWriter(o.polar_capture_dir, fsync=o.polar_fsync)
            except OSError as exc:
                raise exceptions.OptionsError(f"polar_capture_dir: {exc}") from None
            if self.writer is not None:
                self.writer.close()
            self.writer = writer
        if "polar_fsync" in updated and self.writer is not None:
            self.writer.fsync = o.polar_fsync
        if "polar_pause" in updated:
            self._set_paused(o.polar_pause)
        if "polar_policy_version" in updated:
            self.policy_version = None if o.polar_policy_version < 0 else o.polar_policy_version
        if "listen_host" in updated and o.listen_host == "":
            # mitmproxy's default is every interface; this proxy carries model traffic and its
            # control API: loopback unless asked for more (--listen-host 0.0.0.0).
            o.update(listen_host="127.0.0.1")
        if "polar_proxy_id" in updated and o.polar_proxy_id:
            if not valid_session_id(o.polar_proxy_id):
                raise exceptions.OptionsError("polar_proxy_id must match the session-id pattern")
            self.proxy_id = o.polar_proxy_id
        if "polar_exact_history" in updated or "polar_engine" in updated:
            if o.polar_exact_history and self.engine.name != "vllm":
                raise exceptions.OptionsError(f"polar_exact_history needs vLLM's render/generate/derender "
                                              f"endpoints; engine {self.engine.name!r} has none")
            if not o.polar_exact_history:
                self.exact = None
            elif self.http is not None and self.exact is None:
                self.exact = self._new_exact()
        if "polar_served_model" in updated and self.pool is not None:
            for up in self.pool.upstreams:
                up.served_model = None  # re-resolve on next call

    def _reverse_target(self) -> str:
        for spec in ctx.options.mode:
            try:
                mode = mode_specs.ProxyMode.parse(spec)
            except ValueError:
                continue
            if isinstance(mode, mode_specs.ReverseMode):
                scheme = "https" if mode.scheme in ("https", "tls", "dtls", "http3", "quic") else "http"
                host, port = mode.address
                return f"{scheme}://{host}:{port}"
        return ""

    def _is_regular(self) -> bool:
        return any(s.startswith("regular") for s in ctx.options.mode)

    async def running(self) -> None:
        if self.writer is None:
            self.writer = CaptureWriter(ctx.options.polar_capture_dir or paths.polar_home() / "captures",
                                        fsync=ctx.options.polar_fsync)
        if ctx.options.connection_strategy != "lazy":
            # Eager connections would dial api.anthropic.com at CONNECT time (unresolvable here) and,
            # in reverse mode, open an unused upstream connection per client. The addon never lets
            # mitmproxy talk to the upstream itself.
            ctx.options.update(connection_strategy="lazy")
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=True),
            json_serialize=lambda x: jsonutil.dumps(x).decode(),
            auto_decompress=True,
        )
        self.relay = StreamRelay(self._pump)
        await self.relay.start()
        if ctx.options.polar_exact_history:
            self.exact = self._new_exact()
        _tune_gc()
        log.info(f"polar: proxy {self.proxy_id} upstreams={self.pool.urls if self.pool else []} "
                 f"capture={self.writer.root if self.writer else None} relay=127.0.0.1:{self.relay.port}")

    def _new_exact(self) -> ExactHistory:
        assert self.http is not None
        return ExactHistory(self.http, capture_path=lambda sid: self.writer.path_for(sid) if self.writer else None)

    async def done(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        if self.http is not None:
            await self.http.close()
        if self.writer is not None:
            self.writer.close()

    # -- commands ----------------------------------------------------------------------------
    @command.command("polar.pause")
    def pause_cmd(self) -> None:
        """Hold new model calls until polar.resume."""
        self._set_paused(True)

    @command.command("polar.resume")
    def resume_cmd(self) -> None:
        """Release held model calls."""
        self._set_paused(False)

    @command.command("polar.status")
    def status_cmd(self) -> str:
        """Counters, pause state and upstream health as JSON."""
        return jsonutil.dumps(self.status()).decode()

    def _set_paused(self, paused: bool) -> None:
        if paused:
            self._open.clear()
        else:
            self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def status(self) -> dict[str, Any]:
        return {
            "proxy_id": self.proxy_id,
            "paused": self.paused,
            "policy_version": self.policy_version,
            "in_flight": len(self.calls),
            **self.stats,
            "sessions": len(self.session_calls),
            "engine": self.engine.name,
            "stream_mode": ctx.options.polar_stream_mode,
            "capture_dir": str(self.writer.root) if self.writer else None,
            "upstreams": self.pool.status() if self.pool else [],
            "exact_history": dict(self.exact.stats, ledger_sessions=len(self.exact.ledger.sessions),
                                  ledger_rebuilt=self.exact.ledger.rebuilt) if self.exact else None,
        }

    # -- connection-level hooks --------------------------------------------------------------
    def client_disconnected(self, client: Any) -> None:
        self.conn_proxy_auth.pop(client.id, None)
        # Calls of this connection still waiting on the upstream get no flow error until the
        # upstream answers; their records are written now instead.
        for call in [c for c in self.calls.values() if c.flow.client_conn.id == client.id]:
            if not call.finalized:
                self._client_gone(call, "client disconnected while the upstream was answering")

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode CONNECT: remember the proxy user (session) of the tunnel, refuse or let through."""
        auth = flow.request.headers.get("proxy-authorization")
        if auth:
            self.conn_proxy_auth[flow.client_conn.id] = auth
            del flow.request.headers["proxy-authorization"]
        if not self._host_intercepted(flow.request.host, flow.request.port, flow) and not ctx.options.polar_passthrough:
            self.stats["refused"] += 1
            flow.response = http.Response.make(403, b"polar: host not intercepted and passthrough disabled\n",
                                               {"content-type": "text/plain"})

    def tls_clienthello(self, data: Any) -> None:
        """Terminate TLS only for intercepted hosts; everything else stays an opaque tunnel."""
        if isinstance(data.context.client.proxy_mode, mode_specs.ReverseMode):
            return
        sni = data.client_hello.sni
        address = data.context.server.address
        host = sni or (address[0] if address else "")
        port = address[1] if address else 443
        if not self._host_intercepted(host, port, None):
            data.ignore_connection = True

    def _host_intercepted(self, host: str, port: int, flow: http.HTTPFlow | None) -> bool:
        host = (host or "").lower().strip("[]")
        if host in self.intercept_hosts or f"{host}:{port}" in self.intercept_hosts:
            return True
        if any(host.endswith(s) for s in self.intercept_suffixes):
            return True
        if self.pool is not None and (host, port) in self.pool.by_host_port():
            return True
        if flow is not None:
            sock = flow.client_conn.sockname
            if sock and port == sock[1] and (host in LOOPBACK or host == sock[0]):
                return True  # addressed to the proxy itself
        return False

    def _intercepted(self, flow: http.HTTPFlow) -> bool:
        if isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            return True
        return self._host_intercepted(flow.request.host, flow.request.port, flow)

    # -- the request hook --------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        path = flow.request.path
        if path.startswith(CONTROL_PREFIX) and self._control_allowed(flow):
            self._scrub(flow)  # saved flows (-w) must never hold a key, whatever the path
            await self._control(flow)
            return
        if not self._intercepted(flow):
            if not self.passthrough:
                self.stats["refused"] += 1
                self._scrub(flow)
                flow.response = http.Response.make(403, b"polar: host not intercepted\n", {"content-type": "text/plain"})
            else:
                self.stats["passthrough"] += 1
                flow.metadata["polar"] = {"passthrough": True}
            return
        await self._model_call(flow)

    def _control_allowed(self, flow: http.HTTPFlow) -> bool:
        peer = flow.client_conn.peername
        if not peer or peer[0] not in LOOPBACK:
            return False
        if isinstance(flow.client_conn.proxy_mode, mode_specs.ReverseMode):
            return True
        host = flow.request.host.lower()
        return host in LOOPBACK or host == "polar" or self._host_intercepted(flow.request.host, flow.request.port, flow)

    async def _model_call(self, flow: http.HTTPFlow) -> None:
        t_in = time.time()
        req = flow.request
        headers = header_dict(req.headers)
        query = dict(req.query.items(multi=False)) if "?" in req.path else {}
        native_path = scrub_query_string(req.path)
        path_only = req.path.split("?", 1)[0]
        self._scrub(flow)

        try:
            raw = req.get_content(strict=False) or b""
        except ValueError:
            raw = req.raw_content or b""
        body: Any = None
        body_error = None
        if raw:
            try:
                body = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                body_error = f"malformed JSON body: {exc}"

        registry, detect = _providers()
        if await self._side_call(flow, req.method, path_only, headers):
            return
        provider = None
        if detect is not None and body_error is None:
            try:
                provider = detect(req.method, path_only, headers, body)
            except Exception as exc:  # a translator bug must not take the proxy down
                log.warning(f"polar: provider detection failed: {exc!r}")
        if provider is None and body_error is not None:
            provider = self._guess_provider(path_only, headers, registry)
        if provider is not None and body_error is None and provider.side_call(req.method, path_only):
            await self._provider_side_call(flow, provider, provider.side_call(req.method, path_only), body,
                                           path_only, query)
            return

        try:
            session = resolve_session(headers, query, proxy_auth=self.conn_proxy_auth.get(flow.client_conn.id),
                                      connection_id=flow.client_conn.id)
        except SessionError as exc:
            self.stats["errors"] += 1
            self._answer_error(flow, provider or self._guess_provider(path_only, headers, registry), 400,
                               "invalid_request", exc.message)
            flow.metadata["polar"] = {"error": "invalid_session"}
            return

        if provider is None:
            self.stats["errors"] += 1
            guess = self._guess_provider(path_only, headers, registry)
            self._answer_error(flow, guess, 404, "not_found", f"polar: no model API at {req.method} {path_only}")
            flow.metadata["polar"] = {"error": "not_found", "session": session.id}
            return

        sid = session.id
        rec = CallRecord(
            call_id=os.urandom(16).hex(),
            session_id=sid,
            session_source=session.source,
            call_index=self._next_call_index(sid),
            provider=provider.name,
            engine=self.engine.name,
            harness=harness_name(headers),
            user_agent=headers.get("user-agent", ""),
            policy_version=self.policy_version,
            native_path=native_path,
            native_request=(jsonutil.raw_json(raw) or body) if isinstance(body, dict) else None,
            stream_mode=self.stream_mode,
            t_request_in=t_in,
            proxy_id=self.proxy_id,
        )
        reg = self.registry.get(sid) or {}
        if reg.get("harness") and not headers.get("x-polar-harness"):
            rec.harness = reg["harness"]  # the runner knows; the user agent may only name an SDK
        rec.task_id = headers.get("x-polar-task") or reg.get("task_id")
        rec.group_id = headers.get("x-polar-group") or reg.get("group_id")
        sample = headers.get("x-polar-sample", reg.get("sample_index"))
        try:
            rec.sample_index = int(sample) if sample is not None else None
        except ValueError:
            rec.sample_index = None
        call = Call(rec, provider, flow)
        call.native_size = len(raw)
        self.stats["calls"] += 1
        flow.metadata["polar"] = {"session": sid, "provider": provider.name, "call_index": rec.call_index,
                                  "call_id": rec.call_id, "native_url": scrub_query_string(req.pretty_url)}

        if body_error is not None:
            self._fail(call, 400, "invalid_request", body_error)
            return
        try:
            normalized = provider.to_chat(body, path_only, query)
        except ProviderError as exc:
            self._fail(call, exc.status, exc.kind, exc.message)
            return
        except Exception as exc:  # translator bug: answer, record, keep serving
            log.warning(f"polar: {provider.name}.to_chat failed: {exc!r}")
            self._fail(call, 400, "invalid_request", f"could not translate request: {exc}")
            return
        media.settle(normalized, self.media_mode)  # images: placeholders for a text-only model
        call.normalized = normalized
        rec.requested_model = normalized.requested_model or ""
        rec.stream = bool(normalized.stream)
        rec.translation_notes = list(normalized.notes)

        if not await self._wait_open():
            self._fail(call, 503, "overloaded", "proxy paused (weights update) longer than polar_pause_timeout")
            return
        rec.policy_version = self.policy_version  # the weights that will serve it (after the gate)
        self.calls[flow.id] = call
        self._drained.clear()
        try:
            await self._exchange(call, normalized)
        except Exception as exc:  # keep serving whatever happens in one call
            log.exception("polar: call failed")
            if not call.finalized and flow.response is None and call.relay_restore is None:
                if call.ticket is not None:  # failed before the flow was pointed at the relay
                    self.tickets.pop(call.ticket, None)
                    call.ticket = None
                self._fail(call, 502, "upstream_error", f"proxy error: {exc!r}")

    async def _wait_open(self) -> bool:
        if self._open.is_set():
            return True
        self.stats["waiting"] += 1
        try:
            if self.pause_timeout > 0:
                await asyncio.wait_for(self._open.wait(), self.pause_timeout)
            else:
                await self._open.wait()
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self.stats["waiting"] -= 1

    def _next_call_index(self, sid: str) -> int:
        n = self.session_calls.get(sid)
        if n is None:
            n = self.writer.existing_calls(sid) if self.writer else 0
        self.session_calls[sid] = n + 1
        self.session_calls.move_to_end(sid)
        while len(self.session_calls) > self.max_sessions:
            self.session_calls.popitem(last=False)
        return n

    # -- the upstream exchange ---------------------------------------------------------------
    def _client_timeout(self) -> aiohttp.ClientTimeout:
        t = self._timeout_obj  # built once per timeout value (this runs several times per call)
        if t is None or t.sock_read != self.timeout:
            t = self._timeout_obj = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.timeout,
                                                          sock_read=self.timeout)
        return t

    async def _model_info(self, up: Upstream) -> None:
        """Served model name and max_model_len from the upstream's /v1/models (cached per upstream)."""
        if up.served_model is not None:
            return
        want = ctx.options.polar_served_model
        assert self.http is not None
        async with self.http.get(up.url + "/v1/models", timeout=self._client_timeout()) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=f"/v1/models answered {resp.status}")
            data = orjson.loads(await resp.read()).get("data") or []
        card = next((c for c in data if c.get("id") == want), data[0] if data else {})
        up.served_model = want or card.get("id") or ""
        up.max_model_len = card.get("max_model_len")
        if not up.served_model:
            raise aiohttp.ClientError("upstream serves no model")

    def _prepare(self, call: Call, normalized: NormalizedCall, up: Upstream, stream_upstream: bool) -> dict[str, Any]:
        chat = dict(normalized.chat_request)
        chat["model"] = up.served_model
        requested = chat.pop("max_completion_tokens", None)
        requested = chat.pop("max_tokens", None) or requested
        # No guess at the prompt length: the engine knows it (see budget.py).
        call.max_tokens_sent = budget.output_budget(requested, self.max_tokens_cap, up.max_model_len)
        if call.max_tokens_sent is not None:
            chat["max_tokens"] = call.max_tokens_sent
        if self.sampling:
            sampling.apply(chat, self.sampling, call.record.session_id, call.record.call_index)
        if stream_upstream:
            chat["stream"] = True
            chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
        else:
            chat["stream"] = False
            chat.pop("stream_options", None)
        self.engine.prepare(chat)
        return chat

    async def _exchange(self, call: Call, normalized: NormalizedCall) -> None:
        rec = call.record
        if self.pool is None or self.http is None:
            self._fail(call, 502, "upstream_refused", "polar: no upstream configured (polar_upstream)")
            return
        stream_upstream = rec.stream and self.stream_mode == "passthrough"
        tried: set[str] = set()
        resp: aiohttp.ClientResponse | None = None
        last_error = "no upstream"
        while len(tried) < len(self.pool.upstreams):
            up = self.pool.pick(rec.session_id, exclude=tried)
            tried.add(up.url)
            try:
                await self._model_info(up)
            except asyncio.TimeoutError:
                self.pool.mark_failed(up, "timeout on /v1/models")
                last_error = f"upstream {up.url} did not answer /v1/models within {self.timeout:g}s"
                continue
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                self.pool.mark_failed(up, str(exc))
                how = "refused the connection" if isinstance(exc, aiohttp.ClientConnectorError) else "failed"
                last_error = f"upstream {up.url} {how}: {exc}"
                continue
            chat = self._prepare(call, normalized, up, stream_upstream)
            upstream_body = jsonutil.dumps(chat)
            rec.normalized_request = jsonutil.raw_json(upstream_body) or chat  # written as sent
            rec.served_model = up.served_model or ""
            rec.upstream = up.url
            call.upstream = up
            self.pool.acquire(up)
            rec.t_upstream_sent = time.time()
            try:
                if self.exact is not None:  # render, splice, generate, derender (exact_history.py)
                    resp = await self.exact.post(up.url, chat, rec, stream=stream_upstream, max_model_len=up.max_model_len,
                                                 timeout=self._client_timeout(), headers={"x-polar-session": rec.session_id})
                    if resp is not None:
                        break
                resp = await self.http.post(
                    up.url + "/v1/chat/completions", data=upstream_body,
                    headers={"content-type": "application/json", "x-polar-session": rec.session_id,
                             "x-request-id": rec.call_id,
                             "accept": "text/event-stream" if stream_upstream else "application/json"},
                    timeout=self._client_timeout(),
                )
                break
            except asyncio.TimeoutError:
                self.pool.mark_failed(up, "timeout")
                self._fail(call, 504, "timeout", f"upstream {up.url} did not answer within {self.timeout:g}s")
                return
            except aiohttp.ClientConnectorError as exc:  # refused: nothing ran, try another server
                self.pool.release(up)
                call.upstream = None
                self.pool.mark_failed(up, str(exc))
                last_error = f"upstream {up.url} refused the connection: {exc.os_error or exc}"
                continue
            except (aiohttp.ClientError, OSError) as exc:
                self.pool.mark_failed(up, str(exc))
                self._fail(call, 502, "upstream_refused", f"upstream {up.url} failed: {exc}")
                return
        if resp is None:
            self._fail(call, 502, "upstream_refused", last_error)
            return
        if call.finalized:  # the harness hung up while the upstream was working
            resp.close()
            return
        rec.t_upstream_first_byte = time.time()
        up = call.upstream
        assert up is not None
        if resp.status == 400 and call.max_tokens_sent is not None:
            resp = await self._budget_retry(call, resp, chat, stream_upstream)
            if resp is None:
                return
        if resp.status != 200:
            await self._upstream_status_error(call, resp)
            return
        self.pool.mark_ok(up)
        if stream_upstream:
            call.translator = call.provider.new_stream(rec.requested_model, call.normalized)
            self.stats["streamed"] += 1
            if self.stream_at_once and resp.content.is_eof():
                self._answer_finished_stream(call, resp)
                return
            call.upstream_response = resp
            call.ticket = os.urandom(16).hex()
            self.tickets[call.ticket] = call
            self._to_relay(call)
            return
        try:
            raw = await resp.read()
        except asyncio.TimeoutError:
            self.pool.mark_failed(up, "timeout")
            self._fail(call, 504, "timeout", f"upstream {up.url} stalled for {self.timeout:g}s")
            return
        except (aiohttp.ClientError, OSError) as exc:
            self.pool.mark_failed(up, str(exc))
            self._fail(call, 502, "upstream_error", f"upstream {up.url} broke the answer: {exc}")
            return
        finally:
            resp.release()
        if call.finalized:  # the harness hung up meanwhile: its record is written
            return
        rec.t_upstream_end = time.time()
        try:
            answer = self.engine.parse(raw, call.tokens)
        except orjson.JSONDecodeError:
            self._fail(call, 502, "upstream_error", f"upstream sent malformed JSON: {raw[:200]!r}")
            return
        self.engine.read_response(answer, call.tokens)
        self._budget_cut(call, answer)
        call.acc.feed_whole(answer)
        try:
            if rec.stream:  # synthetic stream mode
                translator = call.provider.new_stream(rec.requested_model, call.normalized)
                out = b"".join(translator.feed(c) for c in synthetic_chunks(answer)) + translator.finish()
                content, ctype = out, "text/event-stream"
            else:
                native = call.provider.from_chat(answer, rec.requested_model, call.normalized)
                content, ctype = jsonutil.dumps(native), "application/json"
        except Exception as exc:
            log.warning(f"polar: {call.provider.name} answer translation failed: {exc!r}")
            self._fail(call, 502, "upstream_error", f"could not translate the answer: {exc}")
            return
        rec.http_status = 200
        self._finalize(call)
        headers = {"content-type": ctype}
        if ctype == "text/event-stream":
            headers["cache-control"] = "no-cache"
        call.flow.response = make_response(200, content, headers)

    def _budget_cut(self, call: Call, answer: dict[str, Any]) -> None:
        """A tool call that the output budget cut is not a finished tool call: report ``length``
        (vLLM's whole answers say ``tool_calls`` whenever its parser read a call)."""
        for choice in answer.get("choices") or ():
            if choice.get("finish_reason") == "tool_calls" and choice.get("index", 0) == 0:
                up = call.upstream
                limit = budget.effective_budget(call.max_tokens_sent, up.max_model_len if up else None,
                                                len(call.tokens.prompt_token_ids))
                if budget.budget_cut("tool_calls", len(call.tokens.sampled_token_ids), limit):
                    choice["finish_reason"] = "length"
                    call.record.translation_notes.append("tool call cut by the output budget: finish_reason length")

    def _answer_finished_stream(self, call: Call, resp: aiohttp.ClientResponse) -> None:
        """The whole stream had arrived before the proxy got to it (it is behind: a loaded proxy,
        a short answer): translate it at once and answer in one piece. Nothing is held back that
        could have gone out earlier, and the relay hop is saved when the proxy needs it most."""
        try:
            data = resp.content.read_nowait(-1)
        except (aiohttp.ClientError, OSError) as exc:  # the body broke: what arrived, then the error
            data = _salvage(resp.content) + relay_error_event("upstream_error", f"upstream stream broken: {exc}")
        finally:
            resp.release()
        call.record.t_upstream_end = time.time()
        self.stats["streamed_at_once"] += 1
        translate = SSEStream(self, call)
        out = b"".join(translate(data)) + b"".join(translate(b""))
        call.flow.response = make_response(200, out, {"content-type": "text/event-stream", "cache-control": "no-cache"})

    async def _budget_retry(self, call: Call, resp: aiohttp.ClientResponse, chat: dict[str, Any],
                            stream_upstream: bool) -> aiohttp.ClientResponse | None:
        """An engine that refuses a ``max_tokens`` above the room its real prompt leaves (older
        vLLM) says how long the prompt is: ask once more with exactly that room."""
        raw = await _read_quietly(resp)
        room = budget.room_from_error(_error_message(raw))
        up = call.upstream
        if room is None or call.finalized or self.http is None or up is None:
            if not call.finalized:
                await self._upstream_status_error(call, resp, raw)
            return None
        rec = call.record
        chat["max_tokens"] = call.max_tokens_sent = room[0]
        rec.translation_notes.append(f"max_tokens lowered to the {room[0]} tokens the {room[1]}-token prompt leaves")
        body = jsonutil.dumps(chat)
        rec.normalized_request = jsonutil.raw_json(body) or chat
        try:
            return await self.http.post(
                up.url + "/v1/chat/completions", data=body,
                headers={"content-type": "application/json", "x-polar-session": rec.session_id,
                         "x-request-id": rec.call_id,
                         "accept": "text/event-stream" if stream_upstream else "application/json"},
                timeout=self._client_timeout())
        except asyncio.TimeoutError:
            self._fail(call, 504, "timeout", f"upstream {up.url} did not answer within {self.timeout:g}s")
        except (aiohttp.ClientError, OSError) as exc:
            self._fail(call, 502, "upstream_refused", f"upstream {up.url} failed: {exc}")
        return None

    async def _upstream_status_error(self, call: Call, resp: aiohttp.ClientResponse, raw: bytes | None = None) -> None:
        up = call.upstream
        assert up is not None
        if raw is None:
            raw = await _read_quietly(resp)
        message = raw.decode("utf-8", "replace")[:2000]
        try:
            err = orjson.loads(raw).get("error")
            if isinstance(err, dict):
                message = str(err.get("message") or message)
            elif isinstance(err, str):
                message = err
        except (orjson.JSONDecodeError, AttributeError):
            pass
        extra: dict[str, str] = {}
        if resp.status == 429:
            kind, status = "rate_limited", 429
            if resp.headers.get("retry-after"):
                extra["retry-after"] = resp.headers["retry-after"]
        elif resp.status >= 500:
            if self.pool is not None:
                self.pool.mark_failed(up, f"HTTP {resp.status}")
            kind, status = "upstream_error", resp.status if resp.status in (500, 502, 503, 504) else 502
        elif resp.status in (400, 413, 422) and _is_context_error(message):
            kind, status = "context_length", 400
        elif resp.status in (400, 422):
            kind, status = "invalid_request", 400
        elif resp.status == 404:
            kind, status = "upstream_error", 502
            up.served_model = None  # the served model may have changed: ask again next time
        else:
            kind, status = "upstream_error", 502
        self._fail(call, status, kind, f"upstream answered {resp.status}: {message}", extra_headers=extra)

    def _to_relay(self, call: Call) -> None:
        """Point the flow at the loopback relay, which serves this call's upstream stream.

        The relay needs only the ticket, so the body is not sent again (a harness request can be
        80 kB); ``responseheaders`` puts the harness's own request back for saved flows."""
        assert self.relay is not None and call.ticket is not None
        data = call.flow.request.data
        restore = (data.scheme, data.host, data.port, data.content, data.headers.fields)
        data.scheme, data.host, data.port = b"http", "127.0.0.1", self.relay.port
        data.content = b""
        # Only what the relay reads: mitmproxy assembles and the relay parses a short head.
        data.headers.fields = ((b"host", b"127.0.0.1"), (b"content-length", b"0"),
                               (_RELAY_TICKET_HEADER_BYTES, call.ticket.encode()))
        call.relay_restore = restore

    def _from_relay(self, call: Call) -> None:
        """The flow's request as the harness sent it (secrets already scrubbed)."""
        if call.relay_restore is not None:
            data = call.flow.request.data
            data.scheme, data.host, data.port, data.content, data.headers.fields = call.relay_restore
            call.relay_restore = None

    async def _pump(self, ticket: str, write: Any) -> bool:
        """Relay side: copy the upstream's SSE bytes; on stall or break, end with an error event.

        ``write(data, end)`` sends the relay's response head with the first write and the chunked
        terminator with ``end``: what is already buffered goes to mitmproxy as one piece (one read
        and one pass through its layers instead of three)."""
        call = self.tickets.pop(ticket, None)
        if call is None or call.upstream_response is None:
            await write(relay_error_event("upstream_error", "polar: unknown relay ticket"), True)
            return True
        resp = call.upstream_response
        content = resp.content
        error: bytes | None = None
        try:
            try:
                data = content.read_nowait(-1)  # usually the whole answer under load
            except (aiohttp.ClientError, OSError, RuntimeError):
                data = b""  # readany below raises it again, with the salvage logic
            end = bool(data) and content.at_eof()
            if end:  # set before the bytes go out: the record is written when mitmproxy reads [DONE]
                call.record.t_upstream_end = time.time()
            await write(data, end)  # the head goes out now, whatever the upstream has sent so far
            while not end:
                try:
                    data = await content.readany()
                except asyncio.TimeoutError:
                    if self.pool and call.upstream and not call.cancelled:
                        self.pool.mark_failed(call.upstream, "stream stalled")
                    error = relay_error_event("timeout", f"upstream stalled for {self.timeout:g}s mid-stream")
                    break
                except (aiohttp.ClientError, OSError) as exc:
                    if call.cancelled:
                        return False
                    rest = _salvage(content)
                    if rest:  # bytes that arrived together with the break: never drop sampled tokens
                        await write(rest)
                    if self.pool and call.upstream:
                        self.pool.mark_failed(call.upstream, f"stream broken: {exc}")
                    error = relay_error_event("upstream_error", f"upstream stream broken: {exc}")
                    break
                end = not data or content.at_eof()
                if end:
                    call.record.t_upstream_end = time.time()
                await write(data, end)
            if call.record.t_upstream_end is None:
                call.record.t_upstream_end = time.time()
            if error is not None:
                await write(error, True)
            return True
        except (ConnectionError, RuntimeError):
            return False  # the harness side is gone; closing resp aborts the generation
        finally:
            resp.close()
            call.upstream_response = None

    # -- stream endings (called from SSEStream, inside mitmproxy's layer) --------------------
    def _stream_finished(self, call: Call) -> bytes:
        assert call.translator is not None
        try:
            out = call.translator.finish()
        except Exception as exc:
            log.warning(f"polar: stream finish failed: {exc!r}")
            return self._stream_failed(call, "upstream_error", f"could not translate the end of the stream: {exc}")
        call.record.http_status = 200
        if call.record.t_upstream_end is None:  # [DONE] read before the relay saw the body end
            call.record.t_upstream_end = time.time()
        self._finalize(call)
        return out

    def _stream_failed(self, call: Call, kind: str, message: str) -> bytes:
        rec = call.record
        rec.status, rec.error_kind, rec.error = "error", kind, message
        rec.http_status = 200  # headers were already sent
        try:
            out = call.translator.fail(kind, message) if call.translator else b""
        except Exception as exc:
            log.warning(f"polar: stream fail translation failed: {exc!r}")
            out = b""
        self.stats["errors"] += 1
        self._finalize(call)
        return out

    # -- errors, finalization ----------------------------------------------------------------
    def _guess_provider(self, path: str, headers: dict[str, str], registry: dict[str, Provider]) -> Provider | None:
        if "anthropic-version" in headers or "/messages" in path:
            name = "anthropic"
        elif "x-goog-api-key" in headers or path.startswith("/v1beta") or ":generateContent" in path \
                or ":streamGenerateContent" in path:
            name = "google"
        elif path.endswith("/responses"):
            name = "openai_responses"
        else:
            name = "openai_chat"
        return registry.get(name) or registry.get("openai_chat")

    def _answer_error(self, flow: http.HTTPFlow, provider: Provider | None, status: int, kind: str, message: str,
                      extra_headers: dict[str, str] | None = None) -> None:
        body: Any
        if provider is not None:
            try:
                status, body = provider.error_response(status, kind, message)
            except Exception:
                body = None
        else:
            body = None
        if body is None:
            body = {"error": {"message": message, "type": kind, "code": status}}
        headers = {"content-type": "application/json", **(extra_headers or {})}
        flow.response = make_response(status, jsonutil.dumps(body), headers)
        flow.marked = ":red_circle:"

    def _fail(self, call: Call, status: int, kind: str, message: str,
              extra_headers: dict[str, str] | None = None) -> None:
        """Record the failure, then answer it in the harness's shape (record first: crash safety)."""
        if call.finalized:  # already recorded (the harness hung up): nobody to answer
            return
        rec = call.record
        rec.status, rec.error_kind, rec.error, rec.http_status = "error", kind, message, status
        self.stats["errors"] += 1
        self._finalize(call)
        self._answer_error(call.flow, call.provider, status, kind, message, extra_headers)

    def _finalize(self, call: Call) -> None:
        """Write the record once, release the upstream slot, forget the call."""
        if call.finalized:
            return
        call.finalized = True
        rec = call.record
        t = call.tokens
        rec.prompt_token_ids = t.prompt_token_ids
        rec.sampled_token_ids = t.sampled_token_ids
        rec.sampled_logprobs = t.sampled_logprobs
        if len(t.sampled_logprobs) != len(t.sampled_token_ids):
            rec.translation_notes.append(
                f"logprobs/ids length mismatch: {len(t.sampled_logprobs)} vs {len(t.sampled_token_ids)}")
        call.acc.fill(rec)
        rec.t_response_out = time.time()
        if self.exact is not None:
            self.exact.observe(rec)
        if self.writer is not None:
            try:
                self.writer.write(rec)
                self.stats["captured"] += 1
            except CaptureError as exc:
                self.stats["capture_errors"] += 1
                log.error(f"polar: capture failed: {exc}")
        if call.upstream is not None and self.pool is not None:
            self.pool.release(call.upstream)
            call.upstream = None
        if call.ticket is not None:
            self.tickets.pop(call.ticket, None)
        if call.upstream_response is not None and call.stream_done is False:
            call.upstream_response.close()
        self.calls.pop(call.flow.id, None)
        if not self.calls:
            self._drained.set()
        self._annotate(call)

    def _annotate(self, call: Call) -> None:
        rec = call.record
        meta = call.flow.metadata.setdefault("polar", {})
        meta.update({"prompt_tokens": len(rec.prompt_token_ids), "sampled_tokens": len(rec.sampled_token_ids),
                     "finish_reason": rec.finish_reason, "status": rec.status, "error_kind": rec.error_kind,
                     "upstream": rec.upstream, "policy_version": rec.policy_version})
        call.flow.comment = (f"polar {rec.provider} session={rec.session_id}#{rec.call_index} "
                             f"prompt={len(rec.prompt_token_ids)} sampled={len(rec.sampled_token_ids)} "
                             f"finish={rec.finish_reason}" + (f" error={rec.error_kind}" if rec.error_kind else ""))
        if rec.status != "ok":
            call.flow.marked = ":red_circle:"

    # -- response-side hooks -----------------------------------------------------------------
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call = self.calls.get(flow.id)
        if call is None or call.ticket is None or flow.response is None:
            if flow.response is not None and (flow.metadata.get("polar") or {}).get("passthrough"):
                self._scrub(flow)  # already sent upstream: keep secrets out of saved flows
                if "set-cookie" in flow.response.headers:
                    # the client gets its headers now (streamed body); ``response`` then removes
                    # the cookies before the flow is saved
                    flow.response.stream = True
            return
        self._from_relay(call)
        flow.response.stream = SSEStream(self, call)  # the relay's head is already the harness's

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and (flow.metadata.get("polar") or {}).get("passthrough") \
                and flow.response.stream and "set-cookie" in flow.response.headers:
            del flow.response.headers["set-cookie"]  # already sent: out of saved flows

    def error(self, flow: http.HTTPFlow) -> None:
        if (flow.metadata.get("polar") or {}).get("passthrough"):
            self._scrub(flow)  # failed before any response: responseheaders never ran
        call = self.calls.get(flow.id)
        if call is None or call.finalized:
            return
        self._client_gone(call, flow.error.msg if flow.error else "flow error")

    def _client_gone(self, call: Call, msg: str) -> None:
        """The harness went away: record the call now (with what was sampled so far) and stop
        reading the upstream; an exchange still waiting on the upstream sees ``finalized``."""
        self._from_relay(call)
        rec = call.record
        rec.status, rec.error_kind, rec.error = "error", "client_disconnected", msg
        rec.http_status = 499
        self.stats["errors"] += 1
        call.cancelled = True
        if call.upstream_response is not None:
            call.upstream_response.close()
        self._finalize(call)

    def _scrub(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        fields = req.headers.fields
        kept = tuple(f for f in fields if f[0].lower() not in _SECRET_HEADER_BYTES)
        if len(kept) != len(fields):
            req.headers.fields = kept
        if "?" in req.path and any(k.lower() in SECRET_QUERY for k in req.query.keys()):
            q = req.query
            for k in list(q.keys()):
                if k.lower() in SECRET_QUERY:
                    q[k] = "<redacted>"

    # -- side calls --------------------------------------------------------------------------
    async def _side_call(self, flow: http.HTTPFlow, method: str, path: str, headers: dict[str, str]) -> bool:
        """Health, model lists and model lookups: answered here (no capture record)."""
        google = path.startswith("/v1beta/") or path.startswith("/v1alpha/") or "x-goog-api-key" in headers
        anthropic = "anthropic-version" in headers
        if method in ("GET", "HEAD") and path in ("/", "/health", "/v1", "/v1/"):
            self._json(flow, 200, {"status": "ok", "proxy": "polar"})
        elif method == "GET" and "/models" in path:
            served = await self._served_name()
            name = path.rsplit("/models/", 1)[1].strip("/") if "/models/" in path else ""
            if not name:  # the list: what the upstream serves
                names = [served]
                if google:
                    self._json(flow, 200, {"models": [self._google_model(n) for n in names]})
                elif anthropic:
                    data = [{"type": "model", "id": n, "display_name": n, "created_at": "2025-01-01T00:00:00Z"}
                            for n in names]
                    self._json(flow, 200, {"data": data, "has_more": False, "first_id": served, "last_id": served})
                else:
                    self._json(flow, 200, {"object": "list", "data": [
                        {"id": n, "object": "model", "created": 0, "owned_by": "polar",
                         "max_model_len": self._max_model_len()} for n in names]})
            elif google:  # a lookup: whatever name the harness asked for is served
                self._json(flow, 200, self._google_model(name.removeprefix("models/")))
            elif anthropic:
                self._json(flow, 200, {"type": "model", "id": name, "display_name": name,
                                       "created_at": "2025-01-01T00:00:00Z"})
            else:
                self._json(flow, 200, {"id": name, "object": "model", "created": 0, "owned_by": "polar",
                                       "max_model_len": self._max_model_len()})
        else:
            return False
        self.stats["side_calls"] += 1
        flow.metadata["polar"] = {"side_call": path}
        return True

    async def _provider_side_call(self, flow: http.HTTPFlow, provider: Provider, kind: str | None, body: Any,
                                  path: str, query: dict[str, str]) -> None:
        """Token counts (Anthropic count_tokens, Google countTokens): the engine's tokenizer counts."""
        self.stats["side_calls"] += 1
        flow.metadata["polar"] = {"side_call": kind, "provider": provider.name}
        try:
            normalized = provider.to_chat(body, path, query)
        except ProviderError as exc:
            self._answer_error(flow, provider, exc.status, exc.kind, exc.message)
            return
        if kind != "count_tokens":
            self._answer_error(flow, provider, 404, "not_found", f"polar: unsupported side call {kind}")
            return
        media.settle(normalized, self.media_mode)
        count = await self._count_tokens(normalized.chat_request)
        self._json(flow, 200, provider.count_tokens_answer(count))

    async def _count_tokens(self, chat: dict[str, Any]) -> int:
        """Prompt tokens via the upstream's /tokenize (vLLM); a rough estimate if that fails."""
        if self.pool is not None and self.http is not None:
            up = self.pool.pick(None)
            try:
                await self._model_info(up)
                payload = {"model": up.served_model, "messages": chat.get("messages") or [],
                           "add_generation_prompt": True}
                if chat.get("tools"):
                    payload["tools"] = chat["tools"]
                async with self.http.post(up.url + "/tokenize", data=jsonutil.dumps(payload),
                                          headers={"content-type": "application/json"},
                                          timeout=self._client_timeout()) as resp:
                    if resp.status == 200:
                        return int(orjson.loads(await resp.read())["count"])
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, ValueError, TypeError):
                pass
        return _estimate_tokens(chat.get("messages"))

    def _google_model(self, name: str) -> dict[str, Any]:
        limit = self._max_model_len() or 0
        return {"name": f"models/{name}", "version": "polar", "displayName": name, "description": "served by Polar",
                "inputTokenLimit": limit, "outputTokenLimit": limit,
                "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"]}

    async def _served_name(self) -> str:
        """The served model (asking an upstream if nobody has yet); the option wins."""
        if ctx.options.polar_served_model:
            return ctx.options.polar_served_model
        if self.pool is not None:
            for up in self.pool.upstreams:
                if up.served_model:
                    return up.served_model
            if self.http is not None:
                up = self.pool.pick(None)
                try:
                    await self._model_info(up)
                    return up.served_model or "polar-model"
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                    pass
        return "polar-model"

    def _max_model_len(self) -> int | None:
        if self.pool is not None:
            for up in self.pool.upstreams:
                if up.max_model_len:
                    return up.max_model_len
        return None

    @staticmethod
    def _json(flow: http.HTTPFlow, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        flow.response = http.Response.make(status, jsonutil.dumps(data), {"content-type": "application/json",
                                                                       **(headers or {})})

    # -- control API -------------------------------------------------------------------------
    async def _control(self, flow: http.HTTPFlow) -> None:
        """Loopback-only: GET/POST /_polar/{status,pause,resume,policy_version,sessions}."""
        req = flow.request
        name = req.path.split("?", 1)[0][len(CONTROL_PREFIX):].strip("/")
        query = dict(req.query.items(multi=False))
        body: dict[str, Any] = {}
        if req.content:
            try:
                parsed = orjson.loads(req.content)
                body = parsed if isinstance(parsed, dict) else {"items": parsed}
            except orjson.JSONDecodeError:
                self._json(flow, 400, {"error": "malformed JSON"})
                return
        args = {**query, **body}
        post = req.method in ("POST", "PUT")
        flow.metadata["polar"] = {"control": name}
        try:
            if name == "status":
                self._json(flow, 200, self.status())
            elif name == "pause" and post:
                self._set_paused(True)
                drained = True
                if _truthy(args.get("drain", args.get("wait", False))):
                    drained = await self._drain(float(args.get("timeout", 300)))
                self._json(flow, 200 if drained else 504, {**self.status(), "drained": drained})
            elif name == "resume" and post:
                if args.get("policy_version") is not None:
                    self.policy_version = int(args["policy_version"])
                self._set_paused(False)
                self._json(flow, 200, self.status())
            elif name == "policy_version":
                if post:
                    value = args.get("policy_version", args.get("value"))
                    self.policy_version = None if value is None else int(value)
                self._json(flow, 200, {"policy_version": self.policy_version})
            elif name == "drain":
                drained = await self._drain(float(args.get("timeout", 300)))
                self._json(flow, 200 if drained else 504, {**self.status(), "drained": drained})
            elif name == "sessions" and post:
                items = args.get("items") or args.get("sessions") or [args]
                for item in items:
                    sid = item.get("session_id") or item.get("session")
                    if not valid_session_id(sid):
                        raise ValueError(f"invalid session id {sid!r}")
                    self.registry[sid] = {k: item.get(k) for k in ("task_id", "group_id", "sample_index")}
                    if isinstance(item.get("harness"), str) and item["harness"].strip():
                        self.registry[sid]["harness"] = item["harness"].strip()[:64]
                    self.registry.move_to_end(sid)
                while len(self.registry) > self.max_sessions:
                    self.registry.popitem(last=False)
                self._json(flow, 200, {"registered": len(items)})
            elif name == "sessions" and req.method == "DELETE":
                sid = args.get("session_id") or args.get("session")
                self.registry.pop(sid, None)
                self.session_calls.pop(sid, None)
                if self.exact is not None:
                    self.exact.forget(sid)
                if self.pool:
                    self.pool.forget_session(sid)
                self._json(flow, 200, {"forgotten": sid})
            elif name == "sessions":
                self._json(flow, 200, {"sessions": {sid: {"calls": n, **self.registry.get(sid, {})}
                                                    for sid, n in self.session_calls.items()}})
            else:
                self._json(flow, 404, {"error": f"unknown control endpoint {req.method} {name!r}"})
        except (ValueError, TypeError) as exc:
            self._json(flow, 400, {"error": str(exc)})

    async def _drain(self, timeout: float) -> bool:
        """Wait until no model call is in flight."""
        if not self.calls:
            return True
        try:
            await asyncio.wait_for(self._drained.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


_SECRET_HEADER_BYTES = frozenset(h.encode() for h in SECRET_HEADERS)
_RELAY_TICKET_HEADER_BYTES = RELAY_TICKET_HEADER.encode()
#: Young-generation threshold while serving (CPython's default is 700).
GC_GEN0_THRESHOLD = 10_000


def make_response(status: int, content: bytes, headers: dict[str, str]) -> http.Response:
    """``http.Response.make`` without its generic conversions (about half its cost on every
    answer): the body is already encoded and the header values are ASCII."""
    fields = tuple((k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in headers.items())
    now = time.time()
    return http.Response(b"HTTP/1.1", status, status_codes.RESPONSES.get(status, "").encode(),
                         http.Headers(fields + ((b"content-length", str(len(content)).encode()),)),
                         content, None, now, now)


def header_dict(headers: http.Headers) -> dict[str, str]:
    """Lower-cased name -> value, repeated headers folded with ", " (what ``Headers.get`` gives),
    read in one pass over the raw fields: every ``Headers`` lookup rescans all fields."""
    out: dict[str, str] = {}
    for k, v in headers.fields:
        name = k.decode("utf-8", "surrogateescape").lower()
        value = v.decode("utf-8", "surrogateescape")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def _tune_gc() -> None:
    """Freeze the ~90k objects alive after start-up (mitmproxy, aiohttp, translators) and collect
    the young generation every 10k allocations instead of 700. A parsed harness request is
    thousands of containers (and token-id lists of thousands of items); with the defaults the
    collector traversed them again and again: about a quarter of the proxy's CPU at 64 sessions
    (py-spy, benchmarks/bench_proxy.py). The proxy process is ours alone, so this is safe.

    Full collections must still come often: a flow (mitmproxy's and ours) is cyclic garbage, and
    the part of it that aged into the old generation while the call was in flight waits for a full
    collection. CPython runs one only when the old generation grew by a quarter of its size at the
    last full collection, so the collection after ``freeze`` (old generation now empty) and a third
    threshold of 1 keep them coming; with the frozen start-up heap out of the way each one is cheap
    (the live calls only). Without this the proxy held ~3 kB per call (benchmarks/bench_capture.py)."""
    gc.collect()
    gc.freeze()
    gc.collect()
    gc.set_threshold(GC_GEN0_THRESHOLD, 10, 1)


def _salvage(reader: aiohttp.StreamReader) -> bytes:
    """Bytes aiohttp had received when the connection broke: its ``readany`` raises the stored
    exception before returning buffered data, so read the buffer directly (private API, guarded)."""
    try:
        if getattr(reader, "_buffer", None):
            return reader._read_nowait(-1)
    except Exception:  # noqa: BLE001 - best effort on an aiohttp internal
        pass
    return b""


async def _read_quietly(resp: aiohttp.ClientResponse) -> bytes:
    """An error answer's body (empty if it cannot be read); the connection is released."""
    try:
        return await resp.read()
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        return b""
    finally:
        resp.release()


def _error_message(raw: bytes) -> str:
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return raw.decode("utf-8", "replace")
    if isinstance(err, dict):
        return str(err.get("message") or "")
    return err if isinstance(err, str) else raw.decode("utf-8", "replace")


def _estimate_tokens(body: Any) -> int:
    """A rough count for count_tokens side calls (no capture, no engine round trip)."""
    return max(1, math.ceil(len(jsonutil.dumps(body)) / 4)) if body else 1


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes", "on")


def _positive_float(value: str, name: str, allow_zero: bool = False) -> float:
    try:
        f = float(value)
    except ValueError:
        raise exceptions.OptionsError(f"{name} must be a number of seconds, got {value!r}") from None
    if f < 0 or (f == 0 and not allow_zero) or math.isnan(f):
        raise exceptions.OptionsError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return f

