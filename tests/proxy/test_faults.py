"""Faults answer provider-shaped errors, leave a capture record, and the proxy keeps serving."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from polar_proxy.process import free_port

CALLS = {
    # provider: (path, body builder, extra headers)
    "openai_chat": ("/v1/chat/completions",
                    lambda text, stream: {"model": "gpt-x", "stream": stream,
                                          "messages": [{"role": "user", "content": text}]}, {}),
    "anthropic": ("/v1/messages",
                  lambda text, stream: {"model": "claude-x", "max_tokens": 64, "stream": stream,
                                        "messages": [{"role": "user", "content": text}]},
                  {"anthropic-version": "2023-06-01"}),
    "openai_responses": ("/v1/responses",
                         lambda text, stream: {"model": "gpt-x", "stream": stream, "input": text}, {}),
    "google": ("/v1beta/models/gemini-x:{method}",
               lambda text, stream: {"contents": [{"role": "user", "parts": [{"text": text}]}]}, {}),
}


def call(helpers, proxy, provider, text, stream, session, **kw):
    path, make, headers = CALLS[provider]
    path = path.format(method="streamGenerateContent?alt=sse" if stream else "generateContent")
    return helpers.request(proxy.url + path, make(text, stream), headers={**headers, "x-polar-session": session}, **kw)


def last_record(helpers, proxy, session):
    records = helpers.read_records(proxy.capture_dir, session)
    assert records, "no capture record for the failed call"
    return records[-1]


@pytest.mark.parametrize("provider", list(CALLS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_upstream_status_errors(helpers, reverse_proxy, session_id, provider, stream):
    # 500 -> provider-shaped 500
    ans = call(helpers, reverse_proxy, provider, "hi #fault:500", stream, session_id)
    assert ans.status == 500 and ans.headers["content-type"] == "application/json"
    assert "scripted internal server error" in helpers.parse_error(provider, ans.body)["message"]
    rec = last_record(helpers, reverse_proxy, session_id)
    assert (rec["status"], rec["error_kind"], rec["http_status"]) == ("error", "upstream_error", 500)
    # 429 -> 429 with the upstream's Retry-After
    ans = call(helpers, reverse_proxy, provider, "hi #fault:429", stream, session_id)
    assert ans.status == 429 and ans.headers.get("retry-after") == "7"
    helpers.parse_error(provider, ans.body)
    assert last_record(helpers, reverse_proxy, session_id)["error_kind"] == "rate_limited"
    # context overflow -> each provider's context-length error
    ans = call(helpers, reverse_proxy, provider, "hi #fault:context", stream, session_id)
    assert ans.status == 400
    err = helpers.parse_error(provider, ans.body)
    assert "context length" in err["message"] or "too long" in err["message"] or "exceeds the maximum" in err["message"]
    assert "8193" in err["message"]  # the counts of vLLM's message survive in every provider's wording
    if provider == "openai_chat":
        assert err.get("code") == "context_length_exceeded"
    assert last_record(helpers, reverse_proxy, session_id)["error_kind"] == "context_length"
    # the connection is dropped before any answer
    ans = call(helpers, reverse_proxy, provider, "hi #fault:refuse", stream, session_id)
    assert ans.status == 502
    helpers.parse_error(provider, ans.body)
    # a connection closed before any answer once (a pooled keep-alive connection the server
    # closed as it was reused): sent again, answered, and the record says so
    ans = call(helpers, reverse_proxy, provider, "hi #fault:drop_once #scenario:text", stream, session_id)
    assert ans.status == 200
    rec = last_record(helpers, reverse_proxy, session_id)
    assert rec["status"] == "ok" and any("sent again" in n for n in rec["translation_notes"])
    # and the proxy keeps serving
    ans = call(helpers, reverse_proxy, provider, "hi #scenario:text", stream, session_id)
    assert ans.status == 200
    assert helpers.parsers[provider](ans.body, stream).text.startswith("Hello from the scripted upstream")
    assert last_record(helpers, reverse_proxy, session_id)["status"] == "ok"


@pytest.mark.parametrize("provider", ["anthropic", "openai_responses"])
def test_timeout_answers_within_the_configured_time(helpers, reverse_proxy, session_id, provider):
    """polar_upstream_timeout is 1.5 s here: a hanging upstream gets a 504 in the harness's shape."""
    for stream in (False, True):
        t0 = time.monotonic()
        ans = call(helpers, reverse_proxy, provider, "hi #fault:hang", stream, session_id)
        elapsed = time.monotonic() - t0
        assert ans.status == 504 and 1.4 < elapsed < 4.0
        helpers.parse_error(provider, ans.body)
        rec = last_record(helpers, reverse_proxy, session_id)
        assert rec["error_kind"] == "timeout" and rec["t_upstream_sent"] is not None


