"""What a sample can reach through the real proxy: model calls, and nothing else (issue 35).

Everything here runs against real ``mitmdump -s addon/polar.py`` processes on loopback ports of
their own, in front of the scripted upstream, and tries what an adversarial sample inside a
sandbox could try (its model traffic is relayed to the proxy's loopback port, so it can send
anything there):

* the control API (``/_polar/...``) without the run's secret or with a wrong one: every endpoint
  refused with 401, in both proxy modes, and the proxy's state unchanged;
* another session's id claimed (header, query key, body field, proxy user) next to the sample's own
  issued key, or without a key: refused in the provider's error shape, counted, nothing written;
* ``CONNECT`` to a host that is not a model API and absolute-form requests to other hosts, in
  regular and reverse mode, through the proxy ``polar rollout`` starts (``open_stack``): refused,
  never reaching the host.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
from pathlib import Path

import pytest

from polar_core.control import ProxyControl

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]}


# ---------------------------------------------------------------------------------------------
# helpers


class Canary:
    """A TCP server that answers ``HTTP 200 canary`` and counts who reached it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            try:
                conn.settimeout(1)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nconnection: close\r\n\r\ncanary")
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def raw(port: int, head: str, body: bytes = b"", timeout: float = 10.0) -> tuple[int, bytes]:
    """Send one raw request (``head`` without the blank line) and read one answer: (status, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        extra = f"content-length: {len(body)}\r\n" if body else ""
        s.sendall(head.encode() + extra.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        headers, _, rest = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in headers.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), None)
        while length is not None and len(rest) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        if not headers:
            return 0, b""
        return int(headers.split(b" ", 2)[1]), rest


def _count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0


# ---------------------------------------------------------------------------------------------
# 1. the control API


CONTROL_TRIES = [  # (method, endpoint, body): everything a sample could use to change the run
    ("POST", "pause", {"drain": False}),
    ("POST", "policy_version", {"policy_version": 998}),
    ("POST", "resume", {"policy_version": 998}),
    ("POST", "sessions", {"sessions": [{"session_id": "intruder", "task_id": "t", "group_id": "other-group"}]}),
    ("GET", "sessions", None),
    ("GET", "status", None),
    ("POST", "drain", {"timeout": 0.1}),
    ("DELETE", "sessions", {"session_id": "victim-ctl"}),
]
WRONG = [{}, {"Authorization": "Bearer wrong-secret"}, {"x-polar-control-token": "wrong"},
         {"Authorization": "Basic " + base64.b64encode(b"polar:wrong").decode()}]


@pytest.mark.parametrize("mode", ["reverse", "regular"])
def test_control_api_refuses_without_the_secret(mode, helpers, upstream, proxy_factory, session_id):
    proxy = proxy_factory(upstream.url, mode=mode)
    ctl = proxy.control  # holds the run's secret
    ctl.set_policy_version(3)
    ctl.register_sessions([{"session_id": "victim-ctl", "task_id": "t0", "group_id": "g0"}])
    before = ctl.status()
    targets = [f"/_polar/{{}}"]  # origin form: what a relayed sample sends
    if mode == "regular":  # absolute form, to the proxy itself and to an intercepted host
        targets += [f"http://127.0.0.1:{proxy.port}/_polar/{{}}", "http://api.openai.com/_polar/{}"]
    tried = 0
    for target in targets:
        for method, name, body in CONTROL_TRIES:
            for headers in WRONG:
                data = json.dumps(body).encode() if body is not None else b""
                hdrs = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                host = "api.openai.com" if "api.openai.com" in target else f"127.0.0.1:{proxy.port}"
                status, answer = raw(proxy.port, f"{method} {target.format(name)} HTTP/1.1\r\nhost: {host}\r\n"
                                     f"content-type: application/json\r\n{hdrs}", data)
                assert status == 401, (target, method, name, headers, status, answer[:200])
                assert b"control secret" in answer
                tried += 1
    after = ctl.status()
    assert after["paused"] is False and after["policy_version"] == 3  # nothing changed
    assert after["control_refused"] == before["control_refused"] + tried
    sessions = ctl.sessions()["sessions"]
    assert "intruder" not in sessions
    # the victim is still registered with its labels: a call with its key is recorded under them
    key = ctl.register_sessions([{"session_id": "victim-ctl", "task_id": "t0", "group_id": "g0"}])["keys"]["victim-ctl"]
    ans = helpers.request(proxy.url + "/v1/chat/completions", BODY, headers={"authorization": f"Bearer {key}"})
    assert ans.status == 200  # not paused
    rec = helpers.read_records(proxy.capture_dir, "victim-ctl")[-1]
    assert (rec["policy_version"], rec["group_id"], rec["session_source"]) == (3, "g0", "key")
    # a client without the secret gets a clear error, not a status
    with pytest.raises(PermissionError, match="control secret"):
        ProxyControl(proxy.url, token="wrong").status()


# ---------------------------------------------------------------------------------------------
# 2. other sessions


def _provider_call(provider: str, key: str | None, extra_headers: dict[str, str], body_extra: dict,
                   query: str = "") -> tuple[str, dict[str, str], dict]:
    headers = {"content-type": "application/json", **extra_headers}
    if provider == "anthropic":
        path = "/v1/messages"
        body = {"model": "claude-x", "max_tokens": 20, "messages": [{"role": "user", "content": "hi #scenario:text"}]}
        headers["anthropic-version"] = "2023-06-01"
        if key:
            headers["x-api-key"] = key
    elif provider == "google":
        path = "/v1beta/models/gemini-x:generateContent"
        body = {"contents": [{"role": "user", "parts": [{"text": "hi #scenario:text"}]}]}
        if key:
            headers["x-goog-api-key"] = key
    else:
        path = "/v1/chat/completions"
        body = dict(BODY)
        if key:
            headers["authorization"] = f"Bearer {key}"
    return path + query, headers, {**body, **body_extra}


CLAIMS = {  # how a sample holding its own key could claim the victim's session
    "x-polar-session": ({"x-polar-session": "{victim}"}, {}, ""),
    "x-session-id": ({"x-session-id": "{victim}"}, {}, ""),
    "query-key": ({}, {}, "?key=polar-{victim}"),
    "body-session_id": ({}, {"session_id": "{victim}"}, ""),
    "body-metadata": ({}, {"metadata": {"polar_session": "{victim}"}}, ""),
    "proxy-user": ({"proxy-authorization": "Basic {basic}"}, {}, ""),
    "victim-key-too": ({}, {}, "?key={victim_key}"),  # two sessions' keys at once
}


@pytest.fixture(scope="module")
def keyed(upstream, proxy_factory):
    """A proxy with a victim and an attacker session registered (keys issued), the victim with one call."""
    import urllib.request

    proxy = proxy_factory(upstream.url)
    keys = proxy.control.register_sessions([
        {"session_id": "victim", "task_id": "tv", "group_id": "gv", "sample_index": 0},
        {"session_id": "attacker", "task_id": "ta", "group_id": "ga", "sample_index": 1}])["keys"]
    req = urllib.request.Request(proxy.url + "/v1/chat/completions", json.dumps(BODY).encode(),
                                 {"content-type": "application/json", "authorization": f"Bearer {keys['victim']}"})
    from polar_core.net import OPENER

    with OPENER.open(req, timeout=30) as resp:
        assert resp.status == 200
    return proxy, keys


@pytest.mark.parametrize("provider", ["openai_chat", "anthropic", "google"])
@pytest.mark.parametrize("claim", sorted(CLAIMS))
def test_a_sample_cannot_speak_for_another_session(claim, provider, helpers, keyed):
    proxy, keys = keyed
    victim_file = proxy.capture_dir / "sessions" / "victim.jsonl"
    attacker_file = proxy.capture_dir / "sessions" / "attacker.jsonl"
    before = (_count(victim_file), _count(attacker_file), proxy.control.status()["session_refused"])
    hdrs, body_extra, query = CLAIMS[claim]
    fill = {"victim": "victim", "victim_key": keys["victim"],
            "basic": base64.b64encode(b"victim:x").decode()}
    hdrs = {k: v.format(**fill) for k, v in hdrs.items()}
    body_extra = json.loads(json.dumps(body_extra).replace("{victim}", "victim"))
    path, headers, body = _provider_call(provider, keys["attacker"], hdrs, body_extra, query.format(**fill))
    ans = helpers.request(proxy.url + path, body, headers=headers)
    assert ans.status == 403, (ans.status, ans.body[:300])
    err = helpers.parse_error(provider, ans.body)  # the provider's own error shape
    assert "session" in err["message"]
    if provider == "anthropic":
        assert err["type"] == "permission_error"
    elif provider == "google":
        assert err["status"] == "PERMISSION_DENIED"
    after = (_count(victim_file), _count(attacker_file), proxy.control.status()["session_refused"])
    assert after == (before[0], before[1], before[2] + 1)  # counted, nothing written anywhere


@pytest.mark.parametrize("how", ["x-polar-session", "polar-key", "proxy-user", "harness-header"])
def test_without_a_key_a_bound_session_is_out_of_reach(how, helpers, keyed):
    proxy, _ = keyed
    victim_file = proxy.capture_dir / "sessions" / "victim.jsonl"
    n, refused = _count(victim_file), proxy.control.status()["session_refused"]
    hdrs = {"x-polar-session": {"x-polar-session": "victim"}, "polar-key": {"authorization": "Bearer polar-victim"},
            "proxy-user": {"proxy-authorization": "Basic " + base64.b64encode(b"victim:polar").decode()},
            "harness-header": {"session-id": "victim"}}[how]
    ans = helpers.request(proxy.url + "/v1/chat/completions", BODY, headers=hdrs)
    assert ans.status == 403 and "bound to a key" in helpers.parse_error("openai_chat", ans.body)["message"]
    assert _count(victim_file) == n and proxy.control.status()["session_refused"] == refused + 1


def test_a_keyed_call_lands_in_its_own_session_with_the_runners_labels(helpers, keyed):
    """The sample's own key: recorded under its session, with the labels the runner registered,
    whatever task/group headers it sends (a sample cannot move itself into another GRPO group)."""
    proxy, keys = keyed
    ans = helpers.request(proxy.url + "/v1/chat/completions", BODY,
                          headers={"authorization": f"Bearer {keys['attacker']}", "x-polar-group": "gv",
                                   "x-polar-task": "tv", "x-polar-sample": "0", "x-polar-session": "attacker"})
    assert ans.status == 200
    rec = helpers.read_records(proxy.capture_dir, "attacker")[-1]
    assert (rec["session_id"], rec["task_id"], rec["group_id"], rec["sample_index"]) == ("attacker", "ta", "ga", 1)


# ---------------------------------------------------------------------------------------------
# 3. nothing but model calls, through the proxy polar rollout starts


@pytest.fixture(scope="module")
def rollout_stacks(upstream, tmp_path_factory):
    """The proxies ``polar rollout`` starts (``open_stack``) in front of the scripted upstream, both modes."""
    import contextlib
    import os

    from polar_runtime.rollout import open_stack

    home = tmp_path_factory.mktemp("polar-home")
    old = os.environ.get("POLAR_HOME")
    os.environ["POLAR_HOME"] = str(home)  # its CA and control secret: never the user's
    try:
        with contextlib.ExitStack() as es:
            stacks = {mode: es.enter_context(open_stack(mode=mode, capture_dir=home / mode, upstream=upstream.url,
                                                        exact_history=False, log=lambda _: None))
                      for mode in ("proxy", "base_url")}
            yield stacks
    finally:
        if old is None:
            os.environ.pop("POLAR_HOME", None)
        else:
            os.environ["POLAR_HOME"] = old


def _port(stack) -> int:
    return int(stack.endpoint.proxy_url.rsplit(":", 1)[1])


def test_regular_mode_connects_only_to_model_apis(rollout_stacks):
    stack = rollout_stacks["proxy"]
    port = _port(stack)
    canary = Canary()
    try:
        refused = stack.control.status()["refused"]
        for target in (f"127.0.0.1:{canary.port}", "pypi.org:443", "files.pythonhosted.org:443"):
            status, body = raw(port, f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n")
            assert status == 403, (target, status, body)
            assert f"CONNECT {target} refused".encode() in body and b"api.openai.com" in body  # what the harness logs
        status, body = raw(port, f"GET http://127.0.0.1:{canary.port}/simple/ HTTP/1.1\r\nhost: 127.0.0.1:{canary.port}\r\n")
        assert status == 403 and b"refused" in body
        status, body = raw(port, "GET http://pypi.org/simple/ HTTP/1.1\r\nhost: pypi.org\r\n")
        assert status == 403 and b"refused" in body
        assert canary.hits == 0
        assert stack.control.status()["refused"] == refused + 5
        status, _ = raw(port, "CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n")
        assert status == 200  # a model API: the tunnel opens (TLS is terminated by the proxy)
    finally:
        canary.close()


def test_reverse_mode_never_forwards_elsewhere(rollout_stacks):
    stack = rollout_stacks["base_url"]
    port = _port(stack)
    canary = Canary()
    try:
        target = f"127.0.0.1:{canary.port}"
        status, _ = raw(port, f"CONNECT {target} HTTP/1.1\r\nhost: {target}\r\n")
        assert not 200 <= status < 300
        status, body = raw(port, f"GET http://{target}/simple/ HTTP/1.1\r\nhost: {target}\r\n")
        assert not 200 <= status < 300 and b"canary" not in body
        status, body = raw(port, f"POST http://{target}/v1/chat/completions HTTP/1.1\r\nhost: {target}\r\n"
                                 "content-type: application/json\r\n", json.dumps(BODY).encode())
        assert b"canary" not in body  # a model call at most (refused here: no session key), never the host
        assert canary.hits == 0
    finally:
        canary.close()


@pytest.mark.parametrize("mode", ["proxy", "base_url"])
def test_rollout_proxy_serves_registered_sessions_only(mode, helpers, rollout_stacks):
    """``polar rollout``'s proxy: a call without an issued key is refused; with one it is served."""
    stack = rollout_stacks[mode]
    base = stack.endpoint.base_url
    ans = helpers.request(base + "/v1/chat/completions", BODY, headers={"x-polar-session": "free-rider"})
    assert ans.status == 403 and "no session key" in helpers.parse_error("openai_chat", ans.body)["message"]
    assert not (stack.capture_dir / "sessions" / "free-rider.jsonl").exists()
    key = stack.control.register_sessions([{"session_id": f"ok-{mode}", "task_id": "t"}])["keys"][f"ok-{mode}"]
    ans = helpers.request(base + "/v1/chat/completions", BODY, headers={"authorization": f"Bearer {key}"})
    assert ans.status == 200
