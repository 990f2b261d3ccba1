"""Exact-history mode (``polar_exact_history``) against the scripted upstream's render, generate and
derender endpoints (vLLM 0.32's wire format): the model is prompted with its own sampled ids for
every answer the harness re-sends; edited histories fall back and say why."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from polar_testing.scripted_upstream import ServerThread

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "read", "description": "read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def scripted():
    with ServerThread(max_model_len=8192) as server:
        yield server


@pytest.fixture(scope="module")
def exact_proxy(scripted, proxy_factory):
    return proxy_factory(scripted.url, options={"polar_exact_history": True})


class Harness:
    """A chat-completions harness loop: re-sends every answer as it got it (or edited)."""

    def __init__(self, helpers: Any, proxy: Any, session: str, stream: bool = False):
        self.h, self.proxy, self.session, self.stream = helpers, proxy, session, stream
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]

    def ask(self, messages: list[dict[str, Any]] | None = None, **extra: Any) -> Any:
        body = {"model": "gpt-x", "messages": messages if messages is not None else self.messages, "tools": TOOLS,
                "stream": self.stream, **extra}
        r = self.h.request(self.proxy.url + "/v1/chat/completions", body, headers={"x-session-id": self.session})
        assert r.status == 200, r.body[:500]
        return self.h.parsers["openai_chat"](r.body, self.stream)

    def answer_message(self, ans: Any) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": ans.text or None}
        if ans.tool_calls:
            msg["tool_calls"] = [{"id": t["id"], "type": "function",
                                  "function": {"name": t["name"], "arguments": json.dumps(t["arguments"])}}
                                 for t in ans.tool_calls]
        return msg

    def records(self) -> list[dict[str, Any]]:
        return self.h.read_records(self.proxy.capture_dir, self.session)


def _tool_results(msg: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": t["id"], "content": f"ok {i}"} for i, t in enumerate(msg.get("tool_calls") or [])]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_resent_answers_are_spliced_as_sampled(helpers, scripted, exact_proxy, session_id, stream) -> None:
    h = Harness(helpers, exact_proxy, session_id, stream)
    h.messages.append({"role": "user", "content": "make hello.txt #scenario:tools2"})
    first = h.ask()
    assert [t["name"] for t in first.tool_calls] == ["bash", "read"]  # parallel tool calls
    h.messages.append(h.answer_message(first))
    h.messages += _tool_results(h.messages[-1])
    h.messages.append({"role": "user", "content": "now say hi #scenario:text"})
    second = h.ask()
    assert second.text.startswith("Hello from the scripted upstream")
    h.messages += [h.answer_message(second), {"role": "user", "content": "again #scenario:tool"}]
    third = h.ask()
    assert third.tool_calls and third.tool_calls[0]["name"] == "bash"
    r1, r2, r3 = h.records()
    assert [r["history"] for r in (r1, r2, r3)] == ["exact", "exact", "exact"]
    # prompt = the earlier call's prompt + what it sampled + the template's rendering of what followed
    for a, b in ((r1, r2), (r2, r3)):
        lead = a["prompt_token_ids"] + a["sampled_token_ids"]
        assert b["prompt_token_ids"][: len(lead)] == lead
        assert b["rendered_prompt_diff"] is not None  # the template alone would have re-rendered the answer
    assert r1["rendered_prompt_diff"] is None
    assert r2["sampled_logprobs"] and len(r2["sampled_logprobs"]) == len(r2["sampled_token_ids"])
    assert r3["finish_reason"] == "tool_calls"
    _prompts_exact(scripted, session_id, 3)


def test_ledger_is_rebuilt_from_the_capture_after_kill_9(helpers, scripted, confdir, tmp_path, session_id) -> None:
    from polar_proxy.process import ProxyProcess

    cap = tmp_path / "cap"
    proxy = ProxyProcess(scripted.url, cap, confdir=confdir, upstream_timeout=5,
                         options={"polar_exact_history": True}).start()
    h = Harness(helpers, proxy, session_id)
    h.messages.append({"role": "user", "content": "go #scenario:tool"})
    first = h.ask()
    h.messages += [h.answer_message(first)]
    h.messages += _tool_results(h.messages[-1])
    second = h.ask(h.messages + [{"role": "user", "content": "more #scenario:text"}])
    assert second.text
    os.killpg(proxy.proc.pid, signal.SIGKILL)  # no shutdown hook runs: the ledger lives in the capture
    proxy.proc.wait(10)
    proxy.proc = None
    proxy = ProxyProcess(scripted.url, cap, confdir=confdir, upstream_timeout=5,
                         options={"polar_exact_history": True}).start()
    try:
        h.proxy = proxy
        h.messages += [{"role": "user", "content": "more #scenario:text"}, h.answer_message(second),
                       {"role": "user", "content": "last #scenario:text"}]
        h.ask()
        recs = h.records()
        assert [r["history"] for r in recs] == ["exact", "exact", "exact"]
        assert "exact history: spliced after call 1" in recs[2]["translation_notes"]
        lead = recs[1]["prompt_token_ids"] + recs[1]["sampled_token_ids"]
        assert recs[2]["prompt_token_ids"][: len(lead)] == lead
        status = proxy.control.status() if hasattr(proxy.control, "status") else None
        if isinstance(status, dict) and status.get("exact_history"):
            assert status["exact_history"]["ledger_rebuilt"] == 1
    finally:
        proxy.stop()


def test_edited_history_falls_back_and_says_why(helpers, scripted, exact_proxy, session_id) -> None:
    h = Harness(helpers, exact_proxy, session_id)
    h.messages.append({"role": "user", "content": "first #scenario:text"})
    a1 = h.ask()
    h.messages += [h.answer_message(a1), {"role": "user", "content": "second #scenario:text"}]
    a2 = h.ask()
    # compaction: the earlier turns are replaced by a summary
    compacted = [h.messages[0], {"role": "user", "content": "Summary: we said hello twice."},
                 h.answer_message(a2), {"role": "user", "content": "go on #scenario:text"}]
    h.ask(compacted)
    # a system prompt that changed
    changed = [{"role": "system", "content": "You are another agent."}] + h.messages[1:] + [
        h.answer_message(a2), {"role": "user", "content": "go on #scenario:text"}]
    h.ask(changed)
    # the harness dropped its earlier answer
    dropped = h.messages[:2] + [{"role": "user", "content": "second #scenario:text"}]
    h.ask(dropped)
    recs = h.records()
    assert [(r["history"], r["history_cause"]) for r in recs] == [
        ("exact", None), ("exact", None), ("rendered", "history_edited"), ("rendered", "history_edited"),
        ("rendered", "answer_dropped")]
    for r in recs[2:]:
        assert r["rendered_prompt_diff"] is None  # rendered: what vLLM got is the template's rendering
    _prompts_exact(scripted, session_id, 5, spliced=False)  # text answers: the cheap template's ids


def test_changed_tool_arguments_are_not_spliced(helpers, scripted, exact_proxy, session_id) -> None:
    h = Harness(helpers, exact_proxy, session_id)
    h.messages.append({"role": "user", "content": "do it #scenario:tool"})
    a1 = h.ask()
    msg = h.answer_message(a1)
    edited = json.loads(json.dumps(msg))
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"command": "rm -rf /"})
    h.ask(h.messages + [edited] + _tool_results(edited) + [{"role": "user", "content": "next #scenario:text"}])
    # JSON-equal arguments with other whitespace and key order, and another tool-call id: spliced
    same = json.loads(json.dumps(msg))
    same["tool_calls"][0]["id"] = "call_harness_1"
    same["tool_calls"][0]["function"]["arguments"] = json.dumps(a1.tool_calls[0]["arguments"], indent=2)
    h.ask(h.messages + [same] + _tool_results(same) + [{"role": "user", "content": "next #scenario:text"}])
    recs = h.records()
    assert (recs[1]["history"], recs[1]["history_cause"]) == ("rendered", "answer_changed")
    assert any("tool_arguments" in n for n in recs[1]["translation_notes"])
    assert recs[2]["history"] == "exact"
    _prompts_exact(scripted, session_id, 3)


def test_truncated_turn_is_closed_with_the_end_of_turn_id(helpers, exact_proxy, scripted, session_id) -> None:
    h = Harness(helpers, exact_proxy, session_id)
    h.messages.append({"role": "user", "content": "write #scenario:length"})
    a1 = h.ask()
    h.messages += [h.answer_message(a1), {"role": "user", "content": "you were cut #scenario:text"}]
    h.ask()
    r1, r2 = h.records()
    assert r1["finish_reason"] == "length" and r1["sampled_token_ids"]
    eot = scripted.upstream.tok.eos_id
    lead = r1["prompt_token_ids"] + r1["sampled_token_ids"] + [eot]
    assert r2["history"] == "exact" and r2["prompt_token_ids"][: len(lead)] == lead
    _prompts_exact(scripted, session_id, 2)


def test_interleaved_sub_agents_each_continue_their_own_chain(helpers, scripted, exact_proxy, session_id) -> None:
    main = Harness(helpers, exact_proxy, session_id)
    sub = Harness(helpers, exact_proxy, session_id)
    sub.messages = [{"role": "system", "content": "You are a sub-agent that reads files."}]
    main.messages.append({"role": "user", "content": "main task #scenario:tool"})
    sub.messages.append({"role": "user", "content": "sub task #scenario:tools2"})
    for turn in range(2):
        for agent in (main, sub):
            ans = agent.ask()
            msg = agent.answer_message(ans)
            agent.messages += [msg] + _tool_results(msg) + [{"role": "user", "content": f"go {turn} #scenario:tool"}]
    recs = main.records()
    assert [r["history"] for r in recs] == ["exact"] * 4
    notes = [next((n for n in r["translation_notes"] if "spliced after" in n), None) for r in recs]
    assert notes == [None, None, "exact history: spliced after call 0", "exact history: spliced after call 1"]
    _prompts_exact(scripted, session_id, 4)


def test_an_upstream_without_the_endpoints_gets_the_normal_path(helpers, proxy_factory, session_id) -> None:
    with ServerThread(max_model_len=8192) as plain:
        plain.upstream.scale_out = False  # vLLM started without --enable-scale-out: 403 on render
        proxy = proxy_factory(plain.url, options={"polar_exact_history": True})
        h = Harness(helpers, proxy, session_id)
        h.messages.append({"role": "user", "content": "hi #scenario:text"})
        a1 = h.ask()
        h.ask(h.messages + [h.answer_message(a1), {"role": "user", "content": "again #scenario:text"}])
        recs = h.records()
        assert [r["status"] for r in recs] == ["ok", "ok"] and [r["history"] for r in recs] == [None, None]
        assert any("exact history unavailable" in n for n in recs[1]["translation_notes"])


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_messages_history_is_spliced(helpers, scripted, exact_proxy, session_id, stream) -> None:
    """The ledger works on the normalized call: an Anthropic harness re-sending content blocks
    (text, tool_use; thinking left out) gets its own sampled ids back."""
    def ask(messages: list[dict[str, Any]]) -> Any:
        body = {"model": "claude-x", "max_tokens": 512, "system": "You are a coding agent.", "tools": ANTHROPIC_TOOLS,
                "messages": messages, "stream": stream}
        r = helpers.request(exact_proxy.url + "/v1/messages", body,
                            headers={"x-session-id": session_id, "anthropic-version": "2023-06-01"})
        assert r.status == 200, r.body[:300]
        return helpers.parsers["anthropic"](r.body, stream)

    def blocks(ans: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"type": "text", "text": ans.text}] if ans.text else []
        return out + [{"type": "tool_use", "id": t["id"], "name": t["name"], "input": t["arguments"]}
                      for t in ans.tool_calls]

    messages = [{"role": "user", "content": "make a file #scenario:tools2"}]
    a1 = ask(messages)
    assert len(a1.tool_calls) == 2
    messages += [{"role": "assistant", "content": blocks(a1)},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": t["id"], "content": "done"}
                                              for t in a1.tool_calls] + [{"type": "text", "text": "#scenario:text"}]}]
    a2 = ask(messages)
    messages += [{"role": "assistant", "content": blocks(a2)}, {"role": "user", "content": "thanks #scenario:text"}]
    ask(messages)
    recs = helpers.read_records(exact_proxy.capture_dir, session_id)
    assert [r["history"] for r in recs] == ["exact", "exact", "exact"], [r["history_cause"] for r in recs]
    lead = recs[1]["prompt_token_ids"] + recs[1]["sampled_token_ids"]
    assert recs[2]["prompt_token_ids"][: len(lead)] == lead
    _prompts_exact(scripted, session_id, 3)


def _prompts_exact(scripted: Any, sid: str, n: int, spliced: bool = True) -> None:
    """Every prompt of the session that reached generate is the exact prompt, compared whole with
    what the scripted upstream works out from its own answers (not from the proxy's ledger)."""
    checks = scripted.upstream.check_prompts(sid)
    assert len(checks) == n
    if spliced:  # the check compared something: spliced ids, not the template's
        assert any(c["received"] != c["rendered"] for c in checks)


def _fn_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"]} for t in TOOLS]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_and_google_histories_are_spliced(helpers, scripted, exact_proxy, session_id, stream) -> None:
    """OpenAI Responses (function_call items re-sent) and Google generateContent (functionCall parts)."""
    # Responses
    sid = session_id + "-resp"

    def ask_responses(items: list[dict[str, Any]]) -> Any:
        body = {"model": "gpt-x", "instructions": "You are a coding agent.", "input": items, "tools": _fn_tools(),
                "stream": stream}
        r = helpers.request(exact_proxy.url + "/v1/responses", body, headers={"x-session-id": sid})
        assert r.status == 200, r.body[:300]
        return helpers.parsers["openai_responses"](r.body, stream)

    items: list[dict[str, Any]] = [{"role": "user", "content": "make a file #scenario:tool"}]
    a1 = ask_responses(items)
    items += [{"type": "function_call", "call_id": t["id"], "name": t["name"], "arguments": json.dumps(t["arguments"])}
              for t in a1.tool_calls]
    items += [{"type": "function_call_output", "call_id": t["id"], "output": "done"} for t in a1.tool_calls]
    items.append({"role": "user", "content": "report #scenario:text"})
    a2 = ask_responses(items)
    items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a2.text}]},
              {"role": "user", "content": "bye #scenario:text"}]
    ask_responses(items)
    recs = helpers.read_records(exact_proxy.capture_dir, sid)
    assert [r["history"] for r in recs] == ["exact"] * 3, [r["history_cause"] for r in recs]
    _prompts_exact(scripted, sid, 3)

    # Google generateContent
    gsid = session_id + "-google"
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"

    def ask_google(contents: list[dict[str, Any]]) -> Any:
        body = {"contents": contents, "systemInstruction": {"parts": [{"text": "You are a coding agent."}]},
                "tools": [{"functionDeclarations": [{"name": t["function"]["name"],
                                                     "description": t["function"]["description"],
                                                     "parameters": t["function"]["parameters"]} for t in TOOLS]}]}
        r = helpers.request(exact_proxy.url + f"/v1beta/models/gemini-x:{method}", body,
                            headers={"x-session-id": gsid, "x-goog-api-key": "k"})
        assert r.status == 200, r.body[:300]
        return helpers.parsers["google"](r.body, stream)

    contents: list[dict[str, Any]] = [{"role": "user", "parts": [{"text": "make a file #scenario:tool"}]}]
    g1 = ask_google(contents)
    parts = ([{"text": g1.text}] if g1.text else []) + [
        {"functionCall": {"name": t["name"], "args": t["arguments"]}} for t in g1.tool_calls]
    contents += [{"role": "model", "parts": parts},
                 {"role": "user", "parts": [{"functionResponse": {"name": t["name"], "response": {"ok": True}}}
                                            for t in g1.tool_calls] + [{"text": "#scenario:text"}]}]
    ask_google(contents)
    grecs = helpers.read_records(exact_proxy.capture_dir, gsid)
    assert [r["history"] for r in grecs] == ["exact"] * 2, [(r["history_cause"], r["translation_notes"]) for r in grecs]
    _prompts_exact(scripted, gsid, 2)


