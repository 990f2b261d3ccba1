"""The pause/resume gate, draining, policy versions and several upstreams, through real proxies."""

from __future__ import annotations

import threading
import time

from polar_proxy.process import free_port
from polar_testing.scripted_upstream import ServerThread

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]}


def _async_call(helpers, proxy, body, headers, results, key):
    def run():
        results[key] = helpers.request(proxy.url + "/v1/chat/completions", body, headers=headers, timeout=30)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_pause_drain_bump_resume(helpers, upstream, reverse_proxy, session_id):
    ctl = reverse_proxy.control
    ctl.set_policy_version(7)
    results: dict = {}
    slow = {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:words:8 #delay:100"}]}
    t_slow = _async_call(helpers, reverse_proxy, slow, {"x-polar-session": session_id}, results, "slow")
    time.sleep(0.3)  # the slow call is in flight
    assert ctl.status()["in_flight"] == 1
    t0 = time.monotonic()
    status = ctl.pause(drain=True, timeout=10)  # returns once the slow call is done
    assert status["drained"] is True and status["paused"] is True and status["in_flight"] == 0
    assert time.monotonic() - t0 > 0.3
    t_slow.join(5)
    assert results["slow"].status == 200
    # a new call is held while paused...
    t_held = _async_call(helpers, reverse_proxy, BODY, {"x-polar-session": session_id}, results, "held")
    time.sleep(0.5)
    assert "held" not in results and ctl.status()["waiting"] == 1
    # ... and released by resume, recorded with the new policy version
    ctl.resume(policy_version=8)
    t_held.join(5)
    assert results["held"].status == 200
    versions = [r["policy_version"] for r in helpers.read_records(reverse_proxy.capture_dir, session_id)]
    assert versions == [7, 8]


def test_pause_option_and_timeout(helpers, upstream, proxy_factory, session_id):
    """polar_pause at start holds calls; polar_pause_timeout turns a long hold into 'overloaded'."""
    proxy = proxy_factory(upstream.url, options={"polar_pause": True, "polar_pause_timeout": "0.5"})
    assert proxy.control.status()["paused"] is True
    body = {**BODY, "model": "claude-x", "max_tokens": 10}
    ans = helpers.request(proxy.url + "/v1/messages", body,
                          headers={"anthropic-version": "2023-06-01", "x-polar-session": session_id})
    assert ans.status == 529 and helpers.parse_error("anthropic", ans.body)["type"] == "overloaded_error"
    assert helpers.read_records(proxy.capture_dir, session_id)[-1]["error_kind"] == "overloaded"
    proxy.control.resume()
    ans = helpers.request(proxy.url + "/v1/messages", body,
                          headers={"anthropic-version": "2023-06-01", "x-polar-session": session_id})
    assert ans.status == 200


def test_several_upstreams_sticky_least_loaded_and_failover(helpers, proxy_factory):
    with ServerThread(max_model_len=8192) as a, ServerThread(max_model_len=8192) as b:
        down = f"http://127.0.0.1:{free_port()}"
        proxy = proxy_factory(",".join([a.url, b.url, down]))
        # several sessions, several calls each: every session stays on one server
        where: dict[str, set[str]] = {}
        for i in range(6):
            sid = f"multi-{i}"
            for _ in range(3):
                assert helpers.request(proxy.url + "/v1/chat/completions", BODY,
                                       headers={"x-polar-session": sid}).status == 200
            where[sid] = {r["upstream"] for r in helpers.read_records(proxy.capture_dir, sid)}
        assert all(len(v) == 1 for v in where.values())
        used = [next(iter(v)) for v in where.values()]
        assert set(used) == {a.url, b.url}  # both live servers got sessions
        assert down not in used
        ups = {u["url"]: u for u in proxy.control.status()["upstreams"]}
        assert ups[down]["healthy"] is False and ups[down]["errors"] >= 1
        # a live server goes away: its sessions move to the other one and keep working
        a.stop()
        moved = [sid for sid, u in zip(where, used) if u == a.url]
        for sid in moved:
            ans = helpers.request(proxy.url + "/v1/chat/completions", BODY, headers={"x-polar-session": sid})
            assert ans.status == 200
            assert helpers.read_records(proxy.capture_dir, sid)[-1]["upstream"] == b.url
        assert {u["url"]: u for u in proxy.control.status()["upstreams"]}[a.url]["healthy"] is False


def test_least_loaded_for_new_sessions(helpers, proxy_factory):
    """While one server is busy with a slow call, a new session goes to the idle one."""
    with ServerThread() as a, ServerThread() as b:
        proxy = proxy_factory(f"{a.url},{b.url}")
        results: dict = {}
        slow = {"model": "m", "messages": [{"role": "user", "content": "#scenario:words:6 #delay:100"}]}
        t = _async_call(helpers, proxy, slow, {"x-polar-session": "busy"}, results, "busy")
        time.sleep(0.3)
        busy_on = {u["url"] for u in proxy.control.status()["upstreams"] if u["in_flight"] == 1}
        assert len(busy_on) == 1
        helpers.request(proxy.url + "/v1/chat/completions", BODY, headers={"x-polar-session": "fresh"})
        assert helpers.read_records(proxy.capture_dir, "fresh")[0]["upstream"] not in busy_on
        t.join(5)
