"""Fixtures for the proxy tests: a scripted upstream (in a thread), real mitmdump proxies with the
addon (reverse and regular mode, module-scoped so each starts once), a small HTTP client that
speaks to them directly, through the proxy (absolute form) or through a CONNECT tunnel, and
readers that parse each provider's answers the way a client SDK would (so a malformed answer
fails the test). Exposed through fixtures because test modules cannot import each other."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest

from polar_proxy.process import ProxyProcess
from polar_testing.scripted_upstream import ServerThread
from polar_core.paths import harness_request_fixtures
from polar_core.schema import read_capture_lines

REPO = Path(__file__).resolve().parents[2]
FIXTURES = harness_request_fixtures()
_SKIP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


# ---------------------------------------------------------------------------------------------
# HTTP client
# ---------------------------------------------------------------------------------------------

@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    t_first: float | None = None  # seconds from request to the first body byte
    t_total: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds, body length so far) per read

    def json(self) -> Any:
        return json.loads(self.body)

    def timed_events(self) -> list[tuple[float, str | None, Any]]:
        """(seconds from request to the read that completed it, event name, data) for each SSE
        event, as the client received them: when a harness could first have acted on it."""
        out, pos = [], 0
        for m in re.finditer(rb"\r?\n\r?\n", self.body):
            block, pos = self.body[pos:m.end()], m.end()
            if block.strip():
                (name, data), = sse_events(block)
                out.append((next(t for t, n in self.arrivals if n >= m.end()), name, data))
        assert pos == len(self.body), "SSE body does not end with a blank line"
        return out


def request(
    url: str,
    body: Any = None,
    *,
    method: str | None = None,
    headers: dict[str, str] | None = None,
    proxy: str | None = None,
    cafile: str | None = None,
    timeout: float = 30.0,
) -> Answer:
    """One HTTP exchange. ``proxy``: send through it (absolute form for http, CONNECT for https)."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"content-type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if proxy:
        p = urlsplit(proxy)
        if p.username:
            token = base64.b64encode(f"{p.username}:{p.password or ''}".encode()).decode()
            proxy_auth = {"Proxy-Authorization": f"Basic {token}"}
        else:
            proxy_auth = {}
        if parts.scheme == "https":
            ctx = ssl.create_default_context(cafile=cafile)
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(p.hostname, p.port, timeout=timeout,
                                                                            context=ctx)
            conn.set_tunnel(parts.hostname, port, headers=proxy_auth)
        else:
            conn = http.client.HTTPConnection(p.hostname, p.port, timeout=timeout)
            target = url
            hdrs.update(proxy_auth)
    elif parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout,
                                           context=ssl.create_default_context(cafile=cafile))
    else:
        conn = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    t0 = time.perf_counter()
    try:
        conn.request(method or ("POST" if data is not None else "GET"), target, body=data, headers=hdrs)
        resp = conn.getresponse()
        chunks, t_first, received, arrivals = [], None, 0, []
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            now = time.perf_counter() - t0
            if t_first is None:
                t_first = now
            chunks.append(chunk)
            received += len(chunk)
            arrivals.append((now, received))
        return Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, b"".join(chunks), t_first,
                      time.perf_counter() - t0, arrivals)
    finally:
        conn.close()


def fixture_request(name: str) -> dict[str, Any]:
    """A real harness request from shared/fixtures: {method, path, headers, body}; secrets are fake."""
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    data["headers"] = {k: v for k, v in data["headers"].items() if k.lower() not in _SKIP_HEADERS}
    return data


# ---------------------------------------------------------------------------------------------
# Reading answers the way clients do (raises AssertionError on malformed answers)
# ---------------------------------------------------------------------------------------------

@dataclass
class Parsed:
    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {name, arguments(dict)}
    finish: str | None = None
    model: str | None = None
    error: dict[str, Any] | None = None  # in-stream error event
    usage: dict[str, Any] | None = None


