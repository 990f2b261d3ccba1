"""Deterministic multi-turn calls through a real mitmdump + the addon + the scripted upstream.

Every provider, streaming and not, reverse and regular mode, with Pi's real first and second
requests: the answer must parse in the provider's shape, and the capture record must hold
exactly the prompt ids, sampled ids and logprobs the upstream sent, and the normalized request
exactly as the upstream received it.
"""

from __future__ import annotations

import copy
import time

import pytest

from polar_testing.scripted_upstream import DEFAULT_SCENARIOS

PROVIDERS = {
    # provider: (fixture prefix, hosted API host for regular mode)
    "openai_chat": ("pi.chat", "api.openai.com"),
    "anthropic": ("pi.anthropic", "api.anthropic.com"),
    "openai_responses": ("pi.responses", "api.openai.com"),
    "google": ("pi.gemini", "generativelanguage.googleapis.com"),
}
TOOL = DEFAULT_SCENARIOS["tool"]
TEXT = DEFAULT_SCENARIOS["text"]


def build(helpers, provider: str, turn: int, stream: bool) -> tuple[str, dict, dict]:
    prefix, _ = PROVIDERS[provider]
    fx = helpers.fixture_request(prefix + (".second" if turn else ""))
    body = copy.deepcopy(fx["body"])
    path = fx["path"]
    if provider == "google":
        if not stream:
            path = path.replace(":streamGenerateContent?alt=sse", ":generateContent")
    else:
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    return path, body, fx["headers"]


def requested_model(provider: str, path: str, body: dict) -> str:
    if provider == "google":
        return path.split("/models/")[1].split(":")[0]
    return body["model"]


