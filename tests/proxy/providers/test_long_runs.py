"""What breaks real long agent runs in the translators (issue 16): a tool call the output budget
cut, Claude Code's deferred tools, Codex compaction and freeform tools, and the smaller protocol
gaps. Each test failed on the translators before the fix."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from polar_core.compaction import COMPACT_ITEM_MARKER, COMPACT_REQUEST, COMPACT_SUMMARY_PREFIX, compaction_of
from polar_proxy.engines.vllm import VLLMEngine
from polar_proxy.engines.base import TokenData
from polar_proxy.providers import PROVIDERS, detect_provider
from polar_proxy.providers.common import context_overflow_numbers

CUT = '{"file_path": "/a.py", "old_string": "def f():\\n    ret'  # a call cut by max_tokens


def _cut_scenario(h) -> dict[str, Any]:
    s = h.scenario("one_tool")
    s["tools"] = [("chatcmpl-tool-cut", "Edit", CUT)]
    s["finish"] = "length"
    return s


# ---------------------------------------------------------------------------------------------
# 4. a tool call cut by the output budget is never reported as a finished call
# ---------------------------------------------------------------------------------------------

def test_cut_tool_call_anthropic(h):
    s = _cut_scenario(h)
    p = PROVIDERS["anthropic"]
    whole = p.from_chat(h.completion(s), "claude-x")
    assert whole["stop_reason"] == "max_tokens"
    assert not [b for b in whole["content"] if b["type"] == "tool_use"]  # nothing to run
    events = h.parse_sse(h.run_stream(p.new_stream("claude-x"), h.chunks(s)))
    delta = [d for n, d in events if n == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "max_tokens"  # as the real API ends a cut tool_use


def test_cut_tool_call_responses(h):
    s = _cut_scenario(h)
    p = PROVIDERS["openai_responses"]
    whole = p.from_chat(h.completion(s), "gpt-x")
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["status"] for i in whole["output"] if i["type"] == "function_call"] == ["incomplete"]
    events = h.parse_sse(h.run_stream(p.new_stream("gpt-x"), h.chunks(s)))
    done = [d["item"] for n, d in events if n == "response.output_item.done" and d["item"]["type"] == "function_call"]
    assert [i["status"] for i in done] == ["incomplete"]
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["output"][-1]["status"] == "incomplete"


def test_cut_tool_call_google(h):
    s = _cut_scenario(h)
    p = PROVIDERS["google"]
    whole = p.from_chat(h.completion(s), "gemini-x")
    cand = whole["candidates"][0]
    assert cand["finishReason"] == "MAX_TOKENS"
    assert not [pt for pt in cand["content"]["parts"] if "functionCall" in pt]
    events = h.parse_sse(h.run_stream(p.new_stream("gemini-x"), h.chunks(s)))
    parts = [pt for _, d in events for pt in d["candidates"][0]["content"]["parts"]]
    assert not [pt for pt in parts if "functionCall" in pt]
    assert events[-1][1]["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_whole_call_before_a_length_finish_still_reported(h):
    """A call whose JSON is whole stays (vLLM parsed it; the budget ended what came after)."""
    s = _cut_scenario(h)
    s["tools"] = [("chatcmpl-tool-ok", "Read", '{"file_path": "/a.py"}')]
    assert PROVIDERS["anthropic"].from_chat(h.completion(s), "m")["content"][-1]["name"] == "Read"
    out = PROVIDERS["openai_responses"].from_chat(h.completion(s), "m")["output"]
    assert out[-1]["status"] == "completed"


# ---------------------------------------------------------------------------------------------
# 3. Claude Code's deferred tools load once ToolSearch referenced them
# ---------------------------------------------------------------------------------------------

def _deferred_body(referenced: bool) -> dict[str, Any]:
    obj = {"type": "object", "properties": {"q": {"type": "string"}}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find the notebook tool"}]
    if referenced:
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                               "input": {"query": "notebook"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "tool_reference", "tool_name": "NotebookEdit"}]}]},
        ]
    return {"model": "claude-x", "max_tokens": 100, "messages": messages, "tools": [
        {"name": "ToolSearch", "input_schema": obj},
        {"name": "NotebookEdit", "description": "Edit a notebook cell", "input_schema": obj, "defer_loading": True},
        {"name": "WebFetch", "input_schema": obj, "defer_loading": True},
    ]}


def test_deferred_tool_loaded_once_referenced():
    p = PROVIDERS["anthropic"]
    before = p.to_chat(_deferred_body(False), "/v1/messages", {})
    assert [t["function"]["name"] for t in before.chat_request["tools"]] == ["ToolSearch"]
    after = p.to_chat(_deferred_body(True), "/v1/messages", {})
    tools = {t["function"]["name"]: t["function"] for t in after.chat_request["tools"]}
    assert list(tools) == ["ToolSearch", "NotebookEdit"]  # WebFetch was never referenced
    assert tools["NotebookEdit"]["description"] == "Edit a notebook cell"
    assert tools["NotebookEdit"]["parameters"]["properties"] == {"q": {"type": "string"}}
    assert any("deferred tool loaded" in n for n in after.notes)


# ---------------------------------------------------------------------------------------------
# 5. Codex compaction: /v1/responses/compact and compaction items
# ---------------------------------------------------------------------------------------------

COMPACT_BODY = {
    "model": "gpt-5-codex", "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command":["ls"]}'},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Found a.py"}]},
    ],
    "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}],
    "parallel_tool_calls": False, "reasoning": {"effort": "low"},
}


def test_codex_compact_endpoint(h):
    p = PROVIDERS["openai_responses"]
    assert detect_provider("POST", "/v1/responses/compact", {}, COMPACT_BODY) is p
    call = p.to_chat(COMPACT_BODY, "/v1/responses/compact", {})
    chat = call.chat_request
    assert chat["messages"][-1] == {"role": "user", "content": COMPACT_REQUEST}
    assert "tools" not in chat and chat["stream"] is False and call.stream is False
    assert call.notes[0].startswith("compaction: codex /responses/compact")
    assert compaction_of(chat["messages"]) == "summary call (codex /responses/compact)"
    s = h.scenario("text")
    s["content"] = "Goal: fix the bug. Done: listed files (a.py)."
    answer = p.from_chat(h.completion(s), "gpt-5-codex", call)
    assert answer["object"] == "response.compaction"
    assert [i["type"] for i in answer["output"]] == ["message", "compaction"]
    assert answer["output"][0]["role"] == "user"
    assert answer["output"][-1]["encrypted_content"] == COMPACT_ITEM_MARKER + s["content"]
    assert answer["usage"]["input_tokens"] == 120

    # the next request carries the compaction output as its history
    nxt = {"model": "gpt-5-codex", "instructions": "You are Codex.",
           "input": answer["output"] + [{"type": "message", "role": "user",
                                         "content": [{"type": "input_text", "text": "go on"}]}]}
    later = p.to_chat(nxt, "/v1/responses", {})
    msgs = later.chat_request["messages"]
    assert msgs[2] == {"role": "user", "content": COMPACT_SUMMARY_PREFIX + s["content"]}
    assert any(n.startswith("compaction: compaction item rendered") for n in later.notes)
    assert compaction_of(msgs) == "resumed from a summary (codex compaction item)"
    # an item another server encrypted cannot be read: dropped, and said so
    other = p.to_chat({**nxt, "input": [{"type": "compaction", "encrypted_content": "gAAAA"}] + nxt["input"][-1:]},
                      "/v1/responses", {})
    assert "compaction: dropped a compaction item another server encrypted" in other.notes


# ---------------------------------------------------------------------------------------------
# 6. smaller protocol gaps
# ---------------------------------------------------------------------------------------------

# vLLM 0.32's own wording (renderers/params.py, v1/engine/input_processor.py, serve/utils/api_utils.py)
VLLM_032_OVERFLOW = [
    ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input tokens, "
     "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt.",
     (5000, 4096)),
    ("This model's maximum context length is 4096 tokens. However, your prompt contains at least 4097 input "
     "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
     "prompt.", (4097, 4096)),
    ("The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure that "
     "`max_model_len` is no smaller than the number of text tokens.", (5000, 4096)),
    ("Input length (5000) exceeds model's maximum context length (4096).", (5000, 4096)),
]


@pytest.mark.parametrize("message,numbers", VLLM_032_OVERFLOW)
def test_vllm_032_overflow_counts(message, numbers):
    assert context_overflow_numbers(message) == numbers
    _, body = PROVIDERS["anthropic"].error_response(400, "context_length", message)
    assert body["error"]["message"] == "prompt is too long: 5000 tokens > 4096 maximum".replace("5000", str(numbers[0]))
    _, body = PROVIDERS["openai_chat"].error_response(400, "context_length", message)
    assert f"your messages resulted in {numbers[0]} tokens" in body["error"]["message"]


def test_gemini_response_json_schema_upper_case():
    """Gemini CLI's router call sends responseJsonSchema with OBJECT / STRING."""
    body = {"contents": [{"role": "user", "parts": [{"text": "route"}]}], "generationConfig": {
        "responseMimeType": "application/json",
        "responseJsonSchema": {"type": "OBJECT", "properties": {
            "reasoning": {"type": "STRING"}, "model_choice": {"type": "STRING", "enum": ["flash", "pro"]}},
            "required": ["reasoning", "model_choice"]}}}
    chat = PROVIDERS["google"].to_chat(body, "/v1beta/models/gemini-x:generateContent", {}).chat_request
    schema = chat["response_format"]["json_schema"]["schema"]
    assert schema["type"] == "object" and schema["properties"]["model_choice"] == {"type": "string",
                                                                                  "enum": ["flash", "pro"]}


