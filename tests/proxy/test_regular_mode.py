"""Regular mode: the harness keeps its hosted-API URL and only gets HTTPS_PROXY + the CA.

TLS to intercepted hostnames is terminated and the call goes to the local upstream; any other
host is an opaque tunnel (its own certificate reaches the client) or refused, and never captured.
"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import certs

from polar_proxy.process import free_port

MESSAGES = {"model": "claude-sonnet-4", "max_tokens": 64, "messages": [{"role": "user", "content": "hi #scenario:text"}]}
ANTHROPIC = {"anthropic-version": "2023-06-01", "x-api-key": "sk-ant-real-secret-0123456789"}


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server API
        body = b"hello from elsewhere"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def other_servers(tmp_path_factory):
    """A plain HTTP and an HTTPS server on loopback, the HTTPS one with a CA of its own."""
    ca_dir = tmp_path_factory.mktemp("other-ca")
    store = certs.CertStore.from_store(ca_dir, "other", 2048)
    entry = store.get_cert("localhost", [x509.DNSName("localhost")])
    pem, key = ca_dir / "localhost.pem", ca_dir / "localhost.key"
    pem.write_bytes(entry.cert.to_pem())
    key.write_bytes(entry.privatekey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    plain = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    tls = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pem, key)
    tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (plain, tls)]
    for t in threads:
        t.start()
    try:
        yield {"plain": plain.server_address[1], "tls": tls.server_address[1], "ca": str(ca_dir / "other-ca-cert.pem")}
    finally:
        for s in (plain, tls):
            s.shutdown()
            s.server_close()


def test_tls_interception_to_local_upstream(helpers, upstream, regular_proxy):
    """https://api.anthropic.com through HTTPS_PROXY, session from the proxy user name."""
    session = "tls-session-1"
    ans = helpers.request("https://api.anthropic.com/v1/messages", MESSAGES, headers=ANTHROPIC,
                          proxy=f"http://{session}:x@127.0.0.1:{regular_proxy.port}", cafile=str(regular_proxy.ca_cert))
    assert ans.status == 200, ans.body[:300]
    parsed = helpers.parsers["anthropic"](ans.body, False)
    assert parsed.text.startswith("Hello from the scripted upstream") and parsed.model == "claude-sonnet-4"
    [rec] = helpers.read_records(regular_proxy.capture_dir, session)
    assert rec["session_source"] == "proxy_auth" and rec["provider"] == "anthropic"
    assert rec["sampled_token_ids"] == upstream.upstream.responses[-1]["token_ids"]
    # streaming through the tunnel too, session from the API key this time
    body = {**MESSAGES, "stream": True}
    ans = helpers.request("https://api.anthropic.com/v1/messages", body,
                          headers={**ANTHROPIC, "x-api-key": "polar-tls-session-2"},
                          proxy=regular_proxy.url, cafile=str(regular_proxy.ca_cert))
    assert helpers.parsers["anthropic"](ans.body, True).text.startswith("Hello from")
    assert helpers.read_records(regular_proxy.capture_dir, "tls-session-2")[0]["session_source"] == "api_key"


def test_other_intercepted_hosts(helpers, regular_proxy, session_id):
    for url, body, headers, provider in [
        ("https://api.openai.com/v1/chat/completions",
         {"model": "gpt-5", "messages": [{"role": "user", "content": "hi #scenario:text"}]},
         {"authorization": "Bearer sk-real"}, "openai_chat"),
        ("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:generateContent",
         {"contents": [{"role": "user", "parts": [{"text": "hi #scenario:text"}]}]}, {"x-goog-api-key": "AIza-real"},
         "google"),
    ]:
        ans = helpers.request(url, body, headers={**headers, "x-polar-session": session_id}, proxy=regular_proxy.url,
                              cafile=str(regular_proxy.ca_cert))
        assert ans.status == 200
        assert helpers.parsers[provider](ans.body, False).text.startswith("Hello from")
    assert [r["provider"] for r in helpers.read_records(regular_proxy.capture_dir, session_id)] == \
        ["openai_chat", "google"]


def test_other_hosts_pass_through_untouched(helpers, regular_proxy, other_servers):
    before = regular_proxy.control.status()
    # TLS: the client sees the other server's own certificate (verified against *its* CA)
    ans = helpers.request(f"https://localhost:{other_servers['tls']}/", proxy=regular_proxy.url,
                          cafile=other_servers["ca"])
    assert ans.status == 200 and ans.body == b"hello from elsewhere"
    # with mitmproxy's CA only, the same tunnel fails: it was never intercepted
    with pytest.raises(ssl.SSLError):
        helpers.request(f"https://localhost:{other_servers['tls']}/", proxy=regular_proxy.url,
                        cafile=str(regular_proxy.ca_cert))
    # plain HTTP to another host is forwarded as is
    ans = helpers.request(f"http://localhost:{other_servers['plain']}/", proxy=regular_proxy.url)
    assert ans.status == 200 and ans.body == b"hello from elsewhere"
    after = regular_proxy.control.status()
    assert after["calls"] == before["calls"] and after["captured"] == before["captured"]
    assert after["passthrough"] == before["passthrough"] + 1


