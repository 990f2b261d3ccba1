"""What the flow of a model call holds once it is over: for mitmweb, ``mitmdump -r`` and flow files.

A saved flow (``save_stream_file``, ``-w``) is meant to be read without the proxy that made it:

* ``annotate``: ``flow.metadata["polar"]`` gets the record's key fields and its token ids and
  logprobs (``polar_core.flowmeta``: what each key means) and the link to the capture record; the
  flow's comment says at a glance what the call was (provider, harness, session and call index,
  status, finish reason, token counts); failed calls are marked.
* ``show_as_called``: the request shows where the harness sent it. In reverse mode mitmproxy
  rewrites the target (and Host) to the upstream, so every call would read
  ``127.0.0.1:<vLLM port>/v1/chat/completions``; it is put back to the address the harness
  connected to, with the harness's own path (``/v1/messages``, ``/v1/responses``, ...).
* ``keep_body``: a streamed answer is not kept by mitmproxy (the Response tab said "content
  missing"); the stream translator keeps the bytes the harness received, up to
  ``polar_flow_body_limit``, and they become the response body when the stream ends.
* ``save_filter``: control-API traffic (``/_polar/...``) is left out of the saved flows unless
  ``polar_save_control`` is set, by adding a clause to ``save_stream_filter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mitmproxy import http
from mitmproxy.net.http import url
from mitmproxy.proxy import mode_specs

from polar_core.flowmeta import META_KEY, TOKENS_KEY, pack_tokens
from polar_core.schema import SESSIONS_SUBDIR

from .control import CONTROL_PREFIX
from .jsonutil import RawJSON

if TYPE_CHECKING:
    from .calls import Call

#: ``save_stream_filter`` clause that leaves control-API flows out (mitmproxy's filter language).
NOT_CONTROL = f'!(~u "^[a-z0-9]+://[^/]+{CONTROL_PREFIX}")'

def harness_target(flow: http.HTTPFlow) -> tuple[str, str, int] | None:
    """(scheme, host, port) the harness connected to, for reverse-mode flows (None otherwise:
    in regular mode the request already names the host the harness called)."""
    client = flow.client_conn
    if not isinstance(getattr(client, "proxy_mode", None), mode_specs.ReverseMode):
        return None
    sockname = client.sockname
    if not sockname or not sockname[1]:
        return None
    host = sockname[0]
    if host in ("::", "0.0.0.0", ""):
        host = "127.0.0.1"
    return ("https" if client.tls_established else "http"), host, int(sockname[1])


def harness_url(flow: http.HTTPFlow, path: str) -> str:
    """The URL the harness called (``path``: its path, secrets already scrubbed)."""
    target = harness_target(flow)
    if target is None:
        req = flow.request
        scheme, host, port = req.scheme, req.pretty_host, req.port
    else:
        scheme, host, port = target
    default = 443 if scheme == "https" else 80
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}{'' if port == default else f':{port}'}{path}"


def show_as_called(flow: http.HTTPFlow) -> None:
    """Point the (finished) flow's request back at what the harness called (reverse mode)."""
    target = harness_target(flow)
    if target is None:
        return
    req = flow.request
    scheme, host, port = target
    data = req.data
    if (data.scheme, data.host, data.port) != (scheme.encode(), host, port):
        # the fields themselves: the host and port setters each rewrote the Host header and the
        # authority (mitmproxy's case-insensitive header scans, ~1% of the proxy's CPU, issue 42);
        # the result is the same: Host as the harness sent it, the authority (if any) likewise
        data.scheme, data.host, data.port = scheme.encode(), host, port
        if data.authority:
            req.authority = url.hostport(scheme, host, port)
        if "host" in req.headers:
            default = 443 if scheme == "https" else 80
            req.headers["host"] = host if port == default else f"{host}:{port}"


def _raw(value: Any) -> Any:
    """A token list as the record holds it: its JSON bytes when the engine's own were kept."""
    return value.json if isinstance(value, RawJSON) else value


