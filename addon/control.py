"""The control API: ``/_polar/{status,pause,resume,drain,policy_version,sessions}``, loopback only.

The trainer pauses the proxy (and waits for the calls in flight) while it swaps the served weights,
then resumes it with the new policy version; the rollout runner registers the task, group and sample
of each session it starts. The client is ``polar_core.control.ProxyControl``.
"""

from __future__ import annotations

from typing import Any

import orjson
from mitmproxy import http

from polar_core.schema import valid_session_id

from .httputil import json_response, truthy
from .state import ProxyState

CONTROL_PREFIX = "/_polar/"


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
            for item in items:
                sid = item.get("session_id") or item.get("session")
                if not valid_session_id(sid):
                    raise ValueError(f"invalid session id {sid!r}")
                s.registry[sid] = {k: item.get(k) for k in ("task_id", "group_id", "sample_index")}
                if isinstance(item.get("harness"), str) and item["harness"].strip():
                    s.registry[sid]["harness"] = item["harness"].strip()[:64]
                s.registry.move_to_end(sid)
            while len(s.registry) > s.max_sessions:
                s.registry.popitem(last=False)
            json_response(flow, 200, {"registered": len(items)})
        elif name == "sessions" and req.method == "DELETE":
            sid = args.get("session_id") or args.get("session")
            s.registry.pop(sid, None)
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
