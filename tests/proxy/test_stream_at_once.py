"""A stream that has wholly arrived before the proxy reads it is answered in one piece (no relay
hop). That path must say exactly what the relayed path says: same events for the harness, same
capture record. ``#send:burst`` makes the scripted upstream send head and events in one write."""

from __future__ import annotations

import uuid

import pytest

CALLS = {
    "openai_chat": ("/v1/chat/completions", {}, lambda text: {
        "model": "gpt-x", "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": text}],
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]}),
    "anthropic": ("/v1/messages", {"anthropic-version": "2023-06-01"}, lambda text: {
        "model": "claude-x", "max_tokens": 256, "stream": True, "messages": [{"role": "user", "content": text}],
        "tools": [{"name": "bash", "input_schema": {"type": "object"}}]}),
    "openai_responses": ("/v1/responses", {}, lambda text: {
        "model": "gpt-x", "stream": True, "input": text,
        "tools": [{"type": "function", "name": "bash", "parameters": {"type": "object"}}]}),
    "google": ("/v1beta/models/gemini-x:streamGenerateContent?alt=sse", {}, lambda text: {
        "contents": [{"role": "user", "parts": [{"text": text}]}],
        "tools": [{"functionDeclarations": [{"name": "bash", "parameters": {"type": "object"}}]}]}),
}
TOKEN_FIELDS = ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs", "finish_reason", "output_text",
                "output_reasoning", "output_tool_calls", "status", "error_kind", "prompt_tokens", "completion_tokens")


@pytest.fixture(scope="module")
def relay_only(upstream, proxy_factory):
    return proxy_factory(upstream.url, options={"polar_stream_at_once": False})


def _call(helpers, proxy, provider, text):
    path, headers, make = CALLS[provider]
    session = f"once-{uuid.uuid4().hex[:10]}"
    ans = helpers.request(proxy.url + path, make(text), headers={**headers, "x-polar-session": session})
    assert ans.status == 200, ans.body[:300]
    assert ans.headers["content-type"].startswith("text/event-stream")
    return helpers.parsers[provider](ans.body, True), helpers.read_records(proxy.capture_dir, session)[-1]


@pytest.mark.parametrize("scenario", ["tool", "reasoning", "tools2", "length"])
@pytest.mark.parametrize("provider", list(CALLS))
def test_at_once_answers_what_the_relay_answers(helpers, reverse_proxy, relay_only, provider, scenario):
    before = reverse_proxy.control.status()["streamed_at_once"]
    text = f"go #scenario:{scenario} #send:burst"
    once, once_rec = _call(helpers, reverse_proxy, provider, text)
    relayed, relayed_rec = _call(helpers, relay_only, provider, text)
    assert reverse_proxy.control.status()["streamed_at_once"] == before + 1  # this call took the shortcut
    assert relay_only.control.status()["streamed_at_once"] == 0
    assert once.error is None and relayed.error is None
    assert (once.text, once.reasoning, once.tool_calls, once.finish) == \
        (relayed.text, relayed.reasoning, relayed.tool_calls, relayed.finish)
    assert once.tool_calls or once.text or once.reasoning or scenario == "length"
    for key in TOKEN_FIELDS:
        assert once_rec[key] == relayed_rec[key], key
    assert once_rec["sampled_token_ids"] and once_rec["prompt_token_ids"]
    assert once_rec["t_upstream_end"] is not None


@pytest.mark.parametrize("provider", list(CALLS))
def test_paced_streams_still_go_through_the_relay(helpers, reverse_proxy, provider):
    """With tokens arriving over time the first event must reach the harness before the last one
    is generated: the shortcut only ever applies to streams that are already complete."""
    before = reverse_proxy.control.status()["streamed_at_once"]
    parsed, rec = _call(helpers, reverse_proxy, provider, "go #scenario:words:8 #delay:30")
    assert parsed.error is None and rec["status"] == "ok" and len(rec["sampled_token_ids"]) >= 8
    assert rec["t_upstream_sent"] < rec["t_upstream_end"] <= rec["t_response_out"]
    assert reverse_proxy.control.status()["streamed_at_once"] == before
