"""A call's raw request and response from the run's saved flows (``captures/flows.mitm``), read
with mitmproxy's own ``io.FlowReader``: what the harness sent and what it received, byte for
byte up to a cap, without mitmweb.

The file is indexed once (call id -> offset of its flow; the proxy writes one flow per model call
with ``flow.metadata["polar"]["call_id"]``, ``polar_core.flowmeta``) and a flow is read again only
when its sample is shown: the demo's 24-call flow file is 1.15 MB, a long run's many GB. The index
goes on from where it stopped when the file grew (``--serve`` while the proxy appends).

Secrets never reach the page: the headers that carry credentials (the session's API key, the
proxy's control token) are replaced by ``[redacted]``.
"""

from __future__ import annotations

from typing import Any

from .runfiles import RunFiles

FLOWS_FILE = "captures/flows.mitm"
#: bytes of a body shown (a request carries the whole history: the demo's largest Pi request was ~60 kB)
BODY_CAP = 256 << 10
SECRET_HEADERS = {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
                  "x-goog-api-key", "x-polar-session-key"}


def _text(data: bytes | None) -> dict[str, Any]:
    data = data or b""
    return {"size": len(data), "text": data[:BODY_CAP].decode("utf-8", "replace"), "cut": len(data) > BODY_CAP}


def _headers(headers: Any) -> list[list[str]]:
    return [[k, "[redacted]" if k.lower() in SECRET_HEADERS else v] for k, v in headers.items(multi=True)]


class FlowIndex:
    """call id -> offset of its flow in ``captures/flows.mitm``."""

    def __init__(self, files: RunFiles) -> None:
        self.files = files
        self.offsets: dict[str, int] = {}
        self._end = 0

    def refresh(self) -> None:
        from mitmproxy import exceptions, io

        try:
            fh = self.files.open(FLOWS_FILE)
        except OSError:
            return
        with fh:
            fh.seek(self._end)
            reader = io.FlowReader(fh)
            while True:
                at = fh.tell()
                try:
                    flow = next(reader.stream())
                except StopIteration:
                    break
                except (exceptions.FlowReadException, ValueError):
                    break  # a flow being written: read again next time from here
                self._end = fh.tell()
                meta = (getattr(flow, "metadata", None) or {}).get("polar")
                if isinstance(meta, dict) and meta.get("call_id"):
                    self.offsets[str(meta["call_id"])] = at

    def raw(self, call_id: str) -> dict[str, Any] | None:
        """The flow of ``call_id``: request (method, URL, headers, body) and response, or None."""
        from mitmproxy import io

        at = self.offsets.get(call_id)
        if at is None:
            return None
        try:
            with self.files.open(FLOWS_FILE) as fh:
                fh.seek(at)
                flow = next(io.FlowReader(fh).stream())
        except Exception:  # noqa: BLE001 - an unreadable flow is shown as missing
            return None
        req, resp = flow.request, getattr(flow, "response", None)
        out: dict[str, Any] = {
            "request": {"method": req.method, "url": req.pretty_url, "headers": _headers(req.headers),
                        "body": _text(req.raw_content)},
            "response": None,
            "error": flow.error.msg if getattr(flow, "error", None) else None,
        }
        if resp is not None:
            out["response"] = {"status": resp.status_code, "headers": _headers(resp.headers), "body": _text(resp.raw_content)}
        return out
