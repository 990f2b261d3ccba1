"""An answer in chat format, whole or chunk by chunk: what the capture record keeps of it
(``ChatAccumulator``), and a whole answer replayed as the chunks a streaming server would send
(``synthetic_chunks``, for ``polar_stream_mode=synthetic``)."""

from __future__ import annotations

from typing import Any

from polar_core.schema import CallRecord
from polar_proxy import jsonutil


class ChatAccumulator:
    """Output text, reasoning, tool calls, finish reason and usage of one chat answer (or stream)."""

    __slots__ = ("content", "reasoning", "tools", "finish_reason", "usage")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tools: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}

    def feed_chunk(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
            r = delta.get("reasoning") or delta.get("reasoning_content")
            if r:
                self.reasoning.append(r)
            for tc in delta.get("tool_calls") or ():
                slot = self.tools.setdefault(tc.get("index", len(self.tools)), {"id": "", "name": "", "arguments": ""})
                if tc.get("id"):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["name"] += fn["name"]
                if fn.get("arguments"):
                    slot["arguments"] += fn["arguments"]
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def feed_whole(self, response: dict[str, Any]) -> None:
        self.usage = response.get("usage") or {}
        for choice in response.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            msg = choice.get("message") or {}
            if msg.get("content"):
                self.content.append(msg["content"] if isinstance(msg["content"], str) else jsonutil.dumps(msg["content"]).decode())
            r = msg.get("reasoning") or msg.get("reasoning_content")
            if r:
                self.reasoning.append(r)
            for i, tc in enumerate(msg.get("tool_calls") or ()):
                fn = tc.get("function") or {}
                self.tools[i] = {"id": tc.get("id") or "", "name": fn.get("name") or "", "arguments": fn.get("arguments") or ""}
            self.finish_reason = choice.get("finish_reason")

    def fill(self, rec: CallRecord) -> None:
        rec.output_text = "".join(self.content)
        rec.output_reasoning = "".join(self.reasoning)
        rec.output_tool_calls = [self.tools[k] for k in sorted(self.tools)]
        rec.finish_reason = self.finish_reason
        rec.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
        rec.completion_tokens = int(self.usage.get("completion_tokens") or 0)


def synthetic_chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat.completion replayed as the chunk sequence a streaming server would send."""
    base = {"id": response.get("id", ""), "object": "chat.completion.chunk", "created": response.get("created", 0),
            "model": response.get("model", "")}
    choice = (response.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        chunks.append({**base, "choices": [{"index": 0, "delta": {"reasoning": reasoning}, "finish_reason": None}]})
    if msg.get("content"):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": msg["content"]}, "finish_reason": None}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        fn = tc.get("function") or {}
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": tc.get("id"), "type": "function",
             "function": {"name": fn.get("name"), "arguments": fn.get("arguments") or ""}}]}, "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice.get("finish_reason") or "stop"}]})
    if response.get("usage"):
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return chunks