def test_anthropic_message_start_counts_prompt_under_vllm(h):
    """vLLM's prompt ids are lifted out of the first chunk by the engine adapter (never parsed):
    message_start still shows the prompt's token count."""
    engine, tokens = VLLMEngine(), TokenData()
    stream = h.chunks(h.scenario("text"))
    translator = PROVIDERS["anthropic"].new_stream("claude-x")
    out = b"".join(translator.feed(engine.parse(orjson.dumps(c), tokens)) for c in stream[:2])
    start = [d for n, d in h.parse_sse(out) if n == "message_start"][0]
    assert start["message"]["usage"]["input_tokens"] == 3 - 0 and len(tokens.prompt_token_ids) == 3


def test_anthropic_is_error_and_thinking_default():
    p = PROVIDERS["anthropic"]
    body = {"model": "m", "max_tokens": 10, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": True,
                                      "content": "command not found"}]}]}
    chat = p.to_chat(body, "/v1/messages", {}).chat_request
    assert chat["messages"][1]["content"] == "Error: command not found"
    # no thinking field: the Messages API does not think; the template default must not decide
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    chat = p.to_chat({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "/v1/messages", {}).chat_request
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}


def test_chat_top_logprobs_reach_the_engine(h):
    p = PROVIDERS["openai_chat"]
    call = p.to_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                      "top_logprobs": 2}, "/v1/chat/completions", {})
    assert call.chat_request["top_logprobs"] == 2
    plain = p.to_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions", {})
    assert "top_logprobs" not in plain.chat_request


