"""Hand-built requests in the shapes harnesses send that the fixtures do not cover: Codex's
Responses input (developer items, namespace / web_search tools, reasoning items), Gemini CLI
(functionCall with id + thoughtSignature, parallel calls without ids), Claude Code without
--bare (system messages inside messages, defer_loading tools); media refused; malformed input."""

from __future__ import annotations

import base64
import copy
import json

import pytest

from polar_proxy.providers import PROVIDERS, ProviderError, detect_provider, media

from .handbuilt import CLAUDE_NON_BARE, CODEX, GEMINI_CLI, GEMINI_PATH, OBJ

def test_codex_responses_shape():
    call = PROVIDERS["openai_responses"].to_chat(CODEX, "/v1/responses", {})
    chat = call.chat_request
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "user", "assistant", "tool",
                                         "assistant", "user", "system"]
    assert msgs[0]["content"] == ("<permissions instructions>sandbox</permissions instructions>"
                                  "\n\nYou are Codex, a coding agent.")
    turn = msgs[3]
    assert turn == {"role": "assistant", "content": "", "reasoning": "Need a shell.",
                    "tool_calls": [{"id": "call_A", "type": "function",
                                    "function": {"name": "shell_command",
                                                 "arguments": "{\"command\":\"echo hi > hi.txt\"}"}}]}
    assert msgs[4] == {"role": "tool", "tool_call_id": "call_A", "content": "Exit code: 0\nOutput:\n"}
    assert msgs[5] == {"role": "assistant", "content": "Done."}
    assert msgs[7] == {"role": "system", "content": "<permissions changed>"}  # kept in place
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell_command", "update_plan",
                                                              "mcp__fs__read", "apply_patch"]
    assert chat["tools"][3]["function"]["parameters"]["properties"] == {"input": {"type": "string"}}
    assert "strict" not in chat["tools"][0]["function"]
    assert chat["parallel_tool_calls"] is False and chat["tool_choice"] == "auto"
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert not {"include", "store", "prompt_cache_key", "reasoning", "text", "input"} & set(chat)
    notes = " | ".join(call.notes)
    for expected in ("dropped tool kind web_search", "custom tool sent as a function",
                     "dropped tool kind local_shell", "dropped tool kind namespace",
                     "flattened namespace tool mcp__fs", "ignored reasoning encrypted_content",
                     "developer role mapped to system (x3)", "ignored field include"):
        assert expected in notes, expected


