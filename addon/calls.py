"""A model call on the proxy's side: its state while in flight (``Call``) and its one ending.

Every call ends in ``finalize`` exactly once (answered, failed, or abandoned by the harness): its
record is written (one line, one ``os.write``) before the harness gets its last byte, its upstream
slot is released and the flow is annotated (``flows.annotate``: metadata, comment); nothing of a
finished call stays in memory. Errors are answered in the harness's own wire format
(``answer_error``), the record first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp
from mitmproxy import http

from polar_core.schema import CallRecord
from polar_proxy import jsonutil

from . import flows
from .accumulate import ChatAccumulator
from .capture import CaptureError
from .engines import TokenData
from .httputil import make_response
from .providers import PROVIDERS
from .providers.base import NormalizedCall, Provider, StreamTranslator
from .state import ProxyState
from .upstreams import Upstream

log = logging.getLogger("polar")

_CONTEXT_MARKERS = ("maximum context length", "context length", "longer than the maximum model length",
                    "prompt is too long", "too many tokens", "exceeds the model")


def is_context_error(message: str) -> bool:
    """Does an upstream error message say the prompt was too long for the model?"""
    m = message.lower()
    return any(k in m for k in _CONTEXT_MARKERS)


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
        self.body_kept: bytearray | None = None  # a relayed stream: what the harness got (for the flow)
        self.body_sent = 0  # ... and how many bytes that was in all
        self.translated = False  # the relay serves bytes already translated (a long answer that came at once)


def guess_provider(path: str, headers: dict[str, str]) -> Provider | None:
    """The wire format to answer an error in when the request could not be read."""
    if "anthropic-version" in headers or "/messages" in path:
        name = "anthropic"
    elif "x-goog-api-key" in headers or path.startswith("/v1beta") or ":generateContent" in path \
            or ":streamGenerateContent" in path:
        name = "google"
    elif path.endswith("/responses"):
        name = "openai_responses"
    else:
        name = "openai_chat"
    return PROVIDERS.get(name) or PROVIDERS.get("openai_chat")


def answer_error(flow: http.HTTPFlow, provider: Provider | None, status: int, kind: str, message: str,
                 extra_headers: dict[str, str] | None = None) -> None:
    """Answer ``flow`` with an error in ``provider``'s shape (OpenAI's when it has none)."""
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


def fail(s: ProxyState, call: Call, status: int, kind: str, message: str,
         extra_headers: dict[str, str] | None = None) -> None:
    """Record the failure, then answer it in the harness's shape (record first: crash safety)."""
    if call.finalized:  # already recorded (the harness hung up): nobody to answer
        return
    rec = call.record
    rec.status, rec.error_kind, rec.error, rec.http_status = "error", kind, message, status
    s.stats["errors"] += 1
    finalize(s, call)
    answer_error(call.flow, call.provider, status, kind, message, extra_headers)


def finalize(s: ProxyState, call: Call) -> None:
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
    if s.exact is not None:
        s.exact.observe(rec)
    if s.writer is not None:
        try:
            s.writer.write(rec)
            s.stats["captured"] += 1
        except CaptureError as exc:
            s.stats["capture_errors"] += 1
            log.error(f"polar: capture failed: {exc}")
    if call.upstream is not None and s.pool is not None:
        s.pool.release(call.upstream)
        call.upstream = None
    if call.ticket is not None:
        s.tickets.pop(call.ticket, None)
    if call.upstream_response is not None and call.stream_done is False:
        call.upstream_response.close()
    s.calls.pop(call.flow.id, None)
    if not s.calls:
        s.gate.all_calls_done()
    flows.annotate(call, s.writer.root if s.writer is not None else None)


def client_gone(s: ProxyState, call: Call, msg: str) -> None:
    """The harness went away: record the call now (with what was sampled so far) and stop
    reading the upstream; an exchange still waiting on the upstream sees ``finalized``."""
    restore_request(call)
    rec = call.record
    rec.status, rec.error_kind, rec.error = "error", "client_disconnected", msg
    rec.http_status = 499
    s.stats["errors"] += 1
    call.cancelled = True
    if call.upstream_response is not None:
        call.upstream_response.close()
    finalize(s, call)
    if call.body_kept is not None:
        flows.keep_body(call.flow, call.body_kept, call.body_sent)
    flows.show_as_called(call.flow)


def restore_request(call: Call) -> None:
    """The flow's request as the harness sent it (secrets already scrubbed), after the relay."""
    if call.relay_restore is not None:
        data = call.flow.request.data
        data.scheme, data.host, data.port, data.content, data.headers.fields = call.relay_restore
        call.relay_restore = None