@pytest.mark.parametrize("provider", list(CALLS))
def test_broken_and_stalled_streams(helpers, upstream, reverse_proxy, session_id, provider):
    """Mid-stream failures become the provider's in-stream error; sampled tokens are kept."""
    ans = call(helpers, reverse_proxy, provider, "hi #scenario:words:20 #fault:cut", True, session_id)
    assert ans.status == 200  # headers went out before the break
    parsed = helpers.parsers[provider](ans.body, True)
    assert parsed.error is not None
    rec = last_record(helpers, reverse_proxy, session_id)
    got = upstream.upstream.responses[-1]
    assert got.get("cut") and rec["status"] == "error" and rec["error_kind"] == "upstream_error"
    assert rec["sampled_token_ids"] == got["token_ids"] and len(rec["sampled_token_ids"]) == 10
    assert len(rec["sampled_logprobs"]) == 10 and rec["prompt_token_ids"] == got["prompt_token_ids"]

    t0 = time.monotonic()
    ans = call(helpers, reverse_proxy, provider, "hi #fault:hang_stream", True, session_id)
    assert ans.status == 200 and time.monotonic() - t0 < 4.0
    assert helpers.parsers[provider](ans.body, True).error is not None
    rec = last_record(helpers, reverse_proxy, session_id)
    assert rec["error_kind"] == "timeout" and rec["prompt_token_ids"]


def test_request_errors(helpers, reverse_proxy, session_id):
    # malformed JSON
    ans = helpers.request(reverse_proxy.url + "/v1/messages", b'{"model": "x", "messages": [',
                          headers={"anthropic-version": "2023-06-01", "x-polar-session": session_id})
    assert ans.status == 400 and helpers.parse_error("anthropic", ans.body)["type"] == "invalid_request_error"
    rec = last_record(helpers, reverse_proxy, session_id)
    assert rec["error_kind"] == "invalid_request" and "malformed JSON" in rec["error"]
    # unsupported feature (translator refuses)
    ans = helpers.request(reverse_proxy.url + "/v1/responses",
                          {"model": "x", "input": "hi", "previous_response_id": "resp_1"},
                          headers={"x-polar-session": session_id})
    assert ans.status == 400 and helpers.parse_error("openai_responses", ans.body)
    # unknown path
    ans = helpers.request(reverse_proxy.url + "/v1/embeddings", {"input": "x"}, headers={"x-polar-session": session_id})
    assert ans.status == 404 and helpers.parse_error("openai_chat", ans.body)
    ans = helpers.request(reverse_proxy.url + "/v1/chat/completions",
                          {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]},
                          headers={"x-polar-session": session_id})
    assert ans.status == 200