def test_a_generation_cut_mid_stream_ends_in_an_error_and_keeps_what_was_sampled(helpers, exact_proxy,
                                                                                  session_id) -> None:
    h = Harness(helpers, exact_proxy, session_id, stream=True)
    body = {"model": "gpt-x", "stream": True,
            "messages": [{"role": "user", "content": "talk #scenario:words:20 #fault:cut"}]}
    r = helpers.request(exact_proxy.url + "/v1/chat/completions", body, headers={"x-session-id": session_id})
    assert r.status == 200
    parsed = helpers.parsers["openai_chat"](r.body, True)
    assert parsed.error is not None
    (rec,) = h.records()
    assert rec["status"] == "error" and rec["error_kind"] == "upstream_error"
    assert len(rec["sampled_token_ids"]) == 10 and rec["history"] == "exact"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("limit", ["request", "cap"])
def test_the_calls_output_limit_reaches_generate(helpers, scripted, proxy_factory, session_id, stream, limit) -> None:
    """vLLM 0.32's render answers ``max_tokens: null``; generate built from it alone sampled until the
    context was full (a 16-token demo call sampled 6,784 tokens). The harness's limit and the proxy's
    cap must reach generate."""
    proxy = proxy_factory(scripted.url, options={"polar_exact_history": True,
                                                 **({"polar_max_tokens_cap": 8} if limit == "cap" else {})})
    h = Harness(helpers, proxy, session_id, stream)
    h.messages.append({"role": "user", "content": "talk #scenario:words:40"})
    ans = h.ask(**({"max_tokens": 8} if limit == "request" else {}))
    (rec,) = h.records()
    assert rec["history"] == "exact" and len(rec["sampled_token_ids"]) == 8 and rec["finish_reason"] == "length"
    assert len(ans.text.split()) <= 8
