"""Fixtures of the reliability suite: a scripted vLLM-compatible upstream in its own process, real
mitmdump proxies with the Polar addon (always stopped), compact provider-shaped request builders,
an async client that records which calls it fully received, and validators of provider answers.

Why the upstream runs in a child process (and not in a thread as in tests/proxy): these tests
drive dozens of concurrent sessions from the test process; sharing its GIL with the upstream would
measure the test, not the proxy. Everything listens on 127.0.0.1 and picks free ports itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from polar_core.net import OPENER, free_port  # OPENER: never via HTTP(S)_PROXY
from polar_proxy.process import ProxyProcess

SERVED = "scripted-model"

#: provider -> (path, whole path for Google, headers)
PATHS = {
    "openai_chat": "/v1/chat/completions",
    "anthropic": "/v1/messages",
    "openai_responses": "/v1/responses",
    "google": "/v1beta/models/gemini-x:generateContent",
}
PROVIDERS = tuple(PATHS)
#: What every complete answer of a shape contains (a cut or failed one does not).
COMPLETE = {
    ("openai_chat", True): b"data: [DONE]", ("openai_chat", False): b'"finish_reason"',
    ("anthropic", True): b"event: message_stop", ("anthropic", False): b'"stop_reason"',
    ("openai_responses", True): b"event: response.completed", ("openai_responses", False): b'"status":"completed"',
    ("google", True): b'"finishReason"', ("google", False): b'"finishReason"',
}


def build_call(provider: str, text: str, stream: bool, session: str | None = None,
               session_via: str = "header", key: str | None = None) -> tuple[str, dict[str, str], bytes]:
    """(path, headers, body) of a small native request of ``provider`` whose user text is ``text``.
    ``key``: the session's issued key (a registered session), sent where ``polar-<session>`` would be
    (with ``header``: as the Bearer key, next to the header)."""
    headers = {"content-type": "application/json"}
    if provider == "openai_chat":
        body: dict[str, Any] = {"model": "gpt-x", "stream": stream, "messages": [{"role": "user", "content": text}]}
    elif provider == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
        body = {"model": "claude-x", "max_tokens": 256, "stream": stream,
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    elif provider == "openai_responses":
        body = {"model": "gpt-x", "stream": stream,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}
    else:
        body = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    path = PATHS[provider]
    if provider == "google" and stream:
        path = path.replace(":generateContent", ":streamGenerateContent?alt=sse")
    if session is not None:
        named = key or f"polar-{session}"
        if session_via == "header":
            headers["x-polar-session"] = session
            if key:
                headers["authorization"] = f"Bearer {key}"
        elif session_via == "bearer":
            headers["authorization"] = f"Bearer {named}"
        elif session_via == "x-api-key":
            headers["x-api-key"] = named
        elif session_via == "x-goog-api-key":
            headers["x-goog-api-key"] = named
        else:
            raise ValueError(session_via)
    return path, headers, json.dumps(body).encode()


def is_complete(provider: str, stream: bool, status: int, body: bytes) -> bool:
    return status == 200 and COMPLETE[(provider, stream)] in body and not stream_error(provider, body)


def stream_error(provider: str, body: bytes) -> dict[str, Any] | None:
    """The in-stream error event of a streamed answer (headers already said 200), or None."""
    for block in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = b"", b""
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data += line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            ev = json.loads(data)
        except ValueError:
            continue
        if name in (b"error", b"response.failed") or (isinstance(ev, dict) and "error" in ev and "choices" not in ev
                                                      and ev.get("type") not in ("response.completed",)):
            err = ev.get("error") or (ev.get("response") or {}).get("error")
            if err:
                return err
    return None


def error_shape(provider: str, body: bytes) -> dict[str, Any]:
    """The error object of a provider-shaped error body; AssertionError if it is not that shape."""
    d = json.loads(body)
    assert isinstance(d, dict), d
    if provider == "anthropic":
        assert d.get("type") == "error" and isinstance(d["error"]["type"], str) and d["error"]["message"], d
    elif provider == "google":
        e = d["error"]
        assert isinstance(e["code"], int) and isinstance(e["message"], str) and isinstance(e["status"], str), d
    else:
        e = d["error"]
        assert isinstance(e["message"], str) and e["message"] and "type" in e, d
    return d["error"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete, parseable records of a capture file, deltas expanded (a torn line is skipped, as
    the loader does)."""
    from polar_core.schema import read_capture_lines

    return list(read_capture_lines(path))


@dataclass
class CallResult:
    session: str
    provider: str
    stream: bool
    nonce: str
    status: int = 0
    body: bytes = b""
    complete: bool = False
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Load:
    """Concurrent sessions through a proxy, each making calls until told to stop."""

    base_url: str
    results: list[CallResult] = field(default_factory=list)

    async def call(self, session: Any, provider: str, text: str, stream: bool, sid: str, nonce: str,
                   session_via: str = "header", timeout: float = 30.0, key: str | None = None) -> CallResult:
        import aiohttp

        path, headers, body = build_call(provider, f"{nonce} {text}", stream, sid, session_via, key)
        res = CallResult(sid, provider, stream, nonce)
        t0 = time.monotonic()
        try:
            async with session.post(self.base_url + path, data=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                res.status = resp.status
                res.body = await resp.read()
            res.complete = is_complete(provider, stream, res.status, res.body)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            res.error = repr(exc)
        res.seconds = time.monotonic() - t0
        self.results.append(res)
        return res


class UpstreamProcess:
    """``python -m polar_testing.scripted_upstream`` on a free loopback port (stopped by the fixture)."""

    def __init__(self, port: int | None = None, max_model_len: int = 65536):
        self.port = port or free_port()
        self.max_model_len = max_model_len
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="polar-rel-upstream-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "UpstreamProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polar_testing.scripted_upstream", "--port", str(self.port),
             "--served-model-name", SERVED, "--max-model-len", str(self.max_model_len)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with OPENER.open(self.url + "/health", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("scripted upstream did not start: " + Path(self.log.name).read_text()[-2000:])

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def upstream_proc():
    up = UpstreamProcess().start()
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def mitm_confdir():
    with tempfile.TemporaryDirectory(prefix="polar-rel-mitm-") as d:
        yield Path(d)


@pytest.fixture
def proxies(mitm_confdir, tmp_path):
    """``start(upstream_url, capture_dir=None, **kwargs)``: a Polar proxy (mitmdump) stopped at teardown."""
    started: list[ProxyProcess] = []

    def start(upstream_url: str, capture_dir: Path | None = None, **kwargs: Any) -> ProxyProcess:
        kwargs.setdefault("upstream_timeout", 2.0)
        kwargs.setdefault("served_model", SERVED)
        capture_dir = capture_dir or tmp_path / f"captures-{len(started)}"
        kwargs.setdefault("log_file", tmp_path / f"proxy-{len(started)}.log")  # kept with the test, even after kill -9
        proxy = ProxyProcess(upstream_url, capture_dir, confdir=mitm_confdir, **kwargs)
        started.append(proxy)
        return proxy.start()

    try:
        yield start
    finally:
        for p in started:
            p.stop()


@pytest.fixture(scope="session")
def rel() -> SimpleNamespace:
    return SimpleNamespace(build_call=build_call, is_complete=is_complete, stream_error=stream_error,
                           error_shape=error_shape, read_jsonl=read_jsonl, Load=Load, CallResult=CallResult,
                           UpstreamProcess=UpstreamProcess, PROVIDERS=PROVIDERS, SERVED=SERVED)
