"""The Polar mitmproxy addon: every model call of an unmodified harness, captured at the token level.

``Polar`` is the one addon object. It keeps mitmproxy's side only: its options (``polar_*``,
validated in ``configure``), its commands (``polar.pause``, ``polar.resume``, ``polar.status``) and
thin hooks named after mitmproxy's events, which hand the work to the rooms of this package:

``request``   the control API (``control``) for loopback clients; traffic that is not intercepted
              passes or is refused (``intercept``); every other request is an exchange
              (``exchange``: side calls, provider detection and translation, session, the pause
              gate, the upstream call with retries). Non-streaming and ``synthetic`` answers are
              set on the flow right there; a true stream is handed to the loopback relay
              (``streaming``), unless it has wholly arrived already (a proxy that is behind): then
              it is translated and answered in one piece (``polar_stream_at_once``).
``responseheaders``  for relayed streams, installs the stream translator as
              ``flow.response.stream``: chat SSE in, the provider's SSE out, chunk by chunk, token
              ids and logprobs collected from every chunk.
``error``     a client that went away mid-call still leaves a record with what was sampled;
``client_disconnected`` does the same at once for calls still waiting on the upstream.
``http_connect``, ``tls_clienthello``  regular mode: remember the tunnel's proxy user (the session),
              decrypt only the intercepted hosts.

Each call's record is written (one line, one ``os.write``) before the harness gets its last byte
(``calls.finalize``); nothing of a finished call stays in memory. Flows are made to be read later
(``flows``): self-contained metadata and a comment, the request as the harness called it, a
streamed answer kept as the response body (``polar_flow_body_limit``); control-API flows are left
out of ``save_stream_file`` (``polar_save_control``). Without a proxy server (``-n``: browsing a
flow file) nothing starts: no relay, no capture directory. What the calls share lives in one
``state.ProxyState``.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import aiohttp
from mitmproxy import command, ctx, exceptions, http
from mitmproxy.proxy import mode_specs
from mitmproxy.utils import human

from polar_core import paths
from polar_core.schema import valid_session_id
from polar_proxy import jsonutil

from . import control, exchange, flows, sampling, streaming
from .calls import client_gone, restore_request
from .capture import CaptureWriter
from .engines import ENGINES, get_engine
from .exact_history import ExactHistory
from .hook_table import HookTable
from .providers import media
from .httputil import scrub
from .intercept import DEFAULT_INTERCEPT_HOSTS, Interception
from .state import ProxyState
from .upstreams import StreamRelay, UpstreamPool, parse_upstreams

log = logging.getLogger("polar")

STREAM_MODES = ("passthrough", "synthetic")
#: Young-generation threshold while serving (CPython's default is 700).
GC_GEN0_THRESHOLD = 10_000
#: Seconds an idle upstream connection stays pooled: under vLLM's own 5 s keep-alive.
UPSTREAM_KEEPALIVE_S = 3.0


class Polar:
    """The addon. One instance per mitmproxy process."""

    def __init__(self) -> None:
        self.state = ProxyState()
        self.intercept = Interception()
        self._user_filter: str | None = None  # the user's save_stream_filter (ours adds a clause)
        self._filter_set: str | None = None  # the save_stream_filter this addon set last
        self._hooks: HookTable | None = None  # mitmproxy's dispatch with handlers looked up once

    # -- options -----------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        loader.add_option("polar_upstream", Optional[str], None,
                          "Inference server base URL(s), comma-separated (e.g. http://127.0.0.1:8000): several "
                          "are replicas; a session stays on the one it first went to, a new one goes to the "
                          "least loaded (upstreams.py). Unset: the reverse-mode target.")
        loader.add_option("polar_served_model", Optional[str], None,
                          "Model name the upstream serves. Unset: ask the upstream's /v1/models.")
        loader.add_option("polar_engine", str, "vllm", "Inference engine dialect for token ids and logprobs.",
                          choices=sorted(ENGINES))
        loader.add_option("polar_capture_dir", Optional[str], None,
                          "Directory for capture records (<dir>/sessions/<session>.jsonl). "
                          "Unset: $POLAR_HOME/captures.")
        loader.add_option("polar_intercept_hosts", Sequence[str], list(DEFAULT_INTERCEPT_HOSTS),
                          "Hosts whose API calls are intercepted in regular mode (host, host:port or *.domain). "
                          "Calls addressed to an upstream or to the proxy itself are always intercepted.")
        loader.add_option("polar_passthrough", bool, True,
                          "Regular mode: pass traffic to other hosts through untouched (never captured). "
                          "False: refuse it (CONNECT and absolute-form requests to any host not intercepted "
                          "get a 403 that names the allowed hosts; polar rollout and polar demo set this).")
        loader.add_option("polar_control_token", Optional[str], None,
                          "Secret the control API (/_polar/...) requires: 'Authorization: Bearer <secret>' or "
                          "x-polar-control-token. Unset: $POLAR_CONTROL_TOKEN, else a random one made at start. "
                          "Written (mode 0600) to polar_control_token_file, where polar's clients find it.")
        loader.add_option("polar_control_token_file", Optional[str], None,
                          "Where the control secret is written. Unset: <confdir>/polar-control-<listen_port>.token.")
        loader.add_option("polar_require_session_key", bool, False,
                          "Refuse model calls that carry no session key issued by POST /_polar/sessions "
                          "(polar rollout and polar demo set this: every sample's session is bound to its key).")
        loader.add_option("polar_stream_mode", str, "passthrough",
                          "passthrough: stream the upstream's tokens as they come; synthetic: call the upstream "
                          "non-streaming and replay the answer as a stream.", choices=list(STREAM_MODES))
        loader.add_option("polar_upstream_timeout", str, "600",
                          "Seconds to wait for the upstream's next byte (connect, headers, each stream chunk).")
        loader.add_option("polar_max_tokens_cap", Optional[int], None,
                          "Upper bound for max_tokens sent upstream. Unset (or 0): only the context limit.")
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
        loader.add_option("polar_policy_version", Optional[int], None,
                          "Policy (weights) version recorded with each call. Unset: unknown.")
        loader.add_option("polar_proxy_id", Optional[str], None,
                          "Identifier of this proxy in capture records. Unset: random.")
        loader.add_option("polar_exact_history", bool, False,
                          "Exact multi-turn history: prompt the model with its own sampled ids for every answer "
                          "the harness re-sends (vLLM render/generate/derender; vLLM needs --enable-scale-out). "
                          "Off: the chat template re-renders each answer from its text.")
        loader.add_option("polar_flow_body_limit", str, "4m",
                          "Bytes of a streamed answer kept as the flow's response body (what mitmweb, "
                          "saved flows and mitmdump -r show; mitmproxy keeps none of a streamed body). "
                          "Sizes like 512k, 4m; 0: keep none.")
        loader.add_option("polar_save_control", bool, False,
                          "Save the control API's flows (/_polar/...) with save_stream_file too. "
                          "Default: only model calls and other traffic (a clause in save_stream_filter).")

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        s = self.state
        # The options read on every call, kept as attributes (an option lookup is a few calls).
        s.stream_mode = o.polar_stream_mode
        s.max_tokens_cap = o.polar_max_tokens_cap or 0
        s.passthrough = o.polar_passthrough
        s.stream_at_once = o.polar_stream_at_once
        s.media_mode = o.polar_media
        s.served_model = o.polar_served_model or ""
        if "polar_flow_body_limit" in updated:
            try:
                limit = human.parse_size(o.polar_flow_body_limit)
            except ValueError as exc:
                raise exceptions.OptionsError(f"polar_flow_body_limit: {exc}") from None
            s.flow_body_limit = limit or 0
        if "save_stream_filter" in updated or "polar_save_control" in updated:
            self._save_filter()
        if "web_columns" in updated and "comment" not in o.web_columns \
                and list(o.web_columns) == list(o.default("web_columns")):
            # mitmweb: the comment column tells model calls apart (provider, harness, session#call)
            o.update(web_columns=[*o.web_columns, "comment"])
        if "polar_upstream_timeout" in updated:
            s.timeout = _seconds(o.polar_upstream_timeout, "polar_upstream_timeout")
        if "polar_pause_timeout" in updated:
            s.pause_timeout = _seconds(o.polar_pause_timeout, "polar_pause_timeout", allow_zero=True)
        if "polar_engine" in updated:
            try:
                s.engine = get_engine(o.polar_engine)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "polar_sampling" in updated:
            try:
                s.sampling = sampling.parse(o.polar_sampling)
            except ValueError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        if "polar_max_tokens_cap" in updated and (o.polar_max_tokens_cap or 0) < 0:
            raise exceptions.OptionsError("polar_max_tokens_cap must be >= 0")
        if "polar_intercept_hosts" in updated:
            try:
                self.intercept.set_hosts(o.polar_intercept_hosts)
            except ValueError as exc:
                raise exceptions.OptionsError(f"polar_intercept_hosts: {exc}") from None
        if "polar_upstream" in updated or "mode" in updated:
            value = o.polar_upstream or self._reverse_target()
            if value:
                try:
                    urls = parse_upstreams(value)
                except ValueError as exc:
                    raise exceptions.OptionsError(f"polar_upstream: {exc}") from None
                if s.pool is None or s.pool.urls != urls:
                    s.pool = UpstreamPool(urls)
            elif s.pool is None and "polar_upstream" in updated and not o.polar_upstream and self._is_regular() \
                    and o.server:  # no proxy server (mitmweb -n: browsing flows): nothing to answer
                log.warning("polar: no polar_upstream set; model calls will be answered with errors")
        if "polar_capture_dir" in updated and o.polar_capture_dir and o.server:
            # Unset means the default, created lazily (options may still be arriving).
            try:
                writer = CaptureWriter(o.polar_capture_dir, fsync=o.polar_fsync)
            except OSError as exc:
                raise exceptions.OptionsError(f"polar_capture_dir: {exc}") from None
            if s.writer is not None:
                s.writer.close()
            s.writer = writer
        if "polar_fsync" in updated and s.writer is not None:
            s.writer.fsync = o.polar_fsync
        if "polar_control_token" in updated and o.polar_control_token:
            self.state.control_token = o.polar_control_token
        if not self.state.control_token:
            # settled here, before the listener accepts anything: a control request that arrived
            # before ``running`` (a readiness probe) was refused for want of a secret (seen in the
            # unit suite under load); ``running`` only writes it to the token file
            self.state.control_token = control.settle_token()
        s.require_session_key = o.polar_require_session_key
        if "polar_pause" in updated:
            s.gate.set_paused(o.polar_pause)
        if "polar_policy_version" in updated:
            if (o.polar_policy_version or 0) < 0:
                raise exceptions.OptionsError("polar_policy_version must be >= 0")
            s.policy_version = o.polar_policy_version
        if "listen_host" in updated and o.listen_host == "":
            # mitmproxy's default is every interface; this proxy carries model traffic and its
            # control API: loopback unless asked for more (--listen-host 0.0.0.0).
            o.update(listen_host="127.0.0.1")
        if "polar_proxy_id" in updated and o.polar_proxy_id:
            if not valid_session_id(o.polar_proxy_id):
                raise exceptions.OptionsError("polar_proxy_id must match the session-id pattern")
            s.proxy_id = o.polar_proxy_id
        if "polar_exact_history" in updated or "polar_engine" in updated:
            if o.polar_exact_history and s.engine.name != "vllm":
                raise exceptions.OptionsError(f"polar_exact_history needs vLLM's render/generate/derender "
                                              f"endpoints; engine {s.engine.name!r} has none")
            if not o.polar_exact_history:
                s.exact = None
            elif s.http is not None and s.exact is None:
                s.exact = self._new_exact()
        if "polar_served_model" in updated and s.pool is not None:
            for up in s.pool.upstreams:
                up.served_model = None  # re-resolve on next call

    def _save_filter(self) -> None:
        """Keep control-API flows out of ``save_stream_file`` (unless ``polar_save_control``): the
        user's own ``save_stream_filter`` is kept, with a clause added (``flows.save_filter``)."""
        o = ctx.options
        current = o.save_stream_filter
        if current != self._filter_set:  # set by the user (or the first time): that is their filter
            self._user_filter = current
        want = flows.save_filter(self._user_filter, o.polar_save_control)
        self._filter_set = want
        if want != current:
            o.update(save_stream_filter=want)

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

    # -- lifecycle ---------------------------------------------------------------------------
    async def running(self) -> None:
        s = self.state
        if not ctx.options.server:
            # No proxy server (``mitmweb -nr FLOWS -s addon/polar.py``: browsing saved flows): no
            # relay, no HTTP client, no capture directory; the content view works all the same.
            log.info("polar: no proxy server (-n): showing flows only")
            return
        if self._hooks is None:
            self._hooks = HookTable(ctx.master.addons)
            self._hooks.install()
        if s.writer is None:
            s.writer = CaptureWriter(ctx.options.polar_capture_dir or paths.polar_home() / "captures",
                                     fsync=ctx.options.polar_fsync)
        if ctx.options.connection_strategy != "lazy":
            # Eager connections would dial api.anthropic.com at CONNECT time (unresolvable here) and,
            # in reverse mode, open an unused upstream connection per client. The addon never lets
            # mitmproxy talk to the upstream itself.
            ctx.options.update(connection_strategy="lazy")
        s.http = aiohttp.ClientSession(
            # vLLM's server closes a keep-alive connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE);
            # a pooled connection kept longer is reused just as the server closes it, and the call
            # fails with "Server disconnected" (seen in CI: a harness pausing 5-60 s between calls).
            # Keep idle connections for less than the server does (exchange.py retries the rest).
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S, enable_cleanup_closed=True),
            json_serialize=lambda x: jsonutil.dumps(x).decode(),
            auto_decompress=True,
        )
        s.relay = StreamRelay(functools.partial(streaming.pump, s))
        await s.relay.start()
        if ctx.options.polar_exact_history:
            s.exact = self._new_exact()
        self._control_token_file = control.publish_token(s, ctx.options)
        _tune_gc()
        log.info(f"polar: proxy {s.proxy_id} upstreams={s.pool.urls if s.pool else []} "
                 f"capture={s.writer.root if s.writer else None} relay=127.0.0.1:{s.relay.port}")

    def _new_exact(self) -> ExactHistory:
        s = self.state
        assert s.http is not None
        return ExactHistory(s.http, capture_path=lambda sid: s.writer.path_for(sid) if s.writer else None)

    async def done(self) -> None:
        s = self.state
        if self._hooks is not None:
            self._hooks.uninstall()
            self._hooks = None
        if s.relay is not None:
            await s.relay.close()
        if s.http is not None:
            await s.http.close()
        if s.writer is not None:
            s.writer.close()
        control.unpublish_token(s, getattr(self, "_control_token_file", None))

    # -- commands ----------------------------------------------------------------------------
    @command.command("polar.pause")
    def pause_cmd(self) -> None:
        """Hold new model calls until polar.resume."""
        self.state.gate.set_paused(True)

    @command.command("polar.resume")
    def resume_cmd(self) -> None:
        """Release held model calls."""
        self.state.gate.set_paused(False)

    @command.command("polar.status")
    def status_cmd(self) -> str:
        """Counters, pause state and upstream health as JSON."""
        return jsonutil.dumps(control.status(self.state)).decode()

    # -- connection-level hooks --------------------------------------------------------------
    def client_disconnected(self, client: Any) -> None:
        s = self.state
        s.conn_proxy_auth.pop(client.id, None)
        # Calls of this connection still waiting on the upstream get no flow error until the
        # upstream answers; their records are written now instead.
        for call in [c for c in s.calls.values() if c.flow.client_conn.id == client.id]:
            if not call.finalized:
                client_gone(s, call, "client disconnected while the upstream was answering")

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Regular mode CONNECT: remember the proxy user (session) of the tunnel, refuse or let through."""
        s = self.state
        auth = flow.request.headers.get("proxy-authorization")
        if auth:
            s.conn_proxy_auth[flow.client_conn.id] = auth
            del flow.request.headers["proxy-authorization"]
        if not self.intercept.host(flow.request.host, flow.request.port, flow, s.pool) and not s.passthrough:
            s.stats["refused"] += 1
            flow.response = self._refusal("CONNECT", f"{flow.request.host}:{flow.request.port}")

    def _refusal(self, method: str, target: str) -> http.Response:
        """The 403 a harness logs for traffic this proxy does not carry (passthrough off)."""
        hosts = ", ".join(sorted(self.intercept.hosts) + [f"*{x}" for x in self.intercept.suffixes])
        text = (f"polar: {method} {target} refused: this proxy carries model API calls only "
                f"(hosts: {hosts}); polar_passthrough is off\n")
        return http.Response.make(403, text.encode(), {"content-type": "text/plain"})

    def tls_clienthello(self, data: Any) -> None:
        """Terminate TLS only for intercepted hosts; everything else stays an opaque tunnel."""
        if isinstance(data.context.client.proxy_mode, mode_specs.ReverseMode):
            return
        sni = data.client_hello.sni
        address = data.context.server.address
        host = sni or (address[0] if address else "")
        port = address[1] if address else 443
        if not self.intercept.host(host, port, None, self.state.pool):
            data.ignore_connection = True

    # -- request and response hooks ----------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT" or not flow.live:
            return  # not live: a flow read from a file (-r) replays its events; it is not a call
        s = self.state
        if flow.request.path.startswith(control.CONTROL_PREFIX) and self.intercept.control_allowed(flow, s.pool):
            authorized = control.authorized(s, flow)  # before scrub: it drops the Authorization header
            scrub(flow)  # saved flows (-w) must never hold a key, whatever the path
            if authorized:
                await control.handle(s, flow)
            else:
                control.refuse(s, flow)
            return
        if not self.intercept.flow(flow, s.pool):
            if not s.passthrough:
                s.stats["refused"] += 1
                scrub(flow)
                flow.response = self._refusal(flow.request.method, flow.request.pretty_url)
            else:
                s.stats["passthrough"] += 1
                flow.metadata["polar"] = {"passthrough": True}
            return
        await exchange.model_call(s, flow)
        if flow.response is not None:  # answered here (a relayed stream is restored in responseheaders)
            flows.show_as_called(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        call = self.state.calls.get(flow.id) or self.state.relayed_whole.pop(flow.id, None)
        if call is None or call.ticket is None or flow.response is None:
            if flow.response is not None and (flow.metadata.get("polar") or {}).get("passthrough"):
                scrub(flow)  # already sent upstream: keep secrets out of saved flows
                if "set-cookie" in flow.response.headers:
                    # the client gets its headers now (streamed body); ``response`` then removes
                    # the cookies before the flow is saved
                    flow.response.stream = True
            return
        restore_request(call)
        flows.show_as_called(flow)
        # the relay's head is already the harness's
        flow.response.stream = (streaming.KeptStream if call.translated else streaming.SSEStream)(self.state, call)

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and (flow.metadata.get("polar") or {}).get("passthrough") \
                and flow.response.stream and "set-cookie" in flow.response.headers:
            del flow.response.headers["set-cookie"]  # already sent: out of saved flows

    def error(self, flow: http.HTTPFlow) -> None:
        if (flow.metadata.get("polar") or {}).get("passthrough"):
            scrub(flow)  # failed before any response: responseheaders never ran
        whole = self.state.relayed_whole.pop(flow.id, None)
        if whole is not None and whole.ticket is not None:
            self.state.tickets.pop(whole.ticket, None)
        call = self.state.calls.get(flow.id)
        if call is None or call.finalized:
            return
        client_gone(self.state, call, flow.error.msg if flow.error else "flow error")


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


def _seconds(value: str, name: str, allow_zero: bool = False) -> float:
    """A duration option (a string: mitmproxy options have no float type), validated."""
    try:
        f = float(value)
    except ValueError:
        raise exceptions.OptionsError(f"{name} must be a number of seconds, got {value!r}") from None
    if f < 0 or (f == 0 and not allow_zero) or math.isnan(f):
        raise exceptions.OptionsError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return f
