"""Long agent runs through the real proxy against the scripted vLLM-format upstream (issue 16):
the output budget near the context limit, tool calls the budget cut, Codex's compaction endpoint
with the drift report naming the break, the prompt count in Anthropic's message_start, and
secrets of passthrough flows. Each test failed on the proxy before the fix."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path

import pytest
from mitmproxy import io

from polar_analysis import drift, frames
from polar_testing.scripted_upstream import ServerThread, resolve_scenario

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def _digits_history(n: int) -> list[dict]:
    """A tool result of n digits: ~2 bytes a token, far under the 4 a byte guess assumes."""
    digits = " ".join(str(i % 10) for i in range(n))
    return [
        {"role": "user", "content": "print the table #scenario:text"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {"command": "cat t"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": digits}]},
    ]


@pytest.fixture(scope="module")
def small_upstream():
    """max_model_len 600, refusing a max_tokens above the room (older vLLM; 0.32 clamps)."""
    with ServerThread(max_model_len=600, reject_large_max_tokens=True) as server:
        yield server


@pytest.fixture(scope="module")
def small_proxy(small_upstream, proxy_factory):
    return proxy_factory(small_upstream.url)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("asked", [32000, 500])
def test_output_budget_near_the_limit(helpers, small_upstream, small_proxy, session_id, stream, asked):
    """Claude Code asks 32k (more than the whole context: left out, the engine uses the room its
    real prompt leaves) or 500 (under the context, over the room: one retry with the room the
    engine names). Before: max_tokens = 600 - bytes/4 overshot and the harness was told its prompt
    was too long."""
    body = {"model": "claude-x", "max_tokens": asked, "stream": stream, "messages": _digits_history(400)}
    ans = helpers.request(small_proxy.url + "/v1/messages", body, headers={"x-polar-session": session_id, **ANTHROPIC})
    assert ans.status == 200, ans.body[:300]
    parsed = helpers.parsers["anthropic"](ans.body, stream)
    assert parsed.error is None and parsed.finish == "end_turn" and parsed.text.startswith("Hello")
    rec = helpers.read_records(small_proxy.capture_dir, session_id)[-1]
    assert rec["status"] == "ok" and 300 < rec["prompt_tokens"] < 600
    sent = rec["normalized_request"]
    if asked == 32000:
        assert "max_tokens" not in sent
    else:
        assert sent["max_tokens"] == 600 - rec["prompt_tokens"]
        assert any("max_tokens lowered" in n for n in rec["translation_notes"])


def test_prompt_that_does_not_fit_is_still_too_long(helpers, small_proxy, session_id):
    body = {"model": "claude-x", "max_tokens": 100, "messages": _digits_history(900)}
    ans = helpers.request(small_proxy.url + "/v1/messages", body, headers={"x-polar-session": session_id, **ANTHROPIC})
    assert ans.status == 400
    assert helpers.parse_error("anthropic", ans.body)["message"].startswith("prompt is too long: ")


def test_budget_not_guessed_from_bytes(helpers, upstream, reverse_proxy, session_id):
    """vLLM 0.32 clamps max_tokens itself; the byte guess used to *lower* it when bytes/4
    overestimated the prompt (long words, JSON): a 64-token answer was cut for nothing."""
    long_words = " ".join("x" * 60 for _ in range(600))  # 36 kB, 600 cheap tokens
    body = {"model": "claude-x", "max_tokens": 8000, "messages": [
        {"role": "user", "content": long_words + " #scenario:words:100"}]}
    ans = helpers.request(reverse_proxy.url + "/v1/messages", body, headers={"x-polar-session": session_id, **ANTHROPIC})
    parsed = helpers.parsers["anthropic"](ans.body, False)
    assert parsed.finish == "end_turn", parsed
    assert upstream.upstream.requests[-1]["max_tokens"] == 8000


# ---------------------------------------------------------------------------------------------
# 4. a tool call cut by the output budget
# ---------------------------------------------------------------------------------------------

def _cut_budget(upstream, whole_json: bool) -> int:
    """max_tokens that cuts scenario "tool" right after its call's JSON (whole) or inside it."""
    reply = upstream.upstream.build_reply(resolve_scenario("tool"))
    start = reply.tool_starts[0]
    for i in range(start, len(reply.pieces)):
        if reply.pieces[i].text.endswith("}}"):
            return i + 1 if whole_json else i  # i: the piece before the JSON's end
    raise AssertionError("no end of JSON")


