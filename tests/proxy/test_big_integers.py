"""Integers beyond 64 bits (harness bodies, model-written tool arguments) must not break answers
or captures: orjson refuses them, so the proxy falls back to the standard library."""

import json

from polar_core.schema import CallRecord
from polar_proxy.capture import encode_record
from polar_proxy.providers import PROVIDERS

BIG = 2**70 + 3


def _tool_chunk(arguments: str) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": {
        "tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                        "function": {"name": "bash", "arguments": arguments}}]}, "finish_reason": None}]}


def _finish_chunk() -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}


def test_capture_record_with_big_integer_round_trips_exactly():
    line = encode_record(CallRecord(session_id="s", native_request={"seed": BIG}))
    assert line.endswith(b"\n")
    assert json.loads(line)["native_request"]["seed"] == BIG


def test_google_stream_with_big_integer_tool_argument_keeps_the_value():
    stream = PROVIDERS["google"].new_stream("gemini-x")
    out = stream.feed(_tool_chunk(json.dumps({"n": BIG}))) + stream.feed(_finish_chunk()) + stream.finish()
    calls = [part["functionCall"]
             for frame in out.split(b"\r\n\r\n") if frame.startswith(b"data: ")
             for cand in json.loads(frame[6:]).get("candidates", [])
             for part in cand.get("content", {}).get("parts", []) if "functionCall" in part]
    assert calls and calls[0]["args"] == {"n": BIG}


def test_anthropic_answer_with_big_integer_tool_argument():
    answer = {"id": "x", "object": "chat.completion", "model": "m", "choices": [{"index": 0, "finish_reason": "tool_calls",
              "message": {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"n": BIG})}}]}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    native = PROVIDERS["anthropic"].from_chat(answer, "claude-x")
    tool_use = [b for b in native["content"] if b["type"] == "tool_use"][0]
    assert tool_use["input"] == {"n": BIG}
