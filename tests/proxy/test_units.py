"""Unit tests of the proxy's parts: session resolution, capture writer, upstream pool, engine
adapters and the SSE stream translator (bytes split anywhere)."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy.test import tflow

from polar_core.schema import CallRecord
from polar_proxy.accumulate import ChatAccumulator, synthetic_chunks
from polar_proxy.addon import Polar
from polar_proxy.calls import Call
from polar_proxy.state import ProxyState
from polar_proxy.streaming import SSEStream
from polar_proxy.capture import CaptureError, CaptureWriter
from polar_proxy.engines import get_engine
from polar_proxy.engines.base import TokenData
from polar_proxy.providers import PROVIDERS
from polar_proxy.sessions import (
    SessionError,
    basic_user,
    harness_name,
    resolve_session,
    scrub_query_string,
)
from polar_proxy.upstreams import UpstreamPool, normalize_url, parse_upstreams, relay_error_event


# -- sessions ------------------------------------------------------------------------------------

def _basic(user: str, password: str = "x") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_session_precedence():
    h = {"x-polar-session": "explicit", "proxy-authorization": _basic("proxyuser"),
         "authorization": "Bearer polar-keyed", "session-id": "codex-thread", "x-claude-code-session-id": "cc"}
    order = [("x-polar-session", "explicit", "header"), ("proxy-authorization", "proxyuser", "proxy_auth"),
             ("authorization", "keyed", "api_key"), ("session-id", "codex-thread", "harness_header"),
             ("x-claude-code-session-id", "cc", "harness_header")]
    for drop, want, source in order:
        s = resolve_session(h, {}, connection_id="c0ffee")
        assert (s.id, s.source) == (want, source)
        del h[drop]
    s = resolve_session(h, {}, connection_id="1234-abcd")
    assert (s.id, s.source) == ("conn-1234abcd", "connection")


def test_session_sources():
    assert resolve_session({"x-session-id": "ses_1"}).id == "ses_1"  # OpenCode's own header
    assert resolve_session({}, proxy_auth=_basic("tunnel-user")).source == "proxy_auth"  # from CONNECT
    assert resolve_session({"x-api-key": "polar-a1"}).id == "a1"
    assert resolve_session({"x-goog-api-key": "polar-g1"}).id == "g1"
    assert resolve_session({}, {"key": "polar-q1"}).id == "q1"
    # real keys are not sessions
    s = resolve_session({"authorization": "Bearer sk-live-123", "x-api-key": "sk-ant"}, {}, connection_id="c1")
    assert s.source == "connection"


@pytest.mark.parametrize("bad", ["../x", "..", "a/b", "a\\b", "", " ", "-x", ".hidden", "x" * 129, "a..b", "é",
                                 "a\x00b", "con\nnection"])
def test_hostile_session_ids(bad):
    for headers in ({"x-polar-session": bad}, {"authorization": f"Bearer polar-{bad}"},
                    {"proxy-authorization": _basic(bad)} if bad.strip() and ":" not in bad else {"x-polar-session": bad}):
        if not bad.strip():
            continue  # an empty value is no value: falls through to the next source
        with pytest.raises(SessionError):
            resolve_session(headers, {}, connection_id="c")


@given(st.text(min_size=1, max_size=200))
def test_any_accepted_session_id_is_a_plain_file_name(value):
    try:
        s = resolve_session({"x-polar-session": value}, {}, connection_id="c")
    except SessionError:
        return
    assert "/" not in s.id and "\\" not in s.id and ".." not in s.id and not s.id.startswith(".")
    assert os.path.basename(s.id) == s.id and len(s.id) <= 128


def test_basic_user_and_helpers():
    assert basic_user(_basic("u1", "p:w")) == "u1"
    assert basic_user("Bearer abc") is None and basic_user("Basic !!notb64") is None
    assert harness_name({"user-agent": "claude-cli/2.1.332 (external, sdk-cli)"}) == "claude-code"
    assert harness_name({"user-agent": "QwenCode/0.24.4 (linux; x64)"}) == "qwen-code"
    assert harness_name({"originator": "codex_exec", "user-agent": "x"}) == "codex"
    assert harness_name({"user-agent": "OpenAI/JS 6.26.0", "x-polar-harness": "pi"}) == "pi"
    # what the product runs on every flow before it can be saved (httputil.scrub; the dict helper
    # scrub_headers was never called by the product and is gone)
    from mitmproxy.test import tflow

    from polar_proxy.httputil import scrub

    f = tflow.tflow()
    f.request.headers.update({"Authorization": "Bearer s", "X-Api-Key": "k", "Accept": "a"})
    f.request.path = "/v1beta/m:gen?alt=sse&key=AIzaSECRET"
    scrub(f)
    assert "authorization" not in f.request.headers and "x-api-key" not in f.request.headers
    assert f.request.headers["accept"] == "a" and "AIzaSECRET" not in f.request.path
    assert scrub_query_string("/v1beta/m:gen?alt=sse&key=AIzaSECRET") == "/v1beta/m:gen?alt=sse&key=<redacted>"


# -- capture writer -------------------------------------------------------------------------------

def _record(session: str, i: int, n_tokens: int = 50) -> CallRecord:
    return CallRecord(call_id=f"{session}-{i}", session_id=session, call_index=i, provider="anthropic",
                      prompt_token_ids=list(range(n_tokens)), sampled_token_ids=[i] * n_tokens,
                      sampled_logprobs=[-0.5] * n_tokens, native_request={"big": "x" * 5000})


def _write_many(directory: str, worker: int, n: int) -> None:
    w = CaptureWriter(directory)
    for i in range(n):
        w.write(_record("shared", worker * 1000 + i, 200))
    w.close()


def test_capture_lines_are_atomic_across_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), k, 100)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    lines = (tmp_path / "sessions" / "shared.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b""
    records = [orjson.loads(line) for line in lines[:-1]]  # every line parses: no interleaving
    assert len(records) == 300 and len({r["call_id"] for r in records}) == 300


def test_capture_refuses_escape_and_counts_existing(tmp_path):
    w = CaptureWriter(tmp_path)
    for bad in ("../evil", "a/b", "..", ""):
        with pytest.raises(CaptureError):
            w.write(_record(bad, 0))
    assert list(tmp_path.iterdir()) == [tmp_path / "sessions"]
    for i in range(3):
        w.write(_record("s1", i))
    assert w.existing_calls("s1") == 3 and w.existing_calls("nope") == 0
    # a torn last line (crash mid-write elsewhere) is not counted as a call and does not break appends
    with open(tmp_path / "sessions" / "s1.jsonl", "ab") as f:
        f.write(b'{"torn": ')
    assert w.existing_calls("s1") == 3
    w.close()


def test_a_failed_capture_write_is_counted_logged_and_never_referred_to(tmp_path, monkeypatch, caplog):
    """Disk full once in a growing session: the failed record is counted in the proxy's status and
    logged; the next record of that session is self-contained (no delta reference), and every
    later record reads back whole (a delta against the failed record would lose them all)."""
    import logging

    from polar_core import capture_delta as cd
    from polar_core.schema import read_capture_lines
    from polar_proxy import capture, control
    from polar_proxy.calls import finalize

    s = ProxyState()
    s.writer = CaptureWriter(tmp_path)
    real_write, fail = os.write, {"left": 0}

    def flaky(fd, data):
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(capture.os, "write", flaky)

    def call(i: int) -> Call:
        rec = CallRecord(call_id=f"s-{i}", session_id="s", call_index=i, provider="openai_chat", status="ok",
                         native_request={"messages": [{"role": "user", "content": "x" * 100}] * (i + 1)})
        c = Call(rec, PROVIDERS["openai_chat"], tflow.tflow())
        c.tokens.prompt_token_ids = list(range(100 + 30 * i))
        c.tokens.sampled_token_ids, c.tokens.sampled_logprobs = [i] * 5, [-0.5] * 5
        s.calls[c.flow.id] = c
        return c

    with caplog.at_level(logging.ERROR, logger="polar"):
        finalize(s, call(0))
        fail["left"] = 1
        finalize(s, call(1))  # ENOSPC
        for i in (2, 3, 4):
            finalize(s, call(i))
    st = control.status(s)
    assert st["capture_errors"] == 1 and st["captured"] == 4
    assert any("capture failed" in r.getMessage() and "s" in r.getMessage() for r in caplog.records)
    raw = [orjson.loads(x) for x in (tmp_path / "sessions" / "s.jsonl").read_bytes().splitlines() if x.strip()]
    assert [r["call_id"] for r in raw] == ["s-0", "s-2", "s-3", "s-4"]
    assert "ref" not in raw[1][cd.DELTA_KEY] and raw[1]["prompt_token_ids"] == list(range(160))  # self-contained
    assert raw[2][cd.DELTA_KEY]["ref"] == "s-2"  # later records are deltas again, against written ones
    got = list(read_capture_lines(tmp_path / "sessions" / "s.jsonl"))
    assert [(r["call_id"], len(r["prompt_token_ids"])) for r in got] == [("s-0", 100), ("s-2", 160), ("s-3", 190),
                                                                          ("s-4", 220)]
    s.writer.close()


def test_a_torn_failed_write_does_not_swallow_the_next_record(tmp_path, monkeypatch):
    """A short write whose closing newline fails too leaves a line without its end: the next
    record must start on a fresh line, or it is glued to the torn one and lost."""
    from polar_core.schema import read_capture_lines
    from polar_proxy import capture

    w = CaptureWriter(tmp_path)
    real_write, state = os.write, {"mode": None}

    def flaky(fd, data):
        if state["mode"] == "short":
            state["mode"] = "full"
            return real_write(fd, data[: len(data) // 2])
        if state["mode"] == "full":
            state["mode"] = None
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(capture.os, "write", flaky)
    w.write(_record("t", 0))
    state["mode"] = "short"
    with pytest.raises(CaptureError):
        w.write(_record("t", 1))
    w.write(_record("t", 2))
    w.write(_record("t", 3))
    assert [r["call_id"] for r in read_capture_lines(tmp_path / "sessions" / "t.jsonl")] == ["t-0", "t-2", "t-3"]
    assert w.failed == 1
    w.close()


def test_capture_writer_is_fast(tmp_path):
    w = CaptureWriter(tmp_path)
    rec = _record("fast", 0, 2000)
    t0 = time.perf_counter()
    for _ in range(200):
        w.write(rec)
    per_call = (time.perf_counter() - t0) / 200
    assert per_call < 0.005, f"{per_call * 1e3:.2f} ms per record"


# -- upstream pool --------------------------------------------------------------------------------

def test_upstream_urls():
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_url("http://localhost:8000/v1/") == "http://localhost:8000"
    assert parse_upstreams("http://a:1, http://b:2") == ["http://a:1", "http://b:2"]
    for bad in ("ftp://x", "http://a:1,http://a:1"):
        with pytest.raises(ValueError):
            parse_upstreams(bad)


def test_pool_sticky_least_loaded_backoff():
    pool = UpstreamPool(["http://a:1", "http://b:2"], backoff_base=0.05)
    a = pool.pick("s1")
    pool.acquire(a)
    b = pool.pick("s2")  # least loaded
    assert b is not a
    pool.release(a)
    assert pool.pick("s1") is a and pool.pick("s2") is b  # sticky
    pool.mark_failed(a, "refused")
    assert pool.pick("s1") is b  # out of rotation while backing off
    pool.mark_failed(b, "refused")
    assert pool.pick("s3").url in ("http://a:1", "http://b:2")  # all out: the one due soonest is tried
    time.sleep(0.06)
    assert pool.upstreams[0].failures == 1 and pool._eligible(a, time.monotonic())
    pool.mark_failed(a, "again")
    assert a.retry_at - time.monotonic() > 0.05  # exponential
    pool.mark_ok(a)
    assert a.healthy and a.failures == 0


def test_pool_session_moves_off_a_server_that_is_out_and_stays_moved():
    pool = UpstreamPool(["http://a:1", "http://b:2"], backoff_base=30.0)
    a = pool.pick("s1")
    assert a.url == "http://a:1" and pool.moved_from is None and pool.pick("s1") is a and pool.moved_from is None
    pool.mark_failed(a, "refused")
    b = pool.pick("s1")
    assert b.url == "http://b:2" and pool.moved_from is a
    assert (a.sessions, b.sessions) == (0, 1)
    pool.mark_ok(a)  # back: the session stays where its prefix cache now is
    assert pool.pick("s1") is b and pool.moved_from is None
    assert pool.pick(None) is a and pool.moved_from is None  # side calls move nothing


def test_pool_ties_are_broken_by_pinned_sessions_then_list_order():
    pool = UpstreamPool(["http://a:1", "http://b:2", "http://c:3"])
    a, b, c = pool.upstreams
    assert [pool.pick(f"s{i}") for i in range(4)] == [a, b, c, a]  # equal load: fewest sessions, then order
    pool.acquire(a)
    pool.acquire(b)
    assert pool.pick("s4") is c  # fewest calls in flight wins over pinned sessions
    pool.acquire(c)
    pool.acquire(c)
    assert pool.pick("s5") is b  # a and b tie on in-flight calls; b holds fewer sessions


# -- engines --------------------------------------------------------------------------------------

def test_vllm_engine_reads_whole_and_chunks():
    eng = get_engine("vllm")
    req = eng.prepare({"model": "m", "messages": [], "return_tokens_as_token_ids": True})
    assert req["logprobs"] is True and req["return_token_ids"] is True and "return_tokens_as_token_ids" not in req
    td = TokenData()
    eng.read_response({"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [5, 6],
                       "logprobs": {"content": [{"token": "a", "logprob": -0.1}, {"token": "b", "logprob": -0.2}]}}]}, td)
    assert (td.prompt_token_ids, td.sampled_token_ids, td.sampled_logprobs) == ([1, 2], [5, 6], [-0.1, -0.2])
    td = TokenData()
    chunks = [{"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
              {"choices": [{"index": 0, "delta": {}, "token_ids": [9], "logprobs": {"content": [{"logprob": -1.0}]}}]},
              {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [10, 11],
                            "logprobs": {"content": [{"logprob": -2.0}, {"logprob": -3.0}]}}]},
              {"choices": [], "usage": {"prompt_tokens": 3}}]
    for c in chunks:
        eng.read_chunk(c, td)
    assert (td.prompt_token_ids, td.sampled_token_ids, td.sampled_logprobs) == ([1, 2, 3], [9, 10, 11], [-1.0, -2.0, -3.0])


def test_sglang_engine():
    eng = get_engine("sglang")
    req = eng.prepare({"model": "m", "messages": []})
    assert req["return_meta_info"] and req["return_prompt_token_ids"] and req["logprobs"]
    td = TokenData()
    eng.read_response({"choices": [{"index": 0, "prompt_token_ids": [1, 2], "message": {"content": "ab"},
                                    "meta_info": {"output_token_logprobs": [[-0.5, 7, "a"], [-0.25, 8, "b"]]}}]}, td)
    assert (td.prompt_token_ids, td.sampled_token_ids, td.sampled_logprobs) == ([1, 2], [7, 8], [-0.5, -0.25])
    with pytest.raises(ValueError):
        get_engine("tgi")


# -- SSE stream translation -----------------------------------------------------------------------

def _vllm_stream() -> tuple[bytes, list[int], list[float]]:
    """A vLLM-shaped chat stream: role chunk with prompt ids, reasoning, text, a tool call, usage."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "served"}
    ids, lps, events = [], [], []
    events.append({**base, "prompt_token_ids": [1, 2, 3],
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    deltas = [{"reasoning": "think"}, {"reasoning": " more"}, {"content": "Hé"}, {"content": "llo\n\n"}, {},
              {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "bash", "arguments": ""}}]},
              {"tool_calls": [{"index": 0, "function": {"arguments": "{\"command\": \"ls\"}"}}]}]
    for i, d in enumerate(deltas):
        tid, lp = 100 + i, -0.1 * (i + 1)
        ids.append(tid)
        lps.append(lp)
        last = i == len(deltas) - 1
        events.append({**base, "choices": [{"index": 0, "delta": d, "token_ids": [tid],
                                            "logprobs": {"content": [{"token": "t", "logprob": lp, "bytes": [116],
                                                                      "top_logprobs": []}]},
                                            "finish_reason": "tool_calls" if last else None}]})
    events.append({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(ids),
                                                    "total_tokens": 3 + len(ids)}})
    body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return body, ids, lps


