"""The pause/resume gate, draining, policy versions and several upstreams, through real proxies."""

from __future__ import annotations

import threading
import time

from polar_proxy.process import free_port
from polar_proxy.upstreams import SESSION_MOVED
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
            recs = helpers.read_records(proxy.capture_dir, sid)
            assert recs[-1]["upstream"] == b.url
            # the move is said once, on the call that moved (its prefix cache on a is lost)
            notes = [n for n in recs[-1]["translation_notes"] if n.startswith(SESSION_MOVED)]
            assert len(notes) == 1 and notes[0].startswith(f"{SESSION_MOVED} from {a.url} (")
            assert notes[0].endswith(f") to {b.url}: its prefix cache there is lost")
            assert not any(SESSION_MOVED in n for r in recs[:-1] for n in r["translation_notes"])
            helpers.request(proxy.url + "/v1/chat/completions", BODY, headers={"x-polar-session": sid})
            assert not any(SESSION_MOVED in n for n in helpers.read_records(proxy.capture_dir, sid)[-1]["translation_notes"])
        status = proxy.control.status()
        assert {u["url"]: u for u in status["upstreams"]}[a.url]["healthy"] is False
        assert status["session_moves"] == len(moved) >= 1  # proxy stats


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


def _until(condition, limit: float = 60.0) -> None:
    """Poll until ``condition()`` holds (a generous limit: CI machines are loaded)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_pause_and_policy_version_reach_every_replica(helpers, proxy_factory):
    """One gate in front of both replicas: draining waits for the calls in flight on each, calls of
    sessions pinned to either are held, and resume's version labels what both serve next."""
    with ServerThread() as a, ServerThread() as b:
        proxy = proxy_factory(f"{a.url},{b.url}", upstream_timeout=60)  # the slow calls take seconds
        ctl = proxy.control
        ctl.set_policy_version(1)
        for sid in ("on-a", "on-b"):  # equal load: the first goes to a, the second to b
            assert helpers.request(proxy.url + "/v1/chat/completions", BODY, headers={"x-polar-session": sid}).status == 200
        assert [helpers.read_records(proxy.capture_dir, sid)[0]["upstream"] for sid in ("on-a", "on-b")] == [a.url, b.url]
        results: dict = {}
        slow = {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:words:20 #delay:100"}]}
        slow_calls = [_async_call(helpers, proxy, slow, {"x-polar-session": sid}, results, f"slow-{sid}")
                      for sid in ("on-a", "on-b")]
        _until(lambda: sorted(u["in_flight"] for u in ctl.status()["upstreams"]) == [1, 1])  # one on each
        status = ctl.pause(drain=True, timeout=60)  # returns once the calls on both replicas are done
        assert status["drained"] is True and status["in_flight"] == 0
        for t in slow_calls:
            t.join(30)
        assert results["slow-on-a"].status == results["slow-on-b"].status == 200
        held = [_async_call(helpers, proxy, BODY, {"x-polar-session": sid}, results, f"held-{sid}")
                for sid in ("on-a", "on-b")]
        _until(lambda: ctl.status()["waiting"] == 2)
        assert not any(k.startswith("held") for k in results)
        ctl.resume(policy_version=2)
        for t in held:
            t.join(30)
        for sid, url in (("on-a", a.url), ("on-b", b.url)):
            recs = helpers.read_records(proxy.capture_dir, sid)
            assert [(r["upstream"], r["policy_version"]) for r in recs] == [(url, 1), (url, 1), (url, 2)]


def test_a_session_moved_to_another_replica_keeps_its_exact_token_history(helpers, proxy_factory):
    """Exact history across a move: the ledger is the proxy's, so the call on the new replica is
    prompted with the ids the old one sampled."""
    with ServerThread(max_model_len=8192) as a, ServerThread(max_model_len=8192) as b:
        proxy = proxy_factory(f"{a.url},{b.url}", options={"polar_exact_history": True})
        sid = "exact-move"
        messages = [{"role": "user", "content": "say hi #scenario:text"}]

        def ask() -> dict:
            r = helpers.request(proxy.url + "/v1/chat/completions", {"model": "m", "messages": messages},
                                headers={"x-polar-session": sid})
            assert r.status == 200, r.body[:300]
            return helpers.parsers["openai_chat"](r.body, False)

        first = ask()
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "again #scenario:text"}]
        a.stop()
        ask()
        r1, r2 = helpers.read_records(proxy.capture_dir, sid)
        assert (r1["upstream"], r2["upstream"]) == (a.url, b.url)
        assert any(n.startswith(f"{SESSION_MOVED} from {a.url}") for n in r2["translation_notes"])
        assert r2["history"] == "exact"
        lead = r1["prompt_token_ids"] + r1["sampled_token_ids"]
        assert r2["prompt_token_ids"][: len(lead)] == lead