def sse_events(body: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) for each event; ``[DONE]`` kept as the string."""
    events = []
    text = body.decode().replace("\r\n", "\n")
    assert text.endswith("\n\n"), f"SSE body does not end with a blank line: {text[-80:]!r}"
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        assert data, f"event without data: {block!r}"
        payload = "\n".join(data)
        events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return events


def _args(s: Any) -> Any:
    return json.loads(s) if isinstance(s, str) else s


def parse_chat(body: bytes, stream: bool) -> Parsed:
    out = Parsed()
    if not stream:
        d = json.loads(body)
        assert d["object"] == "chat.completion" and d["choices"], d
        msg = d["choices"][0]["message"]
        assert msg["role"] == "assistant"
        out.text = msg.get("content") or ""
        out.reasoning = msg.get("reasoning") or msg.get("reasoning_content") or ""
        out.tool_calls = [{"name": t["function"]["name"], "arguments": _args(t["function"]["arguments"]),
                           "id": t["id"]} for t in msg.get("tool_calls") or []]
        out.finish, out.model, out.usage = d["choices"][0]["finish_reason"], d["model"], d.get("usage")
        return out
    events = sse_events(body)
    last = events[-1][1]
    assert last == "[DONE]" or "error" in last, "chat stream must end with [DONE] or an error"
    tools: dict[int, dict[str, Any]] = {}
    for name, ev in events:
        if ev == "[DONE]":
            continue
        if "error" in ev:
            out.error = ev["error"]
            continue
        assert ev["object"] == "chat.completion.chunk"
        out.model = ev["model"]
        if ev.get("usage"):
            out.usage = ev["usage"]
        for c in ev["choices"]:
            delta = c.get("delta") or {}
            out.text += delta.get("content") or ""
            out.reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            for t in delta.get("tool_calls") or []:
                slot = tools.setdefault(t["index"], {"name": "", "arguments": "", "id": None})
                slot["id"] = t.get("id") or slot["id"]
                fn = t.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            out.finish = c.get("finish_reason") or out.finish
    out.tool_calls = [{**t, "arguments": _args(t["arguments"])} for _, t in sorted(tools.items())]
    return out


def parse_anthropic(body: bytes, stream: bool) -> Parsed:
    out = Parsed()
    if not stream:
        d = json.loads(body)
        assert d["type"] == "message" and d["role"] == "assistant", d
        for block in d["content"]:
            if block["type"] == "text":
                out.text += block["text"]
            elif block["type"] == "thinking":
                out.reasoning += block["thinking"]
            elif block["type"] == "tool_use":
                out.tool_calls.append({"name": block["name"], "arguments": block["input"], "id": block["id"]})
        out.finish, out.model, out.usage = d["stop_reason"], d["model"], d["usage"]
        return out
    events = sse_events(body)
    names = [n for n, _ in events]
    for name, ev in events:
        assert name == ev["type"], f"event name {name} != data type {ev['type']}"
    if "error" in names:
        out.error = events[names.index("error")][1]["error"]
        return out
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    blocks: dict[int, dict[str, Any]] = {}
    open_blocks: set[int] = set()
    for name, ev in events:
        if name == "message_start":
            out.model = ev["message"]["model"]
        elif name == "content_block_start":
            assert ev["index"] not in blocks, "block index reused"
            blocks[ev["index"]] = {**ev["content_block"], "_json": ""}
            open_blocks.add(ev["index"])
        elif name == "content_block_delta":
            assert ev["index"] in open_blocks, "delta for a block that is not open"
            b, d = blocks[ev["index"]], ev["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
        elif name == "content_block_stop":
            open_blocks.remove(ev["index"])
        elif name == "message_delta":
            out.finish, out.usage = ev["delta"]["stop_reason"], ev.get("usage")
    assert not open_blocks, "blocks left open"
    for _, b in sorted(blocks.items()):
        if b["type"] == "text":
            out.text += b["text"]
        elif b["type"] == "thinking":
            out.reasoning += b["thinking"]
        elif b["type"] == "tool_use":
            out.tool_calls.append({"name": b["name"], "arguments": json.loads(b["_json"] or "{}"), "id": b["id"]})
    return out


def _responses_output(resp: dict[str, Any], out: Parsed) -> None:
    assert resp["object"] == "response"
    out.model = resp["model"]
    for item in resp["output"]:
        if item["type"] == "message":
            out.text += "".join(c.get("text", "") for c in item["content"] if c["type"] == "output_text")
        elif item["type"] == "reasoning":
            out.reasoning += "".join(c.get("text", "") for c in item.get("content") or [] if "text" in c) or \
                "".join(s.get("text", "") for s in item.get("summary") or [])
        elif item["type"] == "function_call":
            out.tool_calls.append({"name": item["name"], "arguments": json.loads(item["arguments"]),
                                   "id": item["call_id"]})
    out.finish = resp["status"] if resp["status"] != "incomplete" else \
        "incomplete:" + str((resp.get("incomplete_details") or {}).get("reason"))
    out.usage = resp.get("usage")


def parse_responses(body: bytes, stream: bool) -> Parsed:
    out = Parsed()
    if not stream:
        _responses_output(json.loads(body), out)
        return out
    events = sse_events(body)
    names = [n for n, _ in events]
    for name, ev in events:
        assert name == ev["type"], f"event name {name} != data type {ev['type']}"
    seq = [ev.get("sequence_number") for _, ev in events]
    if all(s is not None for s in seq):
        assert seq == sorted(seq), "sequence numbers must increase"
    if "error" in names or "response.failed" in names:
        ev = events[names.index("error") if "error" in names else names.index("response.failed")][1]
        out.error = ev.get("error") or ev.get("response", {}).get("error") or ev
        return out
    assert names[0] == "response.created", names
    final = [n for n in names if n in ("response.completed", "response.incomplete")]
    assert final and names[-1] == final[0], names
    streamed_text = "".join(ev["delta"] for n, ev in events if n == "response.output_text.delta")
    _responses_output(events[-1][1]["response"], out)
    assert streamed_text == out.text, "deltas disagree with the final response"
    return out


def parse_google(body: bytes, stream: bool) -> Parsed:
    out = Parsed()
    chunks = [json.loads(body)] if not stream else [ev for _, ev in sse_events(body)]
    for ch in chunks:
        if "error" in ch:
            out.error = ch["error"]
            continue
        if ch.get("usageMetadata"):
            out.usage = ch["usageMetadata"]
        out.model = ch.get("modelVersion") or out.model
        for cand in ch.get("candidates") or []:
            for part in (cand.get("content") or {}).get("parts") or []:
                if "functionCall" in part:
                    fc = part["functionCall"]
                    out.tool_calls.append({"name": fc["name"], "arguments": fc.get("args") or {}, "id": fc.get("id")})
                elif part.get("thought"):
                    out.reasoning += part.get("text", "")
                elif "text" in part:
                    out.text += part["text"]
            out.finish = cand.get("finishReason") or out.finish
    return out


PARSERS = {"openai_chat": parse_chat, "anthropic": parse_anthropic, "openai_responses": parse_responses,
           "google": parse_google}


def parse_error(provider: str, body: bytes) -> dict[str, Any]:
    """The error object of a provider-shaped error body (asserting the shape)."""
    d = json.loads(body)
    if provider == "anthropic":
        assert d["type"] == "error" and d["error"]["type"] and d["error"]["message"], d
        return d["error"]
    if provider == "google":
        assert isinstance(d["error"]["code"], int) and d["error"]["message"] and d["error"]["status"], d
        return d["error"]
    assert d["error"]["message"] and "type" in d["error"], d
    return d["error"]


# ---------------------------------------------------------------------------------------------
# Captures
# ---------------------------------------------------------------------------------------------

def read_records(capture_dir: Path, session: str) -> list[dict[str, Any]]:
    path = Path(capture_dir) / "sessions" / f"{session}.jsonl"
    if not path.exists():
        return []
    return list(read_capture_lines(path))  # delta records (schema 3) expanded


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def helpers() -> SimpleNamespace:
    return SimpleNamespace(request=request, fixture_request=fixture_request, parsers=PARSERS,
                           parse_error=parse_error, read_records=read_records, sse_events=sse_events)


@pytest.fixture(scope="module")
def upstream():
    """A scripted vLLM-compatible upstream in a thread (cheap deterministic tokenization)."""
    with ServerThread(max_model_len=8192) as server:
        yield server


@pytest.fixture(scope="module")
def confdir():
    """mitmproxy confdir (CA) for this module only: tests never touch ~/.mitmproxy."""
    with tempfile.TemporaryDirectory(prefix="polar-mitm-") as d:
        yield Path(d)


def start_proxy(upstream_url: str, capture_dir: Path, confdir: Path, **kwargs: Any) -> ProxyProcess:
    kwargs.setdefault("upstream_timeout", 1.5)
    return ProxyProcess(upstream_url, capture_dir, confdir=confdir, **kwargs).start()


@pytest.fixture(scope="module")
def reverse_proxy(upstream, confdir, tmp_path_factory):
    proxy = start_proxy(upstream.url, tmp_path_factory.mktemp("captures-reverse"), confdir)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def regular_proxy(upstream, confdir, tmp_path_factory):
    proxy = start_proxy(upstream.url, tmp_path_factory.mktemp("captures-regular"), confdir, mode="regular")
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def proxy_factory(confdir, tmp_path_factory):
    """Start extra proxies with custom options; all are stopped at the end of the module."""
    started: list[ProxyProcess] = []

    def make(upstream_url: str, **kwargs: Any) -> ProxyProcess:
        proxy = start_proxy(upstream_url, tmp_path_factory.mktemp("captures"), confdir, **kwargs)
        started.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for p in started:
            p.stop()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.urandom(4).hex()}"


@pytest.fixture
def session_id(request) -> str:
    return unique(request.node.name.split("[")[0].replace("_", "-")[:40])
