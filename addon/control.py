"""The control API: ``/_polar/{status,pause,resume,drain,policy_version,sessions}``, loopback only,
and only with the run's control secret.

The trainer pauses the proxy (and waits for the calls in flight) while it swaps the served weights,
then resumes it with the new policy version; the rollout runner registers the task, group and sample
of each session it starts, and gets back the session's key. The client is
``polar_core.control.ProxyControl``.

Why a secret: a sandboxed sample reaches the proxy's loopback port (its model traffic is relayed
there), so "loopback only" keeps nobody out. Every control request must carry the secret
(``Authorization: Bearer`` or ``x-polar-control-token``, compared in constant time); without it the
answer is 401 and nothing changes. The secret comes from ``polar_control_token``, else
``$POLAR_CONTROL_TOKEN`` (how ``ProxyProcess`` hands it over: never on a command line), else it is
made at start; it is written mode 0600 to ``<confdir>/polar-control-<port>.token``
(``polar_core.control.token_file``), which no sandbox binds.

Session keys: registering a session issues it a key (``secrets``), returned once in the answer
(``keys``); the runner gives it to the harness as its API key (or proxy password). A call that
carries the key belongs to that session and nothing it says can move it elsewhere
(``sessions.resolve_session``).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import orjson
from mitmproxy import http

from polar_core.control import TOKEN_ENV, TOKEN_HEADER, token_file
from polar_core.schema import valid_session_id

from .httputil import json_response, truthy
from .sessions import SESSION_KEY_PREFIX
from .state import ProxyState

log = logging.getLogger("polar")

CONTROL_PREFIX = "/_polar/"


def authorized(s: ProxyState, flow: http.HTTPFlow) -> bool:
    """Does the control request carry the run's secret? (No secret yet: nobody is.)"""
    want = s.control_token
    if not want:
        return False
    headers = flow.request.headers
    given = headers.get(TOKEN_HEADER, "")
    if not given:
        scheme, _, value = headers.get("authorization", "").strip().partition(" ")
        given = value.strip() if scheme.lower() == "bearer" else ""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want.encode("utf-8", "surrogateescape"))


def refuse(s: ProxyState, flow: http.HTTPFlow) -> None:
    """401 for a control request without the right secret; nothing else happens."""
    s.stats["control_refused"] += 1
    flow.metadata["polar"] = {"control": "refused"}
    json_response(flow, 401, {"error": "polar control API: missing or wrong control secret "
                                       "(Authorization: Bearer <secret>; see polar_control_token)"},
                  {"www-authenticate": 'Bearer realm="polar-control"'})


def settle_token() -> str:
    """The control secret when no option sets it: the environment's (the runner's), else a new one."""
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)


def publish_token(s: ProxyState, options: Any) -> Path | None:
    """Settle the control secret (option, environment, or a new one) and write it, mode 0600, where
    polar's clients look. Returns the file written (None when it could not be: logged)."""
    if not s.control_token:
        s.control_token = settle_token()
    if options.polar_control_token_file:
        path = Path(options.polar_control_token_file).expanduser()
    else:
        path = token_file(options.listen_port or 8080, Path(options.confdir).expanduser())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, s.control_token.encode() + b"\n")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(f"polar: could not write the control secret to {path}: {exc}")
        return None
    log.info(f"polar: control API secret in {path}")
    return path


def unpublish_token(s: ProxyState, path: Path | None) -> None:
    """Remove the token file at shutdown if it still holds this proxy's secret."""
    if path is None or not s.control_token:
        return
    try:
        if path.read_text().strip() == s.control_token:
            path.unlink()
    except OSError:
        pass


def issue_key(s: ProxyState, sid: str) -> str:
    """The session's key: the one issued before, else a new one bound to it."""
    key = s.key_of.get(sid)
    if key is None:
        key = SESSION_KEY_PREFIX + secrets.token_urlsafe(24)
        s.key_of[sid] = key
        s.session_keys[key] = sid
    return key


def forget_key(s: ProxyState, sid: str) -> None:
    key = s.key_of.pop(sid, None)
    if key is not None:
        s.session_keys.pop(key, None)


