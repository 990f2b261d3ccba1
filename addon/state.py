"""What one proxy process shares across its calls: settings read on every call, the upstream pool
and HTTP client, the capture writer, the calls in flight, per-session counters and statistics.

``Polar`` (the addon) creates one ``ProxyState`` and keeps it current from its options; the rooms
(``exchange``, ``streaming``, ``side_calls``, ``control``, ``calls``) read and change it. The
settings are plain attributes because an option lookup costs a few calls, several times a call.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import aiohttp

from .capture import CaptureWriter
from .engines import ENGINES
from .engines.base import Engine
from .exact_history import ExactHistory
from .gate import PauseGate
from .upstreams import StreamRelay, UpstreamPool

if TYPE_CHECKING:
    from .calls import Call

class ProxyState:
    """The one shared state of a proxy process (see the module docstring)."""

    def __init__(self) -> None:
        self.proxy_id = uuid.uuid4().hex[:12]
        # -- settings (from options) ------------------------------------------------------------
        self.engine: Engine = ENGINES["vllm"]
        self.timeout = 600.0  # seconds to wait for the upstream's next byte
        self._timeout_obj: aiohttp.ClientTimeout | None = None
        self.pause_timeout = 0.0
        self.stream_mode = "passthrough"
        self.stream_at_once = True
        self.max_tokens_cap = 0
        self.media_mode = "placeholder"  # polar_media: images for a text-only model (providers/media.py)
        self.sampling: dict[str, Any] = {}  # polar_sampling, enforced on every call (see sampling.py)
        self.passthrough = False
        self.served_model = ""  # polar_served_model; empty: ask the upstream
        self.policy_version: int | None = None
        self.flow_body_limit = 4 * 2**20  # bytes of a streamed answer kept as the flow's response body
        # -- resources ---------------------------------------------------------------------------
        self.writer: CaptureWriter | None = None
        self.pool: UpstreamPool | None = None
        self.http: aiohttp.ClientSession | None = None
        self.relay: StreamRelay | None = None
        self.gate = PauseGate()
        self.exact: ExactHistory | None = None  # polar_exact_history: token-in/token-out via the ledger
        # -- calls and sessions ------------------------------------------------------------------
        self.calls: dict[str, Call] = {}  # in flight, by flow id
        self.tickets: dict[str, Call] = {}  # relayed streams waiting for the relay, by ticket
        self.relayed_whole: dict[str, Call] = {}  # recorded answers the relay sends (streaming.relay_translated)
        self.session_calls: OrderedDict[str, int] = OrderedDict()  # next call index per session
        self.registry: OrderedDict[str, dict[str, Any]] = OrderedDict()  # what the runner said of a session
        self.conn_proxy_auth: dict[str, str] = {}  # regular mode: proxy user of each client connection
        # -- who may speak for what (control.py, sessions.py) --------------------------------------
        self.control_token: str | None = None  # the control API's secret (polar_control_token or made at start)
        self.session_keys: dict[str, str] = {}  # issued session key -> the session it is bound to
        self.key_of: dict[str, str] = {}  # session -> its issued key
        self.require_session_key = False  # polar_require_session_key: calls without an issued key are refused
        self.max_sessions = 100_000
        self.stats = {"calls": 0, "errors": 0, "captured": 0, "capture_errors": 0, "streamed": 0, "session_moves": 0,
                      "streamed_at_once": 0, "side_calls": 0, "passthrough": 0, "refused": 0,
                      "control_refused": 0, "session_refused": 0}

    def client_timeout(self) -> aiohttp.ClientTimeout:
        """aiohttp's timeouts for ``self.timeout``, built once per value (this runs several times a call)."""
        t = self._timeout_obj
        if t is None or t.sock_read != self.timeout:
            t = self._timeout_obj = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.timeout,
                                                          sock_read=self.timeout)
        return t

    def next_call_index(self, sid: str) -> int:
        """The index of a session's next call (continuing a capture file that already has calls)."""
        n = self.session_calls.get(sid)
        if n is None:
            n = self.writer.existing_calls(sid) if self.writer else 0
        self.session_calls[sid] = n + 1
        self.session_calls.move_to_end(sid)
        while len(self.session_calls) > self.max_sessions:
            self.session_calls.popitem(last=False)
        return n