def test_responses_variants():
    p = PROVIDERS["openai_responses"]
    call = p.to_chat({"model": "m", "input": "hi", "instructions": "Be brief.",
                      "max_output_tokens": 64, "reasoning": {"effort": "none"},
                      "text": {"format": {"type": "json_schema", "name": "out",
                                          "schema": OBJ, "strict": True}},
                      "tool_choice": {"type": "function", "name": "x"}}, "/responses", {})
    chat = call.chat_request
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 64 and chat["stream"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": OBJ, "strict": True}}
    assert "tool_choice" not in chat  # no tools left to choose from
    # other tool-call item kinds in history, and output given as parts
    hist = p.to_chat({"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
        {"type": "local_shell_call", "call_id": "c2", "action": {"type": "exec", "command": ["ls"]}},
        {"type": "local_shell_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "web_search_call", "id": "ws", "status": "completed"},
    ]}, "/v1/responses", {})
    msgs = hist.chat_request["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "tool"]
    assert json.loads(msgs[1]["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin"}
    assert msgs[3]["tool_calls"][0]["function"]["name"] == "local_shell"
    assert msgs[4] == {"role": "tool", "tool_call_id": "c2", "content": "a\nb"}
    assert "dropped input item web_search_call" in hist.notes


def test_gemini_cli_shape():
    p = detect_provider("POST", GEMINI_PATH, {}, GEMINI_CLI)
    assert p is PROVIDERS["google"]
    call = p.to_chat(GEMINI_CLI, GEMINI_PATH, {"alt": "sse"})
    chat = call.chat_request
    assert call.requested_model == chat["model"] == "gemini-2.5-pro" and call.stream
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user",
                                         "assistant", "tool", "tool"]
    assert msgs[0]["content"] == "You are Gemini CLI.\nBe careful."
    assert msgs[2]["reasoning"] == "Plan: use the shell." and msgs[2]["content"] == ""
    (tc,) = msgs[2]["tool_calls"]
    assert tc["id"] == "gc-1" == msgs[3]["tool_call_id"]
    assert tc["function"]["arguments"] == '{"command": "echo hi > hi.txt", "description": "write"}'
    assert msgs[3]["content"] == "Command: echo hi > hi.txt\nExit Code: 0"
    assert msgs[4]["content"] == "Done - created."  # model parts are pieces of one generation
    ids = [t["id"] for t in msgs[6]["tool_calls"]]
    assert ids == ["call_5_0", "call_5_1"]
    assert [m["tool_call_id"] for m in msgs[7:]] == ids  # matched by name, in order
    assert msgs[7]["content"] == "AAA" and json.loads(msgs[8]["content"]) == {"error": "no such file"}
    params = chat["tools"][1]["function"]["parameters"]
    assert params == {"type": "object", "properties": {"path": {"type": "string"},
                                                       "lines": {"type": "array",
                                                                 "items": {"type": "integer"}}},
                      "required": ["path"]}
    assert chat["tools"][0]["function"]["parameters"] == OBJ
    assert len(chat["tools"]) == 2
    assert (chat["temperature"], chat["top_p"], chat["max_tokens"]) == (0, 1, 100)
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["tool_choice"] == "auto"
    assert "dropped tool kind googleSearch" in call.notes
    assert "ignored thoughtSignature" in call.notes
    # Re-rendering the same history gives the same request (generated ids are positional).
    again = p.to_chat(json.loads(json.dumps(GEMINI_CLI)), GEMINI_PATH, {"alt": "sse"})
    assert again.chat_request == chat


def test_gemini_paths_and_config():
    p = PROVIDERS["google"]
    body = {"contents": [{"parts": [{"text": "hi"}]}],
            "generationConfig": {"thinkingConfig": {"thinkingBudget": 0}, "stopSequences": ["X"]},
            "toolConfig": {"functionCallingConfig": {"mode": "ANY",
                                                     "allowedFunctionNames": ["f"]}},
            "tools": [{"functionDeclarations": [{"name": "f"}]}]}
    call = p.to_chat(body, "/v1/models/gemma:generateContent", {})
    assert call.stream is False and call.requested_model == "gemma"
    assert call.chat_request["chat_template_kwargs"] == {"enable_thinking": False}
    assert call.chat_request["stop"] == ["X"]
    assert call.chat_request["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ProviderError) as e:
        p.to_chat(body, "/v1beta/models/gemma:streamGenerateContent", {})
    assert e.value.kind == "unsupported"
    with pytest.raises(ProviderError) as e:
        p.to_chat({**body, "generationConfig": {"candidateCount": 2}},
                  "/v1/models/gemma:generateContent", {})
    assert e.value.kind == "unsupported"


def test_claude_code_non_bare():
    p = PROVIDERS["anthropic"]
    call = p.to_chat(CLAUDE_NON_BARE, "/v1/messages?beta=true", {"beta": "true"})
    chat = call.chat_request
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "user",
                                         "system", "user"]
    assert msgs[0]["content"] == ("You are Claude Code.\n\n"
                                  "<system-reminder>skills: none</system-reminder>")
    a = msgs[2]
    assert a["content"] == "Reading." and a["reasoning"] == "Look at the file."
    assert [tc["id"] for tc in a["tool_calls"]] == ["toolu_01", "toolu_02"]
    # objects serialized with json.dumps(obj, ensure_ascii=False)
    assert a["tool_calls"][0]["function"]["arguments"] == \
        '{"file_path": "/a.py", "limit": 5, "note": "naïve"}'
    assert msgs[3] == {"role": "tool", "tool_call_id": "toolu_01", "content": "line1\nline2"}
    assert msgs[4] == {"role": "tool", "tool_call_id": "toolu_02", "content": "Error: boom"}  # is_error
    assert msgs[5] == {"role": "user", "content": "continue"}
    assert msgs[6] == {"role": "system", "content": "<system-reminder>todo</system-reminder>"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["Read", "Bash"]
    assert chat["tools"][1]["function"] == {"name": "Bash", "parameters": OBJ}
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["stop"] == ["END"] and chat["temperature"] == 1 and chat["max_tokens"] == 128000
    assert not {"metadata", "context_management", "system", "thinking"} & set(chat)
    notes = " | ".join(call.notes)
    for expected in ("stripped x-anthropic-billing-header", "dropped defer_loading tool",
                     "dropped tool kind web_search_20250305", "dropped redacted_thinking block",
                     "tool_result is_error", "merged system message", "kept inline system message",
                     "ignored field context_management"):
        assert expected in notes, expected


def test_anthropic_variants():
    p = PROVIDERS["anthropic"]
    base = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": OBJ}]}
    assert p.to_chat({**base, "thinking": {"type": "disabled"}}, "/v1/messages", {}) \
        .chat_request["chat_template_kwargs"] == {"enable_thinking": False}
    assert p.to_chat({**base, "tool_choice": {"type": "any"}}, "/v1/messages", {}) \
        .chat_request["tool_choice"] == "required"
    assert p.to_chat({**base, "tool_choice": {"type": "tool", "name": "f"}}, "/v1/messages", {}) \
        .chat_request["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    prefill = p.to_chat({**base, "messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "{"}]},
                        "/v1/messages", {}).chat_request
    assert prefill["continue_final_message"] is True and prefill["add_generation_prompt"] is False
    # count_tokens: same normalization, no max_tokens needed; a generation call needs it
    assert p.side_call("POST", "/v1/messages/count_tokens?beta=true") == "count_tokens"
    assert p.side_call("POST", "/v1/messages?beta=true") is None
    no_max = {k: v for k, v in base.items() if k != "max_tokens"}
    counted = p.to_chat(no_max, "/v1/messages/count_tokens", {})
    assert counted.chat_request["messages"] == [{"role": "user", "content": "hi"}]
    assert p.count_tokens_answer(42) == {"input_tokens": 42}
    with pytest.raises(ProviderError):
        p.to_chat(no_max, "/v1/messages", {})