def test_other_hosts_refused_by_option(helpers, upstream, proxy_factory, other_servers):
    proxy = proxy_factory(upstream.url, mode="regular", passthrough=False)
    with pytest.raises(OSError, match="403"):
        helpers.request(f"https://localhost:{other_servers['tls']}/", proxy=proxy.url, cafile=other_servers["ca"])
    ans = helpers.request(f"http://localhost:{other_servers['plain']}/", proxy=proxy.url)
    assert ans.status == 403
    ans = helpers.request("https://api.anthropic.com/v1/messages", MESSAGES, headers=ANTHROPIC, proxy=proxy.url,
                          cafile=str(proxy.ca_cert))
    assert ans.status == 200  # intercepted hosts still work
    assert proxy.control.status()["refused"] == 2


def test_control_api_reachable_in_regular_mode(helpers, upstream, regular_proxy):
    """A plain (origin-form) request to a regular-mode proxy reaches its control API: this proxy's
    own status, not a forwarded or refused request (with the run's control secret; without it, 401)."""
    assert helpers.request(regular_proxy.url + "/_polar/status").status == 401
    ans = helpers.request(regular_proxy.url + "/_polar/status",
                          headers={"Authorization": f"Bearer {regular_proxy.control_token}"})
    assert ans.status == 200 and ans.headers["content-type"].startswith("application/json")
    status = json.loads(ans.body)
    assert status["proxy_id"] and status["capture_dir"] == str(Path(regular_proxy.capture_dir).resolve())
    assert [u["url"] for u in status["upstreams"]] == [upstream.url]
    assert status["proxy_id"] == regular_proxy.control.status()["proxy_id"]


def test_connect_tunnel_with_plain_http_to_the_upstream(helpers, upstream, regular_proxy, session_id):
    """Pi, Qwen Code and Gemini CLI open a CONNECT tunnel even to a plain-HTTP base URL: a call to
    the upstream's own address through the tunnel is intercepted and captured."""
    import http.client

    host, port = upstream.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection("127.0.0.1", regular_proxy.port, timeout=10)
    conn.set_tunnel(host, int(port))
    body = {"model": "qwen", "messages": [{"role": "user", "content": "hi #scenario:text"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json", "authorization": f"Bearer polar-{session_id}"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200 and json.loads(data)["model"] == "qwen"
    [rec] = helpers.read_records(regular_proxy.capture_dir, session_id)
    assert rec["session_source"] == "api_key" and rec["sampled_token_ids"] == upstream.upstream.responses[-1]["token_ids"]


def test_polar_proxy_cli(upstream, tmp_path):
    """`polar proxy` prints what a harness needs and serves until terminated."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from polar_core.control import ProxyControl, token_file

    port = free_port()
    env = {**os.environ, "POLAR_HOME": str(tmp_path)}
    polar = Path(sys.executable).with_name("polar")
    log = tmp_path / "cli.out"
    with open(log, "wb") as out_f:
        proc = subprocess.Popen([str(polar), "proxy", "--upstream", upstream.url, "--port", str(port),
                                 "--mode", "regular", "--timeout", "5"], stdout=out_f, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while b"control:" not in log.read_bytes() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        secret = token_file(port, tmp_path / "mitmproxy")  # the proxy's control secret, for its owner only
        assert secret.stat().st_mode & 0o777 == 0o600
        status = ProxyControl(f"http://127.0.0.1:{port}", timeout=5, token=secret.read_text().strip()).status()
        assert status["upstreams"][0]["url"] == upstream.url
        assert status["capture_dir"] == str((tmp_path / "captures").resolve())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    out = log.read_text()
    assert str(secret) in out  # says where the control secret is
    assert "HTTPS_PROXY" in out and "NODE_EXTRA_CA_CERTS" in out and "mitmproxy-ca-cert.pem" in out
    assert proc.returncode == 0
    assert (tmp_path / "mitmproxy" / "mitmproxy-ca-cert.pem").exists()


def _curl_http2() -> bool:
    import shutil
    import subprocess

    if not shutil.which("curl"):
        return False
    return "HTTP2" in subprocess.run(["curl", "-V"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not _curl_http2(), reason="needs a curl with HTTP/2")
@pytest.mark.parametrize("text,stream", [("hi #scenario:text", False), ("hi #scenario:tool #send:burst", True),
                                         ("hi #scenario:words:6 #delay:20", True)],
                         ids=["whole", "stream-at-once", "stream-relayed"])
def test_http2_client(helpers, regular_proxy, session_id, text, stream):
    """A harness that negotiates HTTP/2 with the proxy (reqwest-based CLIs do over TLS) gets the
    same answers, streamed or not, and the call is captured."""
    import subprocess

    body = json.dumps({"model": "gpt-x", "stream": stream, "messages": [{"role": "user", "content": text}]})
    run = subprocess.run(
        ["curl", "-sS", "--http2", "-x", f"http://{session_id}@127.0.0.1:{regular_proxy.port}",
         "--cacert", str(regular_proxy.ca_cert), "-H", "content-type: application/json", "-d", body,
         "-w", "\nPOLAR-HTTP-VERSION=%{http_version} STATUS=%{http_code}", "https://api.openai.com/v1/chat/completions"],
        capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    out, _, info = run.stdout.rpartition("\nPOLAR-HTTP-VERSION=")
    assert info == "2 STATUS=200", info
    parsed = helpers.parsers["openai_chat"](out.encode(), stream)
    assert parsed.error is None and (parsed.text or parsed.tool_calls)
    assert "token_ids" not in out and "routed_experts" not in out  # engine fields stay in the capture
    rec = helpers.read_records(regular_proxy.capture_dir, session_id)[-1]
    assert rec["status"] == "ok" and rec["stream"] is stream and rec["sampled_token_ids"]
    assert rec["session_source"] == "proxy_auth"