def _run_stream(provider: str, pieces: list[bytes]) -> tuple[bytes, Call]:
    state = ProxyState()
    flow = tflow.tflow()
    prov = PROVIDERS[provider]
    call = Call(CallRecord(session_id="s", provider=provider), prov, flow)
    call.translator = prov.new_stream("asked-model", None)
    stream = SSEStream(state, call)
    out = []
    for p in pieces + [b""]:
        res = stream(p)
        assert isinstance(res, list) and all(res), "never an empty chunk (it would end the HTTP/1 body)"
        out += res
    return b"".join(out), call


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
       provider=st.sampled_from(sorted(PROVIDERS)))
def test_stream_split_anywhere(cuts, provider):
    body, ids, lps = _vllm_stream()
    whole, call_whole = _run_stream(provider, [body])
    bounds = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    pieces = [body[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    split, call = _run_stream(provider, pieces)
    assert call.finalized and call.record.status == "ok"
    assert call.tokens.prompt_token_ids == [1, 2, 3]
    assert call.tokens.sampled_token_ids == ids and call.tokens.sampled_logprobs == lps
    assert call.record.output_text == "Héllo\n\n" and call.record.output_reasoning == "think more"
    assert call.record.output_tool_calls == [{"id": "call_1", "name": "bash", "arguments": "{\"command\": \"ls\"}"}]
    # the translated stream does not depend on where the input was cut (ids/timestamps aside)
    assert _strip_ids(split) == _strip_ids(whole)


def _strip_ids(sse: bytes) -> list:
    out = []
    for block in sse.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                out.append(_drop_keys(json.loads(line[5:])))
    return out


def _drop_keys(x):
    if isinstance(x, dict):
        return {k: _drop_keys(v) for k, v in x.items() if k not in ("id", "created", "created_at", "signature",
                                                                     "responseId", "item_id", "call_id")}
    if isinstance(x, list):
        return [_drop_keys(v) for v in x]
    return x


def test_stream_relay_error_and_early_end():
    body, ids, _ = _vllm_stream()
    cut = body.index(b"data: ", 400)
    out, call = _run_stream("anthropic", [body[:cut] + relay_error_event("timeout", "stalled")])
    assert call.record.status == "error" and call.record.error_kind == "timeout"
    assert b"event: error" in out and call.tokens.sampled_token_ids == ids[: len(call.tokens.sampled_token_ids)]
    assert call.tokens.sampled_token_ids  # what arrived before the stall is kept
    out, call = _run_stream("openai_chat", [body[:cut]])  # upstream closed without [DONE]
    assert call.record.error_kind == "upstream_error" and b"error" in out


def test_synthetic_chunks_round_trip():
    resp = {"id": "x", "created": 1, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": "hi", "reasoning": "r",
                                     "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    acc = ChatAccumulator()
    for c in synthetic_chunks(resp):
        acc.feed_chunk(c)
    whole = ChatAccumulator()
    whole.feed_whole(resp)
    assert (acc.content, acc.reasoning, acc.tools, acc.finish_reason, acc.usage) == \
        (whole.content, whole.reasoning, whole.tools, whole.finish_reason, whole.usage)


# -- the addon inside mitmproxy's test harness (options, validation, commands) ---------------------

def test_addon_options_validation_and_commands(tmp_path):
    from mitmproxy import exceptions
    from mitmproxy.test import taddons

    addon = Polar()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, polar_upstream="http://127.0.0.1:1,127.0.0.1:2", polar_capture_dir=str(tmp_path),
                       polar_upstream_timeout="2.5", polar_intercept_hosts=["api.example.com", "*.corp.dev"])
        s = addon.state
        assert [u.url for u in s.pool.upstreams] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        assert s.timeout == 2.5 and s.writer.root == tmp_path.resolve()
        assert addon.intercept.host("api.example.com", 443, None, s.pool)
        assert addon.intercept.host("llm.corp.dev", 443, None, s.pool)
        assert addon.intercept.host("127.0.0.1", 2, None, s.pool)  # an upstream itself
        assert not addon.intercept.host("github.com", 443, None, s.pool)
        for bad in ({"polar_upstream_timeout": "soon"}, {"polar_upstream_timeout": "0"},
                    {"polar_upstream": "ftp://x"}, {"polar_intercept_hosts": ["a b"]},
                    {"polar_max_tokens_cap": -1}, {"polar_pause_timeout": "-1"}, {"polar_engine": "tgi"},
                    {"polar_proxy_id": "../x"}, {"polar_policy_version": -1}):
            with pytest.raises(exceptions.OptionsError):
                tctx.configure(addon, **bad)
        assert s.timeout == 2.5  # a refused value leaves the old one in place
        tctx.configure(addon, polar_engine="sglang", polar_policy_version=3)
        assert s.engine.name == "sglang" and s.policy_version == 3
        tctx.configure(addon, polar_policy_version=None)  # unset: unknown
        assert s.policy_version is None
        tctx.command(addon.pause_cmd)
        assert s.gate.paused and json.loads(tctx.command(addon.status_cmd))["paused"] is True
        tctx.command(addon.resume_cmd)
        assert not s.gate.paused
        tctx.configure(addon, polar_pause=True)
        assert s.gate.paused
