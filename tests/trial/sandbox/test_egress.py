"""The registries' filtering proxy (``polar_trial/sandbox/egress.py``) and where phases get it:
build steps and the verifier reach the package registries and nothing else; the agent phase,
``allow_internet`` or not, reaches only the model. Every listener here is one the test starts on
loopback; no other address is contacted."""

from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from polar_testing.listeners import CountingListener, http_reply
from polar_trial.sandbox import SandboxSpec
from polar_trial.sandbox.egress import EgressProxy, allowed_host


@pytest.fixture
def listener():
    lst = CountingListener(http_reply(b"INSIDE"))
    yield lst
    lst.close()


def ask(path: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(request)
        out = b""
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_allowed_hosts_are_the_registries_and_their_subdomains():
    allow = ("pypi.org", "deb.debian.org")
    assert allowed_host("pypi.org", allow) and allowed_host("files.PYPI.org.", allow)
    assert not allowed_host("evilpypi.org", allow) and not allowed_host("pypi.org.evil.com", allow)
    assert not allowed_host("127.0.0.1", allow) and not allowed_host("localhost", allow)


def test_the_filter_refuses_what_is_not_a_registry_and_any_loopback_address(tmp_path, listener):
    """A host not listed, a listed name that resolves to the host's loopback, an absolute-form
    request to the control API: each 403 with its reason, and the listener never sees a byte."""
    proxy = EgressProxy(tmp_path / "e.sock", ("localhost",), ports=(listener.port,))
    try:
        for req in (f"CONNECT 127.0.0.1:{listener.port} HTTP/1.1\r\nHost: x\r\n\r\n",
                    f"CONNECT localhost:{listener.port} HTTP/1.1\r\nHost: x\r\n\r\n",
                    f"GET http://127.0.0.1:{listener.port}/_polar/pause HTTP/1.1\r\nHost: x\r\n\r\n",
                    "CONNECT pypi.org:22 HTTP/1.1\r\n\r\n",
                    f"GET /_polar/sessions HTTP/1.1\r\nHost: 127.0.0.1:{listener.port}\r\n\r\n"):
            answer = ask(tmp_path / "e.sock", req.encode())
            assert answer.startswith(b"HTTP/1.1 403"), (req, answer)
        assert listener.accepted == 0
        assert any(r.startswith("localhost resolves to") and "loopback" in r for r in proxy.refused), proxy.refused
    finally:
        proxy.close()


def test_the_filter_lets_an_allowed_registry_through(tmp_path, listener):
    """The positive path, against a loopback listener standing in for a registry (allow_private
    is the tests' switch; real runs never set it)."""
    proxy = EgressProxy(tmp_path / "e.sock", ("localhost",), allow_private=True, ports=(listener.port,))
    try:
        got = ask(tmp_path / "e.sock", f"GET http://localhost:{listener.port}/simple/ HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        assert got.endswith(b"INSIDE") and listener.accepted == 1, got
        got = ask(tmp_path / "e.sock", f"CONNECT localhost:{listener.port} HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 200 Connection established") and got.endswith(b"INSIDE"), got
    finally:
        proxy.close()


def _phase(sb, tmp_path, script: str, **kw):
    work = tmp_path / f"w-{uuid.uuid4().hex[:6]}"
    work.mkdir()
    spec = SandboxSpec(work, env={"PATH": "/usr/bin:/bin"}, timeout_s=30, **kw)
    with open(tmp_path / "out.log", "wb") as out:
        res = sb.run(spec, ["bash", "-c", script], stdout=out, stderr=subprocess.STDOUT)
    return res, (tmp_path / "out.log").read_text(errors="replace")


def test_a_phase_with_the_registries_reaches_nothing_on_the_host(sandbox, tmp_path, listener):
    """Through its proxy (CONNECT and absolute-form) and around it: the host's loopback listener
    is never reached; the proxy's refusal is what curl prints."""
    res, log = _phase(sandbox, tmp_path, f"""
        curl -sS -m 5 -x "$HTTP_PROXY" --noproxy '' http://127.0.0.1:{listener.port}/_polar/pause
        curl -sS -m 5 -x "$HTTP_PROXY" --noproxy '' -p http://127.0.0.1:{listener.port}/
        curl -sS -m 5 -x "$HTTP_PROXY" --noproxy '' -p http://localhost:{listener.port}/
        curl -sS -m 5 http://127.0.0.1:{listener.port}/
        echo "proxy=$HTTPS_PROXY"
    """, egress=("pypi.org",))
    assert listener.accepted == 0, log
    assert "proxy=http://127.0.0.1:" in log and "403" in log, log
    assert any("filtering proxy" in n for n in res.notes), res.notes


def test_the_agent_phase_never_gets_a_network_for_allow_internet(tmp_path):
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial.tasks.model import Task

    task = Task(id="t", instruction="x", allow_internet=True)
    cfg = r.RolloutConfig(tasks=[task], preset=get_preset("nop"), capture_dir=tmp_path / "c", model="m",
                          endpoint=Endpoint("base_url", base_url="http://127.0.0.1:8123"))
    spec = r.agent_spec(cfg, task, tmp_path / "w", tmp_path / "h", 10)
    assert spec.network is False and spec.egress == ()
