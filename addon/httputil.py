"""HTTP helpers of the hot path: building answers, reading headers, scrubbing secrets from flows.

They work on mitmproxy's raw header fields and skip ``http.Response.make``'s generic conversions:
every model call goes through them, and the generic versions were measurable in the proxy's
profile (benchmarks/bench_proxy.py).
"""

from __future__ import annotations

import time
from typing import Any

from mitmproxy import http
from mitmproxy.net.http import status_codes

from polar_proxy import jsonutil

from .sessions import SECRET_HEADERS, SECRET_QUERY

_SECRET_HEADER_BYTES = frozenset(h.encode() for h in SECRET_HEADERS)


def make_response(status: int, content: bytes, headers: dict[str, str]) -> http.Response:
    """``http.Response.make`` without its generic conversions and without ``ResponseData``'s
    type check of every field (``typecheck.check_option_type``: ~1% of the proxy's CPU at 64
    sessions, py-spy, issue 42): the body is already encoded, the header values are ASCII, and
    every field below has its declared type."""
    fields = tuple((k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in headers.items())
    now = time.time()
    data = object.__new__(http.ResponseData)
    data.__dict__.update(http_version=b"HTTP/1.1", status_code=status,
                         reason=status_codes.RESPONSES.get(status, "").encode(),
                         headers=http.Headers(fields + ((b"content-length", str(len(content)).encode()),)),
                         content=content, trailers=None, timestamp_start=now, timestamp_end=now)
    resp = object.__new__(http.Response)
    resp.data = data
    return resp


def json_response(flow: http.HTTPFlow, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
    """Answer ``flow`` with ``data`` as JSON (side calls and the control API)."""
    flow.response = http.Response.make(status, jsonutil.dumps(data), {"content-type": "application/json",
                                                                   **(headers or {})})


def header_dict(headers: http.Headers) -> dict[str, str]:
    """Lower-cased name -> value, repeated headers folded with ", " (what ``Headers.get`` gives),
    read in one pass over the raw fields: every ``Headers`` lookup rescans all fields."""
    out: dict[str, str] = {}
    for k, v in headers.fields:
        name = k.decode("utf-8", "surrogateescape").lower()
        value = v.decode("utf-8", "surrogateescape")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out


def scrub(flow: http.HTTPFlow) -> None:
    """Drop secret headers (API keys, proxy credentials) and redact secret query values of the
    flow's request: saved flows (``-w``) must never hold a key."""
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


def truthy(value: Any) -> bool:
    return value is True or str(value).lower() in ("1", "true", "yes", "on")
