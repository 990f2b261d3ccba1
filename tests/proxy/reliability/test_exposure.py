"""Secrets and exposure.

* No API key or auth header value reaches the disk (capture directory or the ``-w`` flow file),
  on every path a request can take: captured calls, refused and failed calls, side calls, the
  control API, passthrough and refused traffic in regular mode.
* Hostile session ids (``../x``, absolute paths, 10 kB strings, NUL bytes) are refused, from every
  place a session id can come from, and never create a file.
* The proxy (and its internal stream relay) listens on 127.0.0.1 only by default.
* Intercepted hosted-API traffic never leaves for the real host; other hosts are reached only when
  passthrough allows it.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from mitmproxy import io

SECRETS = {
    "bearer": "sk-live-LEAK-bearer-4f1c",
    "x-api-key": "sk-ant-LEAK-xapikey-77aa",
    "x-goog-api-key": "AIza-LEAK-goog-9d0e",
    "query": "LEAK-query-key-31b8",
    "cookie": "LEAK-cookie-51c2",
    "proxy": "LEAK-proxy-password-0c3d",
    "api-key": "LEAK-azure-api-key-6e6e",
}


class Canary:
    """A plain HTTP server standing in for a real host: counts every request it gets."""

    def __init__(self):
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                length = int(self.headers.get("content-length") or 0)
                hits.append((self.command, self.path, self.rfile.read(length)))
                body = b'{"canary": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _any

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _raw(port: int, method: str, target: str, headers: dict[str, str], body: bytes = b"",
         timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 exchange with exactly these header bytes (no client-side validation)."""
    lines = [f"{method} {target} HTTP/1.1", f"host: {headers.pop('host', f'127.0.0.1:{port}')}",
             f"content-length: {len(body)}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape") + body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    resp = b"".join(chunks)
    head, _, rest = resp.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {}
    for line in header_lines:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    if hdrs.get("transfer-encoding") == "chunked":
        out, pos = b"", 0
        while True:
            end = rest.index(b"\r\n", pos)
            size = int(rest[pos:end].split(b";")[0], 16)
            if size == 0:
                break
            out += rest[end + 2: end + 2 + size]
            pos = end + 2 + size + 2
        rest = out
    return int(status_line.split()[1]), hdrs, rest


def _all_bytes(paths: list[Path]) -> list[tuple[Path, bytes]]:
    out = []
    for p in paths:
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        out += [(f, f.read_bytes()) for f in files]
    return out


def _assert_no_secrets(paths: list[Path]) -> int:
    n = 0
    for f, data in _all_bytes(paths):
        n += 1
        for name, secret in SECRETS.items():
            for form in (secret, base64.b64encode(f"u:{secret}".encode()).decode()):
                assert form.encode() not in data, f"{name} secret leaked into {f}"
    return n


def _secret_headers(session: str | None = None) -> dict[str, str]:
    h = {"authorization": f"Bearer {SECRETS['bearer']}", "x-api-key": SECRETS["x-api-key"],
         "x-goog-api-key": SECRETS["x-goog-api-key"], "cookie": f"sid={SECRETS['cookie']}",
         "api-key": SECRETS["api-key"]}
    if session:
        h["x-polar-session"] = session
    return h


