"""A stream that has wholly arrived before the proxy reads it is answered in one piece (no relay
hop). That path must say exactly what the relayed path says: same events for the harness, same
capture record. ``#send:burst`` makes the scripted upstream send head and events in one write."""

from __future__ import annotations

import json
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


WORDS, DELAY_MS = 8, 60  # 9 tokens (8 words and the end) x 60 ms: the generation takes >= 0.54 s


@pytest.mark.parametrize("path", ["at_once_enabled", "relay_only"])
@pytest.mark.parametrize("provider", list(CALLS))
def test_paced_streams_still_go_through_the_relay(helpers, reverse_proxy, relay_only, provider, path):
    """With tokens arriving over time the first event must reach the harness before the last one
    is generated: the shortcut only ever applies to streams that are already complete. Timed at
    the client, per event: the event carrying the first word must arrive while the upstream is
    still generating, whichever proxy (shortcut enabled or not) and whichever provider's
    translator sits in between; a translator that held its events back until the end fails."""
    proxy = reverse_proxy if path == "at_once_enabled" else relay_only
    before = proxy.control.status()["streamed_at_once"]
    request_path, headers, make = CALLS[provider]
    session = f"paced-{uuid.uuid4().hex[:10]}"
    ans = helpers.request(proxy.url + request_path, make(f"go #scenario:words:{WORDS} #delay:{DELAY_MS}"),
                          headers={**headers, "x-polar-session": session})
    assert ans.status == 200, ans.body[:300]
    parsed = helpers.parsers[provider](ans.body, True)
    rec = helpers.read_records(proxy.capture_dir, session)[-1]
    assert parsed.error is None and rec["status"] == "ok" and len(rec["sampled_token_ids"]) >= WORDS
    assert parsed.text.split() == [f"w{i}" for i in range(WORDS)]

    events = ans.timed_events()
    generation = (WORDS + 1) * DELAY_MS / 1000
    t_last = events[-1][0]
    assert t_last >= generation * 0.9, (t_last, generation)  # the client waited for the whole generation
    t_first_word = next(t for t, _, data in events if "w0" in json.dumps(data))
    t_last_word = next(t for t, _, data in reversed(events) if f"w{WORDS - 1}" in json.dumps(data))
    # The first word is sampled after one delay; allow half the generation for a loaded machine.
    assert t_first_word < t_last - generation / 2, [(round(t, 3), name) for t, name, _ in events]
    assert t_first_word < t_last_word - generation / 2  # the words themselves came over time
    assert rec["t_upstream_sent"] < rec["t_upstream_end"] <= rec["t_response_out"]
    assert proxy.control.status()["streamed_at_once"] == before
