"""Exact history, checked on the ids vLLM is given: for every wire format the scripted upstream
compares each prompt that reaches ``/inference/v1/generate`` whole with the exact prompt it works
out from what it sampled (``ScriptedUpstream.expected_prompt``), not from the proxy's ledger.

One conversation per format covers what a wrong splice gets wrong: a re-sent answer with reasoning
and a tool call (splicing off: the template's ids; an off-by-one in the tail; an end of turn
doubled), an answer cut by the token limit and re-sent (its end of turn missing), a re-sent answer
whose reasoning was edited (the reasoning comparison), and a template that now renders the old
history differently (the template-prefix check)."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from polar_testing.scripted_upstream import ServerThread

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
SYSTEM = "You are a coding agent."


@pytest.fixture(scope="module")
def scripted():
    with ServerThread(max_model_len=8192) as server:
        yield server


@pytest.fixture(scope="module")
def exact_proxy(scripted, proxy_factory):
    return proxy_factory(scripted.url, options={"polar_exact_history": True})


class Wire:
    """One provider's shapes: a request body from a history, and the history items of an answer,
    of tool results and of a user turn."""

    def __init__(self, helpers: Any, proxy: Any, sid: str, provider: str, stream: bool):
        self.h, self.proxy, self.sid, self.provider, self.stream = helpers, proxy, sid, provider, stream

    def ask(self, history: list[dict[str, Any]], max_tokens: int = 512) -> Any:
        p, headers = self.provider, {"x-session-id": self.sid}
        if p == "openai_chat":
            url, body = "/v1/chat/completions", {"model": "gpt-x", "messages": [{"role": "system", "content": SYSTEM}]
                                                 + history, "tools": TOOLS, "max_tokens": max_tokens}
        elif p == "anthropic":
            url = "/v1/messages"
            body = {"model": "claude-x", "system": SYSTEM, "messages": history, "max_tokens": max_tokens,
                    "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                               "input_schema": t["function"]["parameters"]} for t in TOOLS]}
            headers["anthropic-version"] = "2023-06-01"
        elif p == "openai_responses":
            url = "/v1/responses"
            body = {"model": "gpt-x", "instructions": SYSTEM, "input": history, "max_output_tokens": max_tokens,
                    "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
        else:
            url = "/v1beta/models/gemini-x:" + ("streamGenerateContent?alt=sse" if self.stream else "generateContent")
            body = {"contents": history, "systemInstruction": {"parts": [{"text": SYSTEM}]},
                    "generationConfig": {"maxOutputTokens": max_tokens},
                    "tools": [{"functionDeclarations": [t["function"] for t in TOOLS]}]}
            headers["x-goog-api-key"] = "k"
        if p != "google":
            body["stream"] = self.stream
        r = self.h.request(self.proxy.url + url, body, headers=headers)
        assert r.status == 200, r.body[:300]
        return self.h.parsers[p](r.body, self.stream)

    def answer(self, a: Any, reasoning: str | None = None) -> list[dict[str, Any]]:
        """The answer as the harness re-sends it (with its reasoning, or ``reasoning`` instead)."""
        r = a.reasoning if reasoning is None else reasoning
        p = self.provider
        if p == "openai_chat":
            msg: dict[str, Any] = {"role": "assistant", "content": a.text or None}
            if r:
                msg["reasoning_content"] = r
            if a.tool_calls:
                msg["tool_calls"] = [{"id": t["id"], "type": "function", "function": {
                    "name": t["name"], "arguments": json.dumps(t["arguments"])}} for t in a.tool_calls]
            return [msg]
        if p == "anthropic":
            blocks = ([{"type": "thinking", "thinking": r, "signature": "sig"}] if r else []) + (
                [{"type": "text", "text": a.text}] if a.text else [])
            return [{"role": "assistant", "content": blocks + [
                {"type": "tool_use", "id": t["id"], "name": t["name"], "input": t["arguments"]} for t in a.tool_calls]}]
        if p == "openai_responses":
            items = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": r}]}] if r else []
            if a.text:
                items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a.text}]})
            return items + [{"type": "function_call", "call_id": t["id"], "name": t["name"],
                             "arguments": json.dumps(t["arguments"])} for t in a.tool_calls]
        parts = ([{"text": r, "thought": True}] if r else []) + ([{"text": a.text}] if a.text else [])
        return [{"role": "model", "parts": parts + [{"functionCall": {"name": t["name"], "args": t["arguments"]}}
                                                    for t in a.tool_calls]}]

    def results_and_user(self, a: Any, text: str) -> list[dict[str, Any]]:
        p = self.provider
        if p == "openai_chat":
            return [{"role": "tool", "tool_call_id": t["id"], "content": "done"} for t in a.tool_calls] + [
                {"role": "user", "content": text}]
        if p == "anthropic":
            return [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": t["id"], "content": "done"}
                                                 for t in a.tool_calls] + [{"type": "text", "text": text}]}]
        if p == "openai_responses":
            return [{"type": "function_call_output", "call_id": t["id"], "output": "done"} for t in a.tool_calls] + [
                {"role": "user", "content": text}]
        return [{"role": "user", "parts": [{"functionResponse": {"name": t["name"], "response": {"ok": True}}}
                                           for t in a.tool_calls] + [{"text": text}]}]


def _user(w: Wire, text: str) -> dict[str, Any]:
    return {"role": "user", "parts": [{"text": text}]} if w.provider == "google" else {"role": "user", "content": text}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("provider", ["openai_chat", "anthropic", "openai_responses", "google"])
def test_every_generate_gets_the_exact_prompt(helpers, scripted, exact_proxy, session_id, provider, stream) -> None:
    sid = f"{session_id}-{provider}"
    w = Wire(helpers, exact_proxy, sid, provider, stream)
    h: list[dict[str, Any]] = [_user(w, "make a file #scenario:tool")]
    a = w.ask(h)  # reasoning and a tool call, ended on the end of turn
    assert a.reasoning and a.tool_calls
    h1 = h + w.answer(a) + w.results_and_user(a, "#scenario:words:30")
    b = w.ask(h1, max_tokens=6)  # cut by the limit: its turn has no end of turn
    assert len(b.text.split()) == 6
    h2 = h1 + w.answer(b) + [_user(w, "go on #scenario:text")]
    c = w.ask(h2)
    # the harness edits the reasoning it re-sends: not the sampled answer any more
    w.ask(h + w.answer(a, reasoning="I will not use the shell.") + w.results_and_user(a, "#scenario:text"))
    # the template renders the old history differently now (a new date in the system prompt)
    scripted.upstream.tok.epoch += 1
    try:
        w.ask(h2 + w.answer(c) + [_user(w, "and now? #scenario:text")])
    finally:
        scripted.upstream.tok.epoch = 0
    checks = scripted.upstream.check_prompts(sid)  # every prompt whole, as worked out by the upstream
    assert len(checks) == 5
    recs = helpers.read_records(exact_proxy.capture_dir, sid)
    assert [(r["history"], r["history_cause"]) for r in recs[:4]] == [
        ("exact", None), ("exact", None), ("exact", None), ("rendered", "answer_changed")], \
        [r["translation_notes"] for r in recs]
    # the template's rendering changed: rendered whole. (exact_history.follow_template names it
    # template_dropped_reasoning when the rendering holds fewer </think> ids than the sampled
    # prompt, which the cheap template, rendering kept reasoning as text, always does.)
    assert recs[4]["history"] == "rendered"
    assert recs[4]["history_cause"] in ("template_not_prefix", "template_dropped_reasoning")
    # the checks compared something: spliced prompts are not the template's rendering
    assert [c["received"] == c["rendered"] for c in checks] == [True, False, False, True, True]
    assert checks[2]["received"][: len(checks[1]["received"]) + 6] == checks[1]["received"] + \
        recs[1]["sampled_token_ids"]