@pytest.mark.parametrize("provider", ["anthropic", "openai_responses", "google"])
@pytest.mark.parametrize("stream,whole_json", [(False, True), (True, False), (False, False)])
def test_tool_call_cut_by_the_budget(helpers, upstream, reverse_proxy, session_id, provider, stream, whole_json):
    budget = _cut_budget(upstream, whole_json)
    text = "make the file #scenario:tool"
    if provider == "anthropic":
        path, body, headers = "/v1/messages", {"model": "claude-x", "max_tokens": budget, "stream": stream,
                                               "messages": [{"role": "user", "content": text}]}, ANTHROPIC
    elif provider == "openai_responses":
        path, body, headers = "/v1/responses", {"model": "gpt-x", "max_output_tokens": budget, "stream": stream,
                                                "input": text}, {}
    else:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        path, body, headers = f"/v1beta/models/gemini-x:{method}", {
            "contents": [{"role": "user", "parts": [{"text": text}]}],
            "generationConfig": {"maxOutputTokens": budget}}, {}
    ans = helpers.request(reverse_proxy.url + path, body, headers={"x-polar-session": session_id, **headers})
    assert ans.status == 200, ans.body[:300]
    want = {"anthropic": "max_tokens", "openai_responses": "incomplete", "google": "MAX_TOKENS"}[provider]
    if stream and provider != "google":
        # the stream shows the call as far as it was written (as the real APIs do; SDKs read
        # partial JSON leniently), then says the budget ended it
        events = helpers.sse_events(ans.body)
        if provider == "anthropic":
            end = [d for n, d in events if n == "message_delta"][0]["delta"]["stop_reason"]
        else:
            end = events[-1][1]["response"]["status"]
            done = [d["item"] for n, d in events if n == "response.output_item.done"
                    and d["item"]["type"] == "function_call"]
            assert [i["status"] for i in done] == ["incomplete"]
        assert end == want
        return
    parsed = helpers.parsers[provider](ans.body, stream)
    assert (parsed.finish or "").startswith(want), parsed
    rec = helpers.read_records(reverse_proxy.capture_dir, session_id)[-1]
    assert rec["finish_reason"] == "length" and len(rec["sampled_token_ids"]) == budget
    if whole_json:  # a whole call may be shown; never as a finished call to run
        assert any("cut by the output budget" in n for n in rec["translation_notes"])
    else:  # half a call: never shown as a call with broken arguments
        for call in parsed.tool_calls:
            assert "_raw_arguments" not in call["arguments"], parsed.tool_calls


def test_message_start_shows_the_prompt_count(helpers, upstream, reverse_proxy, session_id):
    body = {"model": "claude-x", "max_tokens": 50, "stream": True,
            "messages": [{"role": "user", "content": "hi #scenario:text"}]}
    ans = helpers.request(reverse_proxy.url + "/v1/messages", body, headers={"x-polar-session": session_id, **ANTHROPIC})
    start = [d for n, d in helpers.sse_events(ans.body) if n == "message_start"][0]
    rec = helpers.read_records(reverse_proxy.capture_dir, session_id)[-1]
    assert start["message"]["usage"]["input_tokens"] == len(rec["prompt_token_ids"]) > 0


# ---------------------------------------------------------------------------------------------
# 5. Codex compaction through the proxy, named by the drift report
# ---------------------------------------------------------------------------------------------

