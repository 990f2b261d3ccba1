"""Reasoning through every wire format in exact-history mode, whole and streamed: the harness gets
the reasoning in its provider's own field (chat ``reasoning``, Anthropic thinking blocks, Responses
reasoning items, Gemini thought parts) and always the answer; the record keeps both and the
reasoning's ids are sampled ids."""

from __future__ import annotations

from typing import Any

import pytest

from polar_testing.scripted_upstream import DEFAULT_SCENARIOS, ServerThread

REASONING, TEXT = DEFAULT_SCENARIOS["reasoning"]["reasoning"], DEFAULT_SCENARIOS["reasoning"]["text"]


@pytest.fixture(scope="module")
def scripted():
    with ServerThread(max_model_len=8192) as server:
        yield server


@pytest.fixture(scope="module")
def exact_proxy(scripted, proxy_factory):
    return proxy_factory(scripted.url, options={"polar_exact_history": True})


def _ask(helpers: Any, proxy: Any, provider: str, stream: bool, sid: str) -> Any:
    q = "what number? #scenario:reasoning"
    if provider == "openai_chat":
        path, body, headers = "/v1/chat/completions", {"model": "gpt-x", "stream": stream,
                                                        "messages": [{"role": "user", "content": q}]}, {}
    elif provider == "anthropic":
        path, headers = "/v1/messages", {"anthropic-version": "2023-06-01"}
        body = {"model": "claude-x", "max_tokens": 512, "stream": stream, "messages": [{"role": "user", "content": q}]}
    elif provider == "openai_responses":
        path, body, headers = "/v1/responses", {"model": "gpt-x", "input": q, "stream": stream}, {}
    else:
        method = "streamGenerateContent?alt=sse" if stream else "generateContent"
        path, headers = f"/v1beta/models/gemini-x:{method}", {"x-goog-api-key": "k"}
        body = {"contents": [{"role": "user", "parts": [{"text": q}]}]}
    r = helpers.request(proxy.url + path, body, headers={"x-session-id": sid, **headers})
    assert r.status == 200, r.body[:300]
    return helpers.parsers[provider](r.body, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("provider", ["openai_chat", "anthropic", "openai_responses", "google"])
def test_reasoning_reaches_every_provider_in_its_own_field(helpers, exact_proxy, session_id, provider, stream) -> None:
    got = _ask(helpers, exact_proxy, provider, stream, session_id)
    assert got.reasoning.strip() == REASONING and got.text.strip() == TEXT, (got.reasoning, got.text)
    assert REASONING not in got.text
    rec = helpers.read_records(exact_proxy.capture_dir, session_id)[-1]
    assert rec["output_reasoning"].strip() == REASONING and rec["output_text"].strip() == TEXT
    assert rec["history"] == "exact" and len(rec["sampled_token_ids"]) == len(rec["sampled_logprobs"]) > 0