def annotate(call: "Call", capture_root: Path | None) -> None:
    """Write the finished call into its flow: metadata (self-contained), comment, marker;
    ``capture_root``: the capture directory its record went to."""
    rec = call.record
    flow = call.flow
    meta = flow.metadata.setdefault(META_KEY, {})
    meta.update({
        "session": rec.session_id, "call_index": rec.call_index, "call_id": rec.call_id, "provider": rec.provider,
        "harness": rec.harness, "task_id": rec.task_id, "group_id": rec.group_id, "sample_index": rec.sample_index,
        "policy_version": rec.policy_version, "status": rec.status, "http_status": rec.http_status,
        "error_kind": rec.error_kind, "error": rec.error, "finish_reason": rec.finish_reason,
        "prompt_tokens": len(rec.prompt_token_ids), "sampled_tokens": len(rec.sampled_token_ids),
        "completion_tokens": rec.completion_tokens,
        "output_text": rec.output_text, "output_reasoning": rec.output_reasoning,
        "output_tool_calls": [dict(tc) for tc in rec.output_tool_calls],
        "translation_notes": list(rec.translation_notes),
        "served_model": rec.served_model, "requested_model": rec.requested_model, "upstream": rec.upstream,
        "engine": rec.engine, "stream": rec.stream, "stream_mode": rec.stream_mode,
        "sampling": dict(rec.sampling) if rec.sampling else rec.sampling, "max_tokens_sent": call.max_tokens_sent,
        "proxy_id": rec.proxy_id, "native_path": rec.native_path,
        "history": rec.history, "history_cause": rec.history_cause,
        "t_request_in": rec.t_request_in, "t_upstream_sent": rec.t_upstream_sent,
        "t_upstream_first_byte": rec.t_upstream_first_byte, "t_upstream_end": rec.t_upstream_end,
        "t_response_out": rec.t_response_out,
        TOKENS_KEY: pack_tokens(_raw(rec.prompt_token_ids), rec.sampled_token_ids, rec.sampled_logprobs),
    })
    if capture_root is not None:
        meta["capture_dir"] = str(capture_root)
        meta["capture_file"] = f"{SESSIONS_SUBDIR}/{rec.session_id}.jsonl"
    flow.comment = comment(meta)
    if rec.status != "ok":
        flow.marked = ":red_circle:"


def comment(meta: dict[str, Any]) -> str:
    """One line that tells calls apart in mitmweb's list (its ``comment`` column)."""
    status = "ok" if meta.get("status") == "ok" else f"error={meta.get('error_kind') or 'error'}"
    return (f"polar {meta.get('provider')} {meta.get('harness') or '-'} "
            f"session={meta.get('session')}#{meta.get('call_index')} {status} "
            f"finish={meta.get('finish_reason')} prompt={meta.get('prompt_tokens')} "
            f"sampled={meta.get('sampled_tokens')}")


def keep_body(flow: http.HTTPFlow, kept: bytes | bytearray, sent: int) -> None:
    """Make the bytes a streamed answer sent (the first ``len(kept)`` of ``sent``) the response body."""
    resp = flow.response
    if resp is None:
        return
    resp.data.content = bytes(kept)  # the headers already went out: leave them as sent
    note_body(flow, len(kept), sent)


def note_body(flow: http.HTTPFlow, kept: int, sent: int) -> None:
    """Say in the flow how much of a streamed answer's ``sent`` bytes its saved body holds."""
    meta = flow.metadata.setdefault(META_KEY, {})
    meta["response_body"] = {"kept": kept, "sent": sent}
    if kept < sent and flow.comment:
        flow.comment += f" body_cut={kept}/{sent}B"


def save_filter(user: str | None, keep_control: bool) -> str | None:
    """The ``save_stream_filter`` for the user's own filter ``user``: control flows left out
    (``(USER) & NOT_CONTROL``) unless ``keep_control``."""
    if keep_control:
        return user or None
    return f"({user}) & {NOT_CONTROL}" if user else NOT_CONTROL
