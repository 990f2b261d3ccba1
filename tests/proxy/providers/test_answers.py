"""Engine answers back into each wire format, whole and streamed (chunks split at awkward
places, tool names arriving late), read back the way a client reads them: same text, reasoning
and tool calls, the right stop reason, usage, well-formed event sequences, engine fields gone."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_proxy.providers import PROVIDERS, NormalizedCall

SCENARIOS = ("text", "reasoning", "one_tool", "two_tools", "length", "length_empty")
VLLM_OVERFLOW = ("This model's maximum context length is 32768 tokens. However, you requested "
                 "40000 tokens (39000 in the messages, 1000 in the completion).")


def call_for(provider: str, **options) -> NormalizedCall:
    return NormalizedCall(chat_request={}, stream=True, requested_model="asked-model",
                          options=options)


# --- Anthropic --------------------------------------------------------------------------------

def anthropic_read(msg):
    out = {"reasoning": "", "text": "", "tools": []}
    for block in msg["content"]:
        if block["type"] == "thinking":
            assert block["signature"]
            out["reasoning"] += block["thinking"]
        elif block["type"] == "text":
            out["text"] += block["text"]
        else:
            assert block["type"] == "tool_use"
            out["tools"].append((block["id"], block["name"], block["input"]))
    return out


def anthropic_stream_read(events):
    names = [e for e, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert all(e == d["type"] for e, d in events)
    start = events[0][1]["message"]
    assert start["model"] == "asked-model" and start["content"] == []
    blocks, open_index, last_delta = {}, None, {}
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks[open_index] = dict(data["content_block"], _json="")
        elif name == "content_block_delta":
            assert data["index"] == open_index
            b, d = blocks[open_index], data["delta"]
            last_delta[open_index] = d["type"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                assert d["type"] == "input_json_delta"
                b["_json"] += d["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            if blocks[open_index]["type"] == "thinking":
                assert last_delta[open_index] == "signature_delta"
            open_index = None
    assert open_index is None
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = json.loads(b["_json"]) if b["_json"] else {}
    msg = {"content": [blocks[i] for i in sorted(blocks)]}
    delta = events[-2][1]
    return anthropic_read(msg), delta["delta"]["stop_reason"], delta["usage"]


ANTHROPIC_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_anthropic_answers(h, name):
    p = PROVIDERS["anthropic"]
    s = h.scenario(name)
    whole = p.from_chat(h.completion(s), "asked-model", call_for("anthropic"))
    assert whole["type"] == "message" and whole["model"] == "asked-model"
    assert whole["id"].startswith("msg_")
    assert anthropic_read(whole) == h.expected(s)
    assert whole["stop_reason"] == ANTHROPIC_STOP[s["finish"]]
    assert whole["usage"] == {"input_tokens": 100, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 20, "output_tokens": 17}
    for late in (False, True):
        raw = h.run_stream(p.new_stream("asked-model"), h.chunks(s, name_late=late))
        got, stop, usage = anthropic_stream_read(h.parse_sse(raw))
        assert got == h.expected(s)
        assert stop == ANTHROPIC_STOP[s["finish"]]
        assert usage["output_tokens"] == 17 and usage["input_tokens"] == 100


def test_anthropic_stop_sequence_and_errors(h):
    p = PROVIDERS["anthropic"]
    call = p.to_chat({"model": "m", "max_tokens": 9, "stop_sequences": ["###"],
                      "messages": [{"role": "user", "content": "x"}]}, "/v1/messages", {})
    resp = {"id": "c1", "choices": [{"message": {"content": "a"}, "finish_reason": "stop",
                                     "stop_reason": "###"}], "usage": {}}
    out = p.from_chat(resp, "m", call)
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "###")
    status, body = p.error_response(400, "context_length", VLLM_OVERFLOW)
    assert status == 400 and body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 40000 tokens > 32768 maximum"}}
    assert p.error_response(503, "overloaded", "busy")[0] == 529
    assert p.error_response(429, "rate_limited", "slow")[1]["error"]["type"] == "rate_limit_error"
    assert p.error_response(502, "upstream_refused", "down") == (
        502, {"type": "error", "error": {"type": "api_error", "message": "down"}})
    raw = p.new_stream("m").fail("upstream_error", "engine died")
    assert h.parse_sse(raw) == [("error", {"type": "error", "error": {
        "type": "api_error", "message": "engine died"}})]


# --- OpenAI Chat ------------------------------------------------------------------------------

def chat_stream_read(events):
    assert events[-1] == (None, "[DONE]")
    text, reasoning, tools, finish, usage = "", "", {}, None, None
    for _, c in events[:-1]:
        assert c["model"] == "asked-model"
        assert "prompt_token_ids" not in c
        if not c["choices"]:
            usage = c["usage"]
            continue
        (ch,) = c["choices"]
        assert "token_ids" not in ch and "logprobs" not in ch and "stop_reason" not in ch
        d = ch["delta"]
        text += d.get("content") or ""
        reasoning += d.get("reasoning") or ""
        for tc in d.get("tool_calls") or []:
            t = tools.setdefault(tc["index"], {"id": None, "name": "", "args": ""})
            t["id"] = t["id"] or tc.get("id")
            t["name"] += (tc.get("function") or {}).get("name") or ""
            t["args"] += (tc.get("function") or {}).get("arguments") or ""
        finish = ch.get("finish_reason") or finish
    got = {"reasoning": reasoning, "text": text,
           "tools": [(t["id"], t["name"], json.loads(t["args"])) for _, t in sorted(tools.items())]}
    return got, finish, usage


@pytest.mark.parametrize("name", SCENARIOS)
def test_openai_chat_answers(h, name):
    p = PROVIDERS["openai_chat"]
    s = h.scenario(name)
    whole = p.from_chat(h.completion(s), "asked-model", call_for("openai_chat"))
    assert whole["model"] == "asked-model"
    assert not {"prompt_token_ids", "prompt_logprobs"} & set(whole)
    (choice,) = whole["choices"]
    assert not {"token_ids", "logprobs", "stop_reason"} & set(choice)
    assert choice["finish_reason"] == s["finish"] and whole["usage"] == s["usage"]
    for with_usage in (False, True):
        stream = p.new_stream("asked-model", call_for("openai_chat", include_usage=with_usage))
        got, finish, usage = chat_stream_read(h.parse_sse(h.run_stream(stream, h.chunks(s))))
        assert got == h.expected(s) and finish == s["finish"]
        assert usage == (s["usage"] if with_usage else None)


def test_openai_chat_logprobs_when_asked(h):
    p = PROVIDERS["openai_chat"]
    call = p.to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "logprobs": True, "top_logprobs": 0}, "/v1/chat/completions", {})
    out = p.from_chat(h.completion(h.scenario("text")), "m", call)
    lp = out["choices"][0]["logprobs"]["content"][0]
    assert lp["logprob"] == -0.5 and lp["top_logprobs"] == []
    status, body = p.error_response(400, "context_length", VLLM_OVERFLOW)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 32768 tokens" in body["error"]["message"]
    assert "40000" in body["error"]["message"]
    assert p.error_response(500, "rate_limited", "x")[0] == 429
    fail = h.parse_sse(p.new_stream("m").fail("upstream_error", "boom"))
    assert fail == [(None, {"error": {"message": "boom", "type": "server_error", "param": None,
                                      "code": None}})]


# --- OpenAI Responses -------------------------------------------------------------------------

def responses_read(resp):
    out = {"reasoning": "", "text": "", "tools": []}
    for item in resp["output"]:
        if item["type"] == "reasoning":
            out["reasoning"] += "".join(s["text"] for s in item["summary"])
        elif item["type"] == "message":
            assert item["role"] == "assistant" and item["status"] == "completed"
            out["text"] += "".join(c["text"] for c in item["content"])
        else:
            assert item["type"] == "function_call" and item["status"] == "completed"
            out["tools"].append((item["call_id"], item["name"], json.loads(item["arguments"])))
    return out


def responses_stream_read(events):
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(e == d["type"] for e, d in events)
    assert [e for e, _ in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0][1]["response"]["status"] == "in_progress"
    final_name, final = events[-1]
    added, done, deltas = {}, {}, {}
    for name, d in events[2:-1]:
        if name == "response.output_item.added":
            assert d["output_index"] == len(added)
            added[d["output_index"]] = d["item"]
        elif name == "response.output_item.done":
            done[d["output_index"]] = d["item"]
        elif name.endswith(".delta"):
            deltas[d["output_index"]] = deltas.get(d["output_index"], "") + d["delta"]
        elif name == "response.function_call_arguments.done":
            assert d["arguments"] == deltas.get(d["output_index"], "")
        elif name == "response.output_text.done":
            assert d["text"] == deltas[d["output_index"]]
    assert sorted(added) == sorted(done)
    resp = final["response"]
    assert resp["output"] == [done[i] for i in sorted(done)]
    for i, item in done.items():
        assert item["id"] == added[i]["id"]
        text = (item.get("arguments") if item["type"] == "function_call" else
                "".join(c["text"] for c in item.get("content") or item.get("summary") or []))
        assert text == deltas.get(i, "")
    return responses_read(resp), final_name, resp


@pytest.mark.parametrize("name", SCENARIOS)
def test_openai_responses_answers(h, name):
    p = PROVIDERS["openai_responses"]
    s = h.scenario(name)
    incomplete = s["finish"] == "length"
    whole = p.from_chat(h.completion(s), "asked-model", call_for("openai_responses"))
    assert whole["object"] == "response" and whole["model"] == "asked-model"
    assert responses_read(whole) == h.expected(s)
    assert whole["status"] == ("incomplete" if incomplete else "completed")
    assert whole["incomplete_details"] == ({"reason": "max_output_tokens"} if incomplete else None)
    assert whole["usage"] == {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 20},
                              "output_tokens": 17, "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 137}
    for late in (False, True):
        raw = h.run_stream(p.new_stream("asked-model"), h.chunks(s, name_late=late))
        assert raw.startswith(b"event: response.created\ndata: ")
        got, final_name, resp = responses_stream_read(h.parse_sse(raw))
        assert got == h.expected(s)
        assert final_name == "response.completed"  # also when incomplete (Codex retries otherwise)
        assert resp["status"] == whole["status"]
        assert resp["incomplete_details"] == whole["incomplete_details"]
        assert resp["usage"]["total_tokens"] == 137 and resp["model"] == "asked-model"


def test_openai_responses_failure_event(h):
    p = PROVIDERS["openai_responses"]
    stream = p.new_stream("m")
    raw = stream.feed(h.chunks(h.scenario("text"))[0]) + stream.fail("context_length", VLLM_OVERFLOW)
    events = h.parse_sse(raw)
    assert [e for e, _ in events][-1] == "response.failed"
    err = events[-1][1]["response"]["error"]
    assert err["code"] == "context_length_exceeded" and "32768" in err["message"]
    assert p.error_response(400, "context_length", "x")[1]["error"]["code"] == "context_length_exceeded"


# --- Google -----------------------------------------------------------------------------------

def google_read(resp):
    out = {"reasoning": "", "text": "", "tools": []}
    (cand,) = resp["candidates"]
    assert cand["content"]["role"] == "model"
    for part in cand["content"]["parts"]:
        if "functionCall" in part:
            fc = part["functionCall"]
            assert isinstance(fc["args"], dict)
            out["tools"].append((fc["id"], fc["name"], fc["args"]))
        elif part.get("thought"):
            out["reasoning"] += part["text"]
        else:
            out["text"] += part["text"]
    return out


GOOGLE_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_google_answers(h, name):
    p = PROVIDERS["google"]
    s = h.scenario(name)
    whole = p.from_chat(h.completion(s), "asked-model")
    assert whole["modelVersion"] == "asked-model" and whole["responseId"]
    assert google_read(whole) == h.expected(s)
    assert whole["candidates"][0]["finishReason"] == GOOGLE_FINISH[s["finish"]]
    assert whole["usageMetadata"] == {"promptTokenCount": 120, "candidatesTokenCount": 17,
                                      "totalTokenCount": 137, "cachedContentTokenCount": 20}
    for late in (False, True):
        raw = h.run_stream(p.new_stream("asked-model"), h.chunks(s, name_late=late))
        assert raw.endswith(b"\r\n\r\n") and b"\nevent:" not in raw
        frames = [d for _, d in h.parse_sse(raw)]
        merged = {"reasoning": "", "text": "", "tools": []}
        for f in frames:
            part = google_read(f)
            for k in merged:
                merged[k] += part[k]
        assert merged == h.expected(s)
        assert [("finishReason" in f["candidates"][0]) for f in frames] == \
            [False] * (len(frames) - 1) + [True]
        assert frames[-1]["candidates"][0]["finishReason"] == GOOGLE_FINISH[s["finish"]]
        assert frames[-1]["usageMetadata"]["candidatesTokenCount"] == 17
        if s["content"]:  # text is streamed, not held back
            assert len([f for f in frames if google_read(f)["text"]]) > 1


def test_google_errors(h):
    p = PROVIDERS["google"]
    assert p.error_response(400, "context_length", VLLM_OVERFLOW) == (400, {"error": {
        "code": 400, "status": "INVALID_ARGUMENT",
        "message": "The input token count (40000) exceeds the maximum number of tokens allowed (32768)."}})
    assert p.error_response(429, "rate_limited", "x")[1]["error"]["status"] == "RESOURCE_EXHAUSTED"
    assert p.error_response(503, "overloaded", "x")[1]["error"]["status"] == "UNAVAILABLE"
    assert p.error_response(404, "not_found", "x")[0] == 404
    (frame,) = h.parse_sse(p.new_stream("m").fail("timeout", "slow"))
    assert frame[1]["error"] == {"code": 504, "message": "slow", "status": "DEADLINE_EXCEEDED"}


# --- Any split of the engine's stream reconstructs the same answer ----------------------------


_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
_args = st.dictionaries(st.text(max_size=6), st.one_of(_text, st.integers(), st.booleans()),
                        max_size=4)


def _cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:]) if b > a]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reasoning=_text, content=_text, args=st.lists(_args, max_size=2),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_chunk_split_reconstructs(h, reasoning, content, args, cuts):
    calls = [(f"call_{i}", f"tool{i}", json.dumps(a, ensure_ascii=False)) for i, a in enumerate(args)]
    head = {"id": "chatcmpl-x1", "object": "chat.completion.chunk", "created": 1, "model": "s"}
    stream = [dict(head, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}])]
    stream += [dict(head, choices=[{"index": 0, "delta": {"reasoning": p}}])
               for p in _cut(reasoning, cuts)]
    stream += [dict(head, choices=[{"index": 0, "delta": {"content": p}}]) for p in _cut(content, cuts)]
    for i, (cid, name, raw) in enumerate(calls):
        stream.append(dict(head, choices=[{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]}}]))
        stream += [dict(head, choices=[{"index": 0, "delta": {"tool_calls": [
            {"index": i, "function": {"arguments": p}}]}}]) for p in _cut(raw, cuts)]
    finish = "tool_calls" if calls else "stop"
    stream.append(dict(head, choices=[{"index": 0, "delta": {}, "finish_reason": finish}]))
    want = {"reasoning": reasoning, "text": content,
            "tools": [(cid, name, json.loads(raw)) for cid, name, raw in calls]}

    got, _, _ = anthropic_stream_read(h.parse_sse(h.run_stream(
        PROVIDERS["anthropic"].new_stream("asked-model"), stream)))
    assert got == want
    got, _, _ = responses_stream_read(h.parse_sse(h.run_stream(
        PROVIDERS["openai_responses"].new_stream("asked-model"), stream)))
    assert got == want
    got, _, _ = chat_stream_read(h.parse_sse(h.run_stream(
        PROVIDERS["openai_chat"].new_stream("asked-model"), stream)))
    assert got == want
    merged = {"reasoning": "", "text": "", "tools": []}
    for _, frame in h.parse_sse(h.run_stream(PROVIDERS["google"].new_stream("asked-model"), stream)):
        part = google_read(frame)
        for k in merged:
            merged[k] += part[k]
    assert merged == want


# --- An answer sent back as history normalizes to the message the engine produced ------------

def _next_turn(provider: str, native: dict, tool_ids: list[str]) -> tuple[dict, str]:
    """The harness's next request: user, our answer as history, one result per tool call."""
    if provider == "anthropic":
        results = [{"type": "tool_result", "tool_use_id": i, "content": "ok"} for i in tool_ids]
        return {"model": "asked-model", "max_tokens": 9, "messages": [
            {"role": "user", "content": "go"}, {"role": "assistant", "content": native["content"]},
            {"role": "user", "content": results or "next"}]}, "/v1/messages"
    if provider == "openai_responses":
        results = [{"type": "function_call_output", "call_id": i, "output": "ok"} for i in tool_ids]
        return {"model": "asked-model", "input": [{"role": "user", "content": "go"},
                                                  *native["output"], *results]}, "/v1/responses"
    if provider == "google":
        by_id = {p["functionCall"]["id"]: p["functionCall"]["name"]
                 for p in native["candidates"][0]["content"]["parts"] if "functionCall" in p}
        results = [{"functionResponse": {"id": i, "name": by_id[i], "response": {"output": "ok"}}}
                   for i in tool_ids]
        return {"contents": [{"role": "user", "parts": [{"text": "go"}]},
                             native["candidates"][0]["content"],
                             {"role": "user", "parts": results or [{"text": "next"}]}]}, \
            "/v1beta/models/asked-model:generateContent"
    results = [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in tool_ids]
    return {"model": "asked-model", "messages": [
        {"role": "user", "content": "go"}, native["choices"][0]["message"],
        *(results or [{"role": "user", "content": "next"}])]}, "/v1/chat/completions"


@pytest.mark.parametrize("provider", list(PROVIDERS))
@pytest.mark.parametrize("name", ["reasoning", "one_tool", "two_tools"])
def test_answer_round_trips_into_the_same_history(h, provider, name):
    """Prefix merging needs call N+1's prompt to contain call N's answer as generated: the
    translated answer, echoed back by the harness, must normalize to the engine's message
    (same text, reasoning, tool-call ids and argument strings byte for byte)."""
    p = PROVIDERS[provider]
    s = h.scenario(name)
    native = p.from_chat(h.completion(s), "asked-model", call_for(provider))
    body, path = _next_turn(provider, json.loads(json.dumps(native)), [t[0] for t in s["tools"]])
    msgs = p.to_chat(body, path, {}).chat_request["messages"]
    (assistant,) = [m for m in msgs if m["role"] == "assistant"]
    assert (assistant.get("content") or "") == s["content"]
    assert (assistant.get("reasoning") or "") == s["reasoning"]
    assert [(t["id"], t["function"]["name"], t["function"]["arguments"])
            for t in assistant.get("tool_calls") or []] == list(s["tools"])
    assert [m["tool_call_id"] for m in msgs if m["role"] == "tool"] == [t[0] for t in s["tools"]]
