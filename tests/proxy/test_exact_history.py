"""Exact-history mode (``polar_exact_history``) against the scripted upstream's render, generate and
derender endpoints (vLLM 0.32's wire format): the model is prompted with its own sampled ids for
every answer the harness re-sends; edited histories fall back and say why."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from polar_runtime.scripted_upstream import ServerThread

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
def test_resent_answers_are_spliced_as_sampled(helpers, exact_proxy, session_id, stream) -> None:
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