def status(s: ProxyState) -> dict[str, Any]:
    """Counters, pause state and upstream health (``GET /_polar/status``, ``polar.status``)."""
    return {
        "proxy_id": s.proxy_id,
        "paused": s.gate.paused,
        "policy_version": s.policy_version,
        "in_flight": len(s.calls),
        **s.stats,
        "waiting": s.gate.waiting,
        "sessions": len(s.session_calls),
        "engine": s.engine.name,
        "stream_mode": s.stream_mode,
        "capture_dir": str(s.writer.root) if s.writer else None,
        "upstreams": s.pool.status() if s.pool else [],
        "exact_history": dict(s.exact.stats, ledger_sessions=len(s.exact.ledger.sessions),
                              ledger_rebuilt=s.exact.ledger.rebuilt) if s.exact else None,
    }


async def handle(s: ProxyState, flow: http.HTTPFlow) -> None:
    """Answer a control request (the caller checked that it may be made: loopback only)."""
    req = flow.request
    name = req.path.split("?", 1)[0][len(CONTROL_PREFIX):].strip("/")
    query = dict(req.query.items(multi=False))
    body: dict[str, Any] = {}
    if req.content:
        try:
            parsed = orjson.loads(req.content)
            body = parsed if isinstance(parsed, dict) else {"items": parsed}
        except orjson.JSONDecodeError:
            json_response(flow, 400, {"error": "malformed JSON"})
            return
    args = {**query, **body}
    post = req.method in ("POST", "PUT")
    flow.metadata["polar"] = {"control": name}
    try:
        if name == "status":
            json_response(flow, 200, status(s))
        elif name == "pause" and post:
            s.gate.set_paused(True)
            drained = True
            if truthy(args.get("drain", args.get("wait", False))):
                drained = await s.gate.drain(len(s.calls), float(args.get("timeout", 300)))
            json_response(flow, 200 if drained else 504, {**status(s), "drained": drained})
        elif name == "resume" and post:
            if args.get("policy_version") is not None:
                s.policy_version = int(args["policy_version"])
            s.gate.set_paused(False)
            json_response(flow, 200, status(s))
        elif name == "policy_version":
            if post:
                value = args.get("policy_version", args.get("value"))
                s.policy_version = None if value is None else int(value)
            json_response(flow, 200, {"policy_version": s.policy_version})
        elif name == "drain":
            drained = await s.gate.drain(len(s.calls), float(args.get("timeout", 300)))
            json_response(flow, 200 if drained else 504, {**status(s), "drained": drained})
        elif name == "sessions" and post:
            items = args.get("items") or args.get("sessions") or [args]
            keys: dict[str, str] = {}
            for item in items:
                sid = item.get("session_id") or item.get("session")
                if not valid_session_id(sid):
                    raise ValueError(f"invalid session id {sid!r}")
                s.registry[sid] = {k: item.get(k) for k in ("task_id", "group_id", "sample_index")}
                if isinstance(item.get("harness"), str) and item["harness"].strip():
                    s.registry[sid]["harness"] = item["harness"].strip()[:64]
                s.registry.move_to_end(sid)
                keys[sid] = issue_key(s, sid)
            while len(s.registry) > s.max_sessions:
                forget_key(s, s.registry.popitem(last=False)[0])
            json_response(flow, 200, {"registered": len(items), "keys": keys})
        elif name == "sessions" and req.method == "DELETE":
            sid = args.get("session_id") or args.get("session")
            s.registry.pop(sid, None)
            forget_key(s, sid)
            s.session_calls.pop(sid, None)
            if s.exact is not None:
                s.exact.forget(sid)
            if s.pool:
                s.pool.forget_session(sid)
            json_response(flow, 200, {"forgotten": sid})
        elif name == "sessions":
            json_response(flow, 200, {"sessions": {sid: {"calls": n, **s.registry.get(sid, {})}
                                                   for sid, n in s.session_calls.items()}})
        else:
            json_response(flow, 404, {"error": f"unknown control endpoint {req.method} {name!r}"})
    except (ValueError, TypeError) as exc:
        json_response(flow, 400, {"error": str(exc)})