def test_chat_normalization():
    p = PROVIDERS["openai_chat"]
    body = {"model": "m", "messages": [
        {"role": "developer", "content": "A"},
        {"role": "system", "content": [{"type": "text", "text": "B"}, {"type": "text", "text": "C"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "x"}],
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "r1"},
                                                           {"type": "text", "text": "r2"}]},
        {"role": "system", "content": "late"},
    ], "max_completion_tokens": 99, "logprobs": True, "top_logprobs": 3,
        "stream_options": {"include_usage": True}, "store": True, "metadata": {"a": "b"},
        "temperature": 0.2, "seed": 7, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "custom", "name": "g"}],
        "tool_choice": "auto", "parallel_tool_calls": True, "stream": True}
    call = p.to_chat(body, "/v1/chat/completions", {})
    chat = call.chat_request
    assert chat["messages"] == [
        {"role": "system", "content": "A\n\nB\nC"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x", "tool_calls": body["messages"][3]["tool_calls"]},
        {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"},
        {"role": "system", "content": "late"},
    ]
    assert chat["max_tokens"] == 99 and "max_completion_tokens" not in chat
    assert not {"logprobs", "stream_options", "store", "metadata"} & set(chat)
    assert chat["top_logprobs"] == 3  # the engine computes what the harness asked for
    assert (chat["temperature"], chat["seed"], chat["tool_choice"]) == (0.2, 7, "auto")
    assert chat["response_format"] == {"type": "json_object"} and chat["parallel_tool_calls"]
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"]
    assert call.options == {"include_usage": True, "logprobs": True, "top_logprobs": 3}
    assert "dropped tool kind custom" in call.notes
    with pytest.raises(ProviderError) as e:
        p.to_chat({**body, "n": 2}, "/v1/chat/completions", {})
    assert e.value.kind == "unsupported"


IMAGE_CASES = [
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                  "media_type": "image/png",
                                                                  "data": "iVBOR"}}]}]}),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}]}),
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it"},
                                     {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c",
         "output": [{"type": "input_image", "image_url": "data:,"}]}]}),
    ("google", "/v1beta/models/g:generateContent", {"contents": [
        {"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "x"}}]}]}),
]


@pytest.mark.parametrize("provider,path,body", IMAGE_CASES)
def test_images_become_placeholders(provider, path, body):
    """An image in the history (a tool that read a PNG) no longer ends the session with a 400:
    a text-only model gets a placeholder naming it; a model that reads images gets the image."""
    call = PROVIDERS[provider].to_chat(copy.deepcopy(body), path, {})
    assert media.settle(call, "placeholder") == 1
    msgs = call.chat_request["messages"]
    assert all(isinstance(m.get("content"), str) for m in msgs), msgs
    text = " ".join(m["content"] for m in msgs if m["role"] in ("user", "tool"))
    assert "[image: " in text and "text only" in text and "_polar_media" not in json.dumps(call.chat_request)
    assert any("image replaced by a text placeholder" in n for n in call.notes), call.notes

    call = PROVIDERS[provider].to_chat(copy.deepcopy(body), path, {})
    media.settle(call, "pass")
    parts = [p for m in call.chat_request["messages"] if isinstance(m.get("content"), list) for p in m["content"]]
    assert [p["type"] for p in parts if p["type"] != "text"] == ["image_url"]
    assert parts[-1]["image_url"]["url"].startswith("data:") and "_polar_media" not in json.dumps(parts)


def test_image_placeholder_names_kind_type_and_size():
    png = base64.b64encode(b"\x89PNG" + b"\0" * 996).decode()
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "the file:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": png}}]}]}
    call = PROVIDERS["anthropic"].to_chat(body, "/v1/messages", {})
    media.settle(call)
    msgs = call.chat_request["messages"]
    assert msgs[1] == {"role": "tool", "tool_call_id": "t", "content":
                       "the file:\n[image: image/png, 1000 bytes; not shown: the served model reads text only]"}
    assert msgs[2]["content"] == ("notes\n[document: application/pdf, 1000 bytes; not shown: the served model "
                                  "reads text only]")
    # a history without media renders exactly as before (plain strings, no notes)
    plain = PROVIDERS["anthropic"].to_chat({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
        "/v1/messages", {})
    assert media.settle(plain) == 0 and plain.chat_request["messages"][0]["content"] == "a\nb"


MALFORMED = [
    ("anthropic", "/v1/messages", ["not", "an", "object"]),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5}),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5,
                                   "messages": [{"role": "robot", "content": "x"}]}),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]}),
    ("anthropic", "/v1/messages", {"model": "m", "max_tokens": 5,
                                   "messages": [{"role": "user", "content": 42}]}),
    ("openai_chat", "/v1/chat/completions", "text"),
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": {"role": "user"}}),
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": [{"role": "bot"}]}),
    ("openai_chat", "/v1/chat/completions", {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}),
    ("openai_chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("openai_responses", "/v1/responses", {"model": "m"}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": [{"type": "mystery"}]}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": [
        {"type": "function_call", "name": "f", "arguments": "{}"}]}),
    ("openai_responses", "/v1/responses", {"model": "m", "input": "x",
                                           "previous_response_id": "resp_1"}),
    ("google", "/v1beta/models/g:generateContent", {}),
    ("google", "/v1beta/models/g:generateContent", {"contents": [
        {"role": "user", "parts": [{"functionCall": {"name": "f", "args": {}}}]}]}),
    ("google", "/v1beta/models/g:generateContent", {"contents": [
        {"role": "wizard", "parts": [{"text": "x"}]}]}),
    ("google", "/v1beta/models/g:generateContent", None),
]