@pytest.mark.parametrize("mode", ["reverse", "regular"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_two_turns_exact_tokens(helpers, upstream, reverse_proxy, regular_proxy, session_id, provider, stream, mode):
    proxy = reverse_proxy if mode == "reverse" else regular_proxy
    expected = [TOOL, TEXT]
    for turn in (0, 1):
        path, body, headers = build(helpers, provider, turn, stream)
        headers = {**headers, "x-polar-session": session_id}
        if mode == "reverse":
            ans = helpers.request(proxy.url + path, body, headers=headers)
        else:  # harness untouched: hosted URL, the proxy in between (absolute-form HTTP)
            ans = helpers.request(f"http://{PROVIDERS[provider][1]}{path}", body, headers=headers, proxy=proxy.url)
        assert ans.status == 200, ans.body[:500]
        if stream:
            assert ans.headers["content-type"].startswith("text/event-stream")
        parsed = helpers.parsers[provider](ans.body, stream)
        assert parsed.error is None
        want = expected[turn]
        assert parsed.text == want.get("text", "")
        if provider != "google":
            assert parsed.model == requested_model(provider, path, body)  # the name the harness asked for
        if turn == 0:
            assert [(t["name"], t["arguments"]) for t in parsed.tool_calls] == \
                [(t["name"], t["arguments"]) for t in want["tool_calls"]]
            if provider in ("openai_chat", "anthropic"):
                assert parsed.reasoning == want["reasoning"]
        else:
            assert parsed.tool_calls == []

        sent = upstream.upstream.requests[-1]
        got = upstream.upstream.responses[-1]
        records = helpers.read_records(proxy.capture_dir, session_id)
        assert len(records) == turn + 1
        rec = records[-1]
        assert rec["call_index"] == turn and rec["status"] == "ok" and rec["provider"] == provider
        assert rec["session_source"] == "header" and rec["stream"] is stream
        assert rec["requested_model"] == requested_model(provider, path, body)
        assert rec["prompt_token_ids"] == got["prompt_token_ids"] and rec["prompt_token_ids"]
        assert rec["sampled_token_ids"] == got["token_ids"] and rec["sampled_token_ids"]
        assert rec["sampled_logprobs"] == got["logprobs"]
        assert rec["finish_reason"] == ("tool_calls" if turn == 0 else "stop")
        assert rec["normalized_request"] == sent
        assert sent["model"] == "scripted-model" and sent["logprobs"] is True and sent["return_token_ids"] is True
        assert sent["stream"] is stream
        if stream:
            assert sent["stream_options"]["include_usage"] is True
        # a harness limit under the context goes as asked; none (or one of the whole context or
        # more) is left out: the engine uses the room its real prompt leaves
        assert sent.get("max_tokens", 0) < 8192
        assert rec["output_text"] == want.get("text", "")
        assert [t["name"] for t in rec["output_tool_calls"]] == [t["name"] for t in want.get("tool_calls", [])]
        assert rec["prompt_tokens"] == len(got["prompt_token_ids"])
        assert rec["completion_tokens"] == len(got["token_ids"])
        assert rec["native_request"] == body
        assert rec["t_request_in"] <= rec["t_upstream_sent"] <= rec["t_upstream_end"] <= rec["t_response_out"]


def test_two_tool_calls_and_length_finish(helpers, upstream, reverse_proxy, session_id):
    """Two tool calls in one turn, and a turn cut by max_tokens with empty content (ids kept)."""
    for n, stream in enumerate((True, False)):
        body = {"model": "m", "max_tokens": 100, "stream": stream,
                "messages": [{"role": "user", "content": "list and read #scenario:tools2"}]}
        ans = helpers.request(reverse_proxy.url + "/v1/messages", body,
                              headers={"x-polar-session": session_id, "anthropic-version": "2023-06-01"})
        parsed = helpers.parsers["anthropic"](ans.body, stream)
        assert [t["name"] for t in parsed.tool_calls] == ["bash", "read"] and parsed.finish == "tool_use"
        body["messages"][0]["content"] = "think long #scenario:length"
        ans = helpers.request(reverse_proxy.url + "/v1/messages", body,
                              headers={"x-polar-session": session_id, "anthropic-version": "2023-06-01"})
        parsed = helpers.parsers["anthropic"](ans.body, stream)
        assert parsed.finish == "max_tokens" and parsed.text == "" and parsed.tool_calls == []
        got = upstream.upstream.responses[-1]
        # the record of a streamed call is written once its last byte went out: on a loaded machine
        # the client can read the answer before the line is in the file
        deadline = time.monotonic() + 10
        while len(recs := helpers.read_records(reverse_proxy.capture_dir, session_id)) < 2 * (n + 1):
            assert time.monotonic() < deadline, f"{len(recs)} records"
            time.sleep(0.05)
        rec = recs[-1]
        assert rec["finish_reason"] == "length" and rec["output_text"] == ""
        assert rec["sampled_token_ids"] == got["token_ids"] and len(rec["sampled_token_ids"]) > 5


def test_max_tokens_capped_to_context(helpers, upstream, reverse_proxy, session_id):
    body = {"model": "m", "max_tokens": 128000, "messages": [{"role": "user", "content": "hi #scenario:text"}]}
    ans = helpers.request(reverse_proxy.url + "/v1/messages", body,
                          headers={"x-polar-session": session_id, "anthropic-version": "2023-06-01"})
    assert ans.status == 200
    sent = upstream.upstream.requests[-1]
    # more than the whole context (8192): left out, the engine uses the room the real prompt leaves
    assert "max_tokens" not in sent
    body["max_tokens"] = 100
    helpers.request(reverse_proxy.url + "/v1/messages", body,
                    headers={"x-polar-session": session_id, "anthropic-version": "2023-06-01"})
    assert upstream.upstream.requests[-1]["max_tokens"] == 100  # the harness's own limit, as asked


def test_streaming_is_incremental(helpers, reverse_proxy, session_id):
    """True streaming: the first event reaches the client long before the upstream is done."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go #scenario:words:12 #delay:80"}]}
    ans = helpers.request(reverse_proxy.url + "/v1/chat/completions", body, headers={"x-polar-session": session_id})
    assert ans.status == 200
    assert ans.t_total > 1.0  # 13 tokens x 80 ms
    assert ans.t_first is not None and ans.t_first < ans.t_total - 0.6
    parsed = helpers.parsers["openai_chat"](ans.body, True)
    assert parsed.text.split() == [f"w{i}" for i in range(12)]


def test_synthetic_stream_mode(helpers, upstream, proxy_factory, session_id):
    proxy = proxy_factory(upstream.url, stream_mode="synthetic")
    for provider in PROVIDERS:
        path, body, headers = build(helpers, provider, 0, True)
        ans = helpers.request(proxy.url + path, body, headers={**headers, "x-polar-session": session_id})
        assert ans.status == 200, ans.body[:300]
        parsed = helpers.parsers[provider](ans.body, True)
        assert [t["name"] for t in parsed.tool_calls] == ["bash"]
        sent = upstream.upstream.requests[-1]
        assert sent["stream"] is False  # upstream called whole, replayed as a stream
        rec = helpers.read_records(proxy.capture_dir, session_id)[-1]
        assert rec["stream"] is True and rec["stream_mode"] == "synthetic"
        assert rec["sampled_token_ids"] == upstream.upstream.responses[-1]["token_ids"]


def test_side_calls(helpers, reverse_proxy, session_id):
    ans = helpers.request(reverse_proxy.url + "/v1/models")
    assert ans.status == 200 and ans.json()["data"][0]["id"] == "scripted-model"
    assert ans.json()["data"][0]["max_model_len"] == 8192
    ans = helpers.request(reverse_proxy.url + "/v1/models", headers={"anthropic-version": "2023-06-01"})
    assert ans.json()["data"][0]["type"] == "model"
    ans = helpers.request(reverse_proxy.url + "/v1beta/models/gemini-2.5-pro", headers={"x-goog-api-key": "k"})
    assert ans.json()["name"] == "models/gemini-2.5-pro"
    body = {"model": "claude-x", "messages": [{"role": "user", "content": "count these words please"}]}
    ans = helpers.request(reverse_proxy.url + "/v1/messages/count_tokens", body,
                          headers={"anthropic-version": "2023-06-01", "x-polar-session": session_id})
    assert ans.status == 200 and ans.json()["input_tokens"] > 0
    # side calls are not model calls: nothing captured
    assert helpers.read_records(reverse_proxy.capture_dir, session_id) == []


def test_task_group_sample_from_headers_and_registry(helpers, reverse_proxy, session_id):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]}
    helpers.request(reverse_proxy.url + "/v1/chat/completions", body,
                    headers={"x-polar-session": session_id, "x-polar-task": "t1", "x-polar-group": "g1",
                             "x-polar-sample": "3"})
    other = session_id + "-reg"
    key = reverse_proxy.control.register_sessions([{"session_id": other, "task_id": "t2", "group_id": "g2",
                                                    "sample_index": 5, "harness": "pi"}])["keys"][other]
    helpers.request(reverse_proxy.url + "/v1/chat/completions", body, headers={"authorization": f"Bearer {key}",
                                                                               "user-agent": "OpenAI/JS 5.12.2"})
    a = helpers.read_records(reverse_proxy.capture_dir, session_id)[-1]
    b = helpers.read_records(reverse_proxy.capture_dir, other)[-1]
    assert (a["task_id"], a["group_id"], a["sample_index"]) == ("t1", "g1", 3)
    assert (b["task_id"], b["group_id"], b["sample_index"], b["session_source"]) == ("t2", "g2", 5, "key")
    assert b["harness"] == "pi"  # the runner's name, not the SDK's from the user agent
    assert a["harness"] != "pi"
    assert reverse_proxy.control.sessions()["sessions"][other]["calls"] == 1