def test_codex_compaction_is_a_captured_call(helpers, upstream, reverse_proxy, session_id):
    head = {"x-polar-session": session_id}
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "make the file"}]},
    ]
    tools = [{"type": "function", "name": "bash", "parameters": {"type": "object", "properties": {}}}]
    first = helpers.request(reverse_proxy.url + "/v1/responses",
                            {"model": "gpt-5-codex", "input": history, "tools": tools, "store": False}, headers=head)
    assert first.status == 200
    out = first.json()["output"]
    history += [{k: v for k, v in item.items() if k != "status"} for item in out if item["type"] == "function_call"]
    history.append({"type": "function_call_output", "call_id": history[-1]["call_id"], "output": "ok"})
    compact = helpers.request(reverse_proxy.url + "/v1/responses/compact",
                              {"model": "gpt-5-codex", "input": history, "tools": tools,
                               "instructions": "You are Codex."}, headers=head)
    assert compact.status == 200, compact.body[:300]
    answer = compact.json()
    assert answer["object"] == "response.compaction" and answer["output"][-1]["type"] == "compaction"
    later = helpers.request(reverse_proxy.url + "/v1/responses",
                            {"model": "gpt-5-codex", "tools": tools,
                             "input": history[:1] + answer["output"] + [
                                 {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                                  "text": "go on"}]}]},
                            headers=head)
    assert later.status == 200
    recs = helpers.read_records(reverse_proxy.capture_dir, session_id)
    assert [r["status"] for r in recs] == ["ok", "ok", "ok"]
    assert recs[1]["native_path"] == "/v1/responses/compact" and recs[1]["sampled_token_ids"]
    assert recs[1]["translation_notes"][0].startswith("compaction: codex /responses/compact")
    assert any(n.startswith("compaction: compaction item rendered") for n in recs[2]["translation_notes"])
    report = drift.drift_report(frames.calls(reverse_proxy.capture_dir, rewards=None))
    rows = {r["call_index"]: r for r in report.filter(report["session_id"] == session_id).iter_rows(named=True)}
    assert rows[2]["cause"] == "compacted" and "codex compaction item" in rows[2]["detail"], rows[2]


# ---------------------------------------------------------------------------------------------
# 7. secrets of passthrough flows in saved flows
# ---------------------------------------------------------------------------------------------

COOKIE_SECRET = "LEAK-set-cookie-7d1e"
AUTH_SECRET = "sk-LEAK-passthrough-error-5a9b"


class CookieServer:
    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = b'{"ok": true}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("set-cookie", f"session={COOKIE_SECRET}; HttpOnly")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_passthrough_secrets_never_saved(helpers, upstream, proxy_factory, tmp_path):
    flows = tmp_path / "flows.mitm"
    proxy = proxy_factory(upstream.url, mode="regular", options={"save_stream_file": str(flows)})
    cookies = CookieServer()
    try:
        ans = helpers.request(f"http://127.0.0.1:{cookies.port}/page", proxy=f"http://127.0.0.1:{proxy.port}")
        assert ans.status == 200 and COOKIE_SECRET in ans.headers.get("set-cookie", "")  # the client gets it
        closed = cookies.port
    finally:
        cookies.close()
    # the host is gone now: this passthrough errors before any response
    ans = helpers.request(f"http://127.0.0.1:{closed}/api", {"q": 1}, headers={"authorization": f"Bearer {AUTH_SECRET}"},
                          proxy=f"http://127.0.0.1:{proxy.port}")
    assert ans.status == 502
    time.sleep(0.2)
    proxy.stop()
    data = Path(flows).read_bytes()
    assert COOKIE_SECRET.encode() not in data and AUTH_SECRET.encode() not in data
    with open(flows, "rb") as fh:
        saved = [f for f in io.FlowReader(fh).stream() if f.type == "http" and "/_polar/" not in f.request.path]
    assert len(saved) == 2 and saved[1].error is not None