@pytest.mark.parametrize("provider,path,body", MALFORMED)
def test_malformed_bodies_refused(provider, path, body):
    with pytest.raises(ProviderError) as e:
        PROVIDERS[provider].to_chat(body, path, {})
    assert e.value.status == 400 and e.value.kind in ("invalid_request", "unsupported")
    assert e.value.message


@pytest.mark.parametrize("method,path,expected", [
    ("POST", "/v1/messages?beta=true", "anthropic"),
    ("POST", "/v1/messages/count_tokens?beta=true", "anthropic"),
    ("POST", "/v1/chat/completions", "openai_chat"),
    ("POST", "/chat/completions", "openai_chat"),
    ("POST", "/openai/v1/chat/completions", "openai_chat"),
    ("POST", "/v1/responses", "openai_responses"),
    ("POST", "/responses", "openai_responses"),
    ("POST", "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", "google"),
    ("POST", "/v1/models/gemma:generateContent", "google"),
    ("POST", "/v1beta/models/gemma:countTokens", "google"),
    ("GET", "/v1/models", None),
    ("POST", "/v1/embeddings", None),
    ("POST", "/v1/messages/batches", None),
    ("GET", "/v1/responses", None),
])
def test_detection(method, path, expected):
    p = detect_provider(method, path, {}, {})
    assert (p.name if p else None) == expected