def test_responses_custom_tool(h):
    """Codex's freeform apply_patch: sent as a function with one string input; the model's call
    goes back as a custom_tool_call with that input (whole and streamed)."""
    p = PROVIDERS["openai_responses"]
    body = {"model": "gpt-5", "input": "patch it", "stream": True, "tools": [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch"}}]}
    call = p.to_chat(body, "/v1/responses", {})
    fn = call.chat_request["tools"][0]["function"]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert "start: begin_patch" in fn["description"]
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    s = h.scenario("one_tool")
    s["tools"] = [("chatcmpl-tool-p", "apply_patch", json.dumps({"input": patch}))]
    whole = p.from_chat(h.completion(s), "gpt-5", call)
    item = whole["output"][-1]
    assert item["type"] == "custom_tool_call" and item["input"] == patch and item["call_id"] == "chatcmpl-tool-p"
    events = h.parse_sse(h.run_stream(p.new_stream("gpt-5", call), h.chunks(s)))
    done = [d["item"] for n, d in events if n == "response.output_item.done"]
    assert done[-1]["type"] == "custom_tool_call" and done[-1]["input"] == patch
    assert [d["input"] for n, d in events if n == "response.custom_tool_call_input.done"] == [patch]
    assert not [n for n, _ in events if n == "response.function_call_arguments.delta"]
    assert events[-1][1]["response"]["output"][-1]["input"] == patch


@pytest.mark.parametrize("provider,path,body,field", [
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2},
     "n"),
    ("google", "/v1beta/models/g:generateContent",
     {"contents": [{"role": "user", "parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
     "candidateCount"),
])
def test_several_samples_refused_in_provider_shape(provider, path, body, field):
    from polar_proxy.providers import ProviderError

    with pytest.raises(ProviderError) as e:
        PROVIDERS[provider].to_chat(body, path, {})
    status, err = PROVIDERS[provider].error_response(e.value.status, e.value.kind, e.value.message)
    assert status == 400 and field in err["error"]["message"] and "one sample per call" in err["error"]["message"]