@pytest.mark.slow
def test_no_secret_on_disk_on_any_path(rel, upstream_proc, proxies, tmp_path):
    flows_rev, flows_reg, flows_closed = tmp_path / "reverse.mitm", tmp_path / "regular.mitm", tmp_path / "closed.mitm"
    rev = proxies(upstream_proc.url, options={"save_stream_file": str(flows_rev)})
    with Canary() as canary:
        reg = proxies(upstream_proc.url, mode="regular", options={"save_stream_file": str(flows_reg)})
        reg_closed = proxies(upstream_proc.url, mode="regular", passthrough=False,
                             options={"save_stream_file": str(flows_closed)})
        q = SECRETS["query"]
        # reverse mode: every provider whole and streamed, then the odd paths
        for provider in rel.PROVIDERS:
            for stream in (False, True):
                path, h, body = rel.build_call(provider, "#scenario:tool", stream)
                if provider == "google":
                    path += ("&" if "?" in path else "?") + f"key={q}"
                status, _, data = _raw(rev.port, "POST", path, {**h, **_secret_headers("sec-ok")}, body)
                assert status == 200 and rel.is_complete(provider, stream, status, data), data[:300]
        odd = [
            ("POST", "/v1/chat/completions", b'{"model": "x", "messages": [', "sec-badjson"),  # malformed JSON
            ("POST", "/v1/embeddings", b'{"input": "x"}', "sec-404"),  # no model API there
            ("GET", "/v1/models", b"", "sec-side"),  # side call
            ("POST", "/v1/messages/count_tokens",
             b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', "sec-count"),
            ("POST", "/v1/messages", b'{"model": "m", "max_tokens": 5, "messages": []}', "../evil"),  # bad session
            ("GET", "/_polar/status", b"", None),  # control API
            ("POST", "/v1/chat/completions",
             json.dumps({"model": "m", "messages": [{"role": "user", "content": "#fault:500"}]}).encode(), "sec-500"),
        ]
        for method, path, body, sid in odd:
            h = _secret_headers(sid)
            if "/messages" in path:
                h["anthropic-version"] = "2023-06-01"
            status, _, _ = _raw(rev.port, method, path + f"?key={q}", h, body)
            assert status in (200, 400, 401, 404, 500), (path, status)  # 401: control API without its secret
        # regular mode: an intercepted call, a call to a non-intercepted host (passthrough), a refused one
        auth = "Basic " + base64.b64encode(f"sec-proxyuser:{SECRETS['proxy']}".encode()).decode()
        path, h, body = rel.build_call("openai_chat", "#scenario:text", False)
        status, _, data = _raw(reg.port, "POST", f"http://api.openai.com{path}?key={q}",
                               {**h, **_secret_headers(), "proxy-authorization": auth, "host": "api.openai.com"}, body)
        assert status == 200, data[:300]
        other = f"127.0.0.1:{canary.port}"
        status, _, data = _raw(reg.port, "POST", f"http://{other}/anything?key={q}",
                               {**_secret_headers(), "proxy-authorization": auth, "host": other}, b"{}")
        assert status == 200 and b"canary" in data and len(canary.hits) == 1  # passthrough is allowed here
        status, _, _ = _raw(reg_closed.port, "POST", f"http://{other}/anything?key={q}",
                            {**_secret_headers(), "proxy-authorization": auth, "host": other}, b"{}")
        assert status == 403 and len(canary.hits) == 1
        time.sleep(0.3)
    for p in (rev, reg, reg_closed):
        p.stop()  # flushes the flow files
    assert flows_rev.stat().st_size > 0 and flows_reg.stat().st_size > 0
    n = _assert_no_secrets([rev.capture_dir, reg.capture_dir, reg_closed.capture_dir, flows_rev, flows_reg,
                            flows_closed])
    assert n >= 6  # capture files of the reverse and regular proxies, and the three flow files
    with open(flows_rev, "rb") as fh:
        saved = [f for f in io.FlowReader(fh).stream() if f.type == "http"]
    # every odd request is in the file except control-API calls, which saved flows leave out by default
    assert len(saved) >= 8 + len([o for o in odd if not o[1].startswith("/_polar/")])
    assert not [f for f in saved if f.request.path.startswith("/_polar/")]


HOSTILE = {
    "dotdot": "../x",
    "dotdot-deep": "../../../../tmp/polar-escape",
    "absolute": "/etc/passwd",
    "absolute-tmp": "/tmp/polar-absolute",
    "long": "a" * 10_240,
    "nul": "abc\x00def",
    "nul-dotdot": "ok\x00/../../x",
    "backslash": "..\\..\\x",
    "dot": ".",
    "hidden": ".polar-cache",
}


@pytest.mark.slow
def test_hostile_session_ids_are_refused_everywhere(rel, upstream_proc, proxies, tmp_path):
    proxy = proxies(upstream_proc.url, mode="regular", intercept_hosts=["api.anthropic.com"])
    sessions = proxy.capture_dir / "sessions"
    before = {p.name for p in sessions.iterdir()}
    roots_before = {p.name for p in Path("/tmp").iterdir() if p.name.startswith("polar-escape")}
    path, h, body = rel.build_call("anthropic", "#scenario:text", False)
    refused = 0
    for name, bad in HOSTILE.items():
        places = [{"x-polar-session": bad}, {"x-session-id": bad}, {"authorization": f"Bearer polar-{bad}"},
                  {"x-api-key": f"polar-{bad}"}, {"x-goog-api-key": f"polar-{bad}"},
                  {"proxy-authorization": "Basic " + base64.b64encode(f"{bad}:x".encode()).decode()},
                  {"session-id": bad}]
        for extra in places:
            status, hdrs, data = _raw(proxy.port, "POST", f"http://api.anthropic.com{path}",
                                      {**h, **extra, "host": "api.anthropic.com"}, body)
            assert 400 <= status < 500, (name, extra.keys(), status, data[:200])
            if hdrs.get("content-type", "").startswith("application/json"):
                err = rel.error_shape("anthropic", data)
                assert "session" in err["message"].lower() or "header" in err["message"].lower(), err
            refused += 1
    assert refused == len(HOSTILE) * 7
    assert {p.name for p in sessions.iterdir()} == before
    assert [p for p in proxy.capture_dir.rglob("*") if p.is_file()] == []
    assert {p.name for p in Path("/tmp").iterdir() if p.name.startswith("polar-escape")} == roots_before
    assert not Path("/tmp/polar-absolute.jsonl").exists()
    # and a good session still works on the same proxy
    status, _, data = _raw(proxy.port, "POST", f"http://api.anthropic.com{path}",
                           {**h, "x-polar-session": "fine-1", "host": "api.anthropic.com"}, body)
    assert status == 200 and rel.is_complete("anthropic", False, status, data)


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by process ``pid``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, state, inode = parts[1], parts[3], parts[9]
            if state != "0A" or inode not in inodes:
                continue
            addr_hex, port_hex = local.split(":")
            if v6:
                raw = bytes.fromhex(addr_hex)
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            else:
                addr = socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1])
            out.append((addr, int(port_hex, 16)))
    return out