@pytest.mark.parametrize("bad", ["../../etc/passwd", "..", "a/b", "-leading-dash", "x" * 200, "sp ace", "a..b"])
def test_hostile_session_ids_refused(helpers, reverse_proxy, bad):
    before = sorted(p.name for p in (reverse_proxy.capture_dir / "sessions").iterdir())
    for headers in ({"x-polar-session": bad}, {"authorization": f"Bearer polar-{bad}"}, {"x-api-key": f"polar-{bad}"}):
        ans = helpers.request(reverse_proxy.url + "/v1/messages",
                              {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                              headers={"anthropic-version": "2023-06-01", **headers})
        assert ans.status == 400
        assert "session" in helpers.parse_error("anthropic", ans.body)["message"]
    after = sorted(p.name for p in (reverse_proxy.capture_dir / "sessions").iterdir())
    assert after == before
    assert not any(reverse_proxy.capture_dir.parent.glob("**/passwd*"))


def test_upstream_down(helpers, proxy_factory, session_id):
    """No server at all: mitmproxy's HTML 502 never reaches the harness, a provider error does."""
    proxy = proxy_factory(f"http://127.0.0.1:{free_port()}")
    for provider in CALLS:
        for stream in (False, True):
            ans = call(helpers, proxy, provider, "hi", stream, session_id)
            assert ans.status == 502 and ans.headers["content-type"] == "application/json"
            assert "refused" in helpers.parse_error(provider, ans.body)["message"]
            rec = last_record(helpers, proxy, session_id)
            assert rec["error_kind"] == "upstream_refused" and rec["t_upstream_sent"] is None
            assert rec["provider"] == provider and rec["stream"] is stream
    status = proxy.control.status()
    assert status["errors"] == 8 and status["upstreams"][0]["healthy"] is False


def test_client_gone_mid_stream(helpers, reverse_proxy, session_id):
    """The harness hangs up mid-stream: the record keeps what was sampled, the slot is released."""
    conn = http.client.HTTPConnection("127.0.0.1", reverse_proxy.port, timeout=10)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go #scenario:words:40 #delay:40"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json",
                                                                    "x-polar-session": session_id})
    resp = conn.getresponse()
    got = b""
    while got.count(b"data:") < 5:
        got += resp.read1(4096)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 5
    while not helpers.read_records(reverse_proxy.capture_dir, session_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = last_record(helpers, reverse_proxy, session_id)
    assert rec["status"] == "error" and rec["error_kind"] == "client_disconnected"
    assert 3 <= len(rec["sampled_token_ids"]) < 41 and len(rec["sampled_logprobs"]) == len(rec["sampled_token_ids"])
    assert reverse_proxy.control.status()["in_flight"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_gone_while_upstream_works(helpers, reverse_proxy, session_id, stream):
    """The harness hangs up before the upstream answered at all: the record is written at once,
    not when the upstream finally answers, and the late answer changes nothing."""
    conn = http.client.HTTPConnection("127.0.0.1", reverse_proxy.port, timeout=10)
    # whole: the upstream answers after 30 x 40 ms (within the proxy's 1.5 s timeout); stream: the
    # upstream never sends the answer's head, and the proxy is still waiting for it.
    text = "go #scenario:words:30 #delay:40" if not stream else "go #scenario:words:30 #fault:hang"
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": text}]}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json",
                                                                    "x-polar-session": session_id})
    time.sleep(0.3)
    t_gone = time.monotonic()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    while not helpers.read_records(reverse_proxy.capture_dir, session_id) and time.monotonic() - t_gone < 5:
        time.sleep(0.02)
    assert time.monotonic() - t_gone < 1.5, "the record waited for the upstream"
    rec = last_record(helpers, reverse_proxy, session_id)
    assert rec["status"] == "error" and rec["error_kind"] == "client_disconnected" and rec["http_status"] == 499
    time.sleep(1.2 if not stream else 0.2)  # the whole answer arrives meanwhile
    assert len(helpers.read_records(reverse_proxy.capture_dir, session_id)) == 1
    assert reverse_proxy.control.status()["in_flight"] == 0
    ans = call(helpers, reverse_proxy, "openai_chat", "hi #scenario:text", stream, session_id)
    assert ans.status == 200