def _outside_address() -> str | None:
    """A local non-loopback IPv4 address of this machine, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


@pytest.mark.slow
def test_listens_on_loopback_only_by_default(upstream_proc, proxies):
    from polar_proxy.commands import proxy_command
    from polar_proxy.process import ProxyProcess
    import inspect

    assert inspect.signature(ProxyProcess.__init__).parameters["host"].default == "127.0.0.1"
    host_default = inspect.signature(proxy_command).parameters["host"].default
    assert host_default == "127.0.0.1"
    proxy = proxies(upstream_proc.url)
    sockets = _listening(proxy.proc.pid)
    assert {port for _, port in sockets} >= {proxy.port} and len(sockets) >= 2  # the proxy and its relay
    assert all(addr in ("127.0.0.1", "::1") for addr, _ in sockets), sockets
    outside = _outside_address()
    if outside:
        with pytest.raises(OSError):
            socket.create_connection((outside, proxy.port), timeout=2).close()


@pytest.mark.slow
def test_bare_mitmdump_with_the_addon_listens_on_loopback(upstream_proc, tmp_path, mitm_confdir):
    """``mitmdump -s addon/polar.py`` without --listen-host (mitmproxy's default is every interface)."""
    import subprocess

    import urllib.error
    import urllib.request

    from polar_core.control import token_file
    from polar_core.net import OPENER as opener  # never via HTTP(S)_PROXY
    from polar_core.net import free_port
    from polar_proxy.process import ENTRY_SCRIPT, mitmdump_path

    port = free_port()
    proc = subprocess.Popen([mitmdump_path(), "-s", str(ENTRY_SCRIPT), "--mode", f"reverse:{upstream_proc.url}",
                             "--listen-port", str(port), "--set", f"confdir={mitm_confdir}",
                             "--set", f"polar_capture_dir={tmp_path / 'cap'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with opener.open(f"http://127.0.0.1:{port}/_polar/status", timeout=1):
                    raise AssertionError("the control API answered without its secret")
            except urllib.error.HTTPError as exc:
                assert exc.code == 401  # plain mitmdump: the control API wants the run's secret too
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "mitmdump did not start"
                time.sleep(0.1)
        secret = token_file(port, mitm_confdir)  # made at start, written for the owner only
        assert secret.stat().st_mode & 0o777 == 0o600
        req = urllib.request.Request(f"http://127.0.0.1:{port}/_polar/status",
                                     headers={"Authorization": f"Bearer {secret.read_text().strip()}"})
        with opener.open(req, timeout=5) as resp:
            assert resp.status == 200
        sockets = _listening(proc.pid)
        assert port in {p for _, p in sockets}
        assert all(addr in ("127.0.0.1", "::1") for addr, _ in sockets), sockets
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(10)


@pytest.mark.slow
def test_intercepted_hosts_never_reach_the_real_host(rel, upstream_proc, proxies):
    """A canary plays the hosted API: configured as intercepted, it must never see a request,
    whatever the path; another host is reached only while passthrough is on."""
    with Canary() as hosted, Canary() as other:
        hosted_addr, other_addr = f"localhost:{hosted.port}", f"127.0.0.1:{other.port}"
        for passthrough in (True, False):
            proxy = proxies(upstream_proc.url, mode="regular", intercept_hosts=[hosted_addr], passthrough=passthrough)
            requests = []
            for provider in rel.PROVIDERS:
                for stream in (False, True):
                    path, h, body = rel.build_call(provider, "#scenario:text", stream, "canary-1")
                    requests.append(("POST", path, h, body, provider, stream))
            requests += [("GET", "/v1/models", {}, b"", None, False), ("POST", "/v1/embeddings", {}, b"{}", None, False),
                         ("GET", "/", {}, b"", None, False), ("POST", "/v1/files", {}, b"x", None, False),
                         ("POST", "/v1/chat/completions", {}, b"not json", None, False),
                         ("GET", "/v1/chat/completions", {}, b"", None, False)]
            for method, path, h, body, provider, stream in requests:
                status, _, data = _raw(proxy.port, method, f"http://{hosted_addr}{path}",
                                       {**h, "host": hosted_addr}, body)
                if provider:
                    assert rel.is_complete(provider, stream, status, data), (provider, stream, status, data[:200])
                else:
                    assert status in (200, 400, 404, 405), (path, status)
            assert hosted.hits == [], f"intercepted traffic reached the real host: {hosted.hits[:3]}"
            n_before = len(other.hits)
            status, _, _ = _raw(proxy.port, "GET", f"http://{other_addr}/ping", {"host": other_addr})
            if passthrough:
                assert status == 200 and len(other.hits) == n_before + 1
            else:
                assert status == 403 and len(other.hits) == n_before
            proxy.stop()
