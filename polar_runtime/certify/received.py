"""What the harness received: the reasoning and the answer text of a saved flow's response body,
read field by field in the provider's own wire format.

The capture record holds the answer as the proxy assembled it before translation, so a translator
that sent reasoning as answer text, or dropped it, leaves the record unchanged; the flow holds the
bytes the harness got. certify's reasoning check reads both: the sampled reasoning must be in the
provider's reasoning field (chat ``reasoning``/``reasoning_content``, Anthropic ``thinking``,
Responses ``reasoning`` items, Gemini ``thought`` parts), whole, and not in its answer text.
"""

from __future__ import annotations

import json
from typing import Any, Callable


def payloads(body: str) -> list[dict[str, Any]]:
    """The JSON objects of a response body: one for a plain JSON answer, one per SSE ``data:`` line."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
            return [obj] if isinstance(obj, dict) else []
        except ValueError:
            pass  # an SSE body whose first event has no name: read it line by line
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    out.append(obj)
    return out


def _chat(objs: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning = text = ""
    for o in objs:
        for c in o.get("choices") or ():
            d = c.get("delta") or c.get("message") or {}
            reasoning += d.get("reasoning") or d.get("reasoning_content") or ""
            text += d.get("content") if isinstance(d.get("content"), str) else ""
    return reasoning, text


def _anthropic(objs: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning = text = ""
    for o in objs:
        kind = o.get("type")
        blocks = o.get("content") if kind == "message" else [o.get("content_block")] if kind == "content_block_start" else []
        for b in blocks or ():
            if isinstance(b, dict):
                reasoning += b.get("thinking", "") if b.get("type") == "thinking" else ""
                text += b.get("text", "") if b.get("type") == "text" else ""
        if kind == "content_block_delta":
            d = o.get("delta") or {}
            reasoning += d.get("thinking", "") if d.get("type") == "thinking_delta" else ""
            text += d.get("text", "") if d.get("type") == "text_delta" else ""
    return reasoning, text


def _responses(objs: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning = text = ""
    deltas = False
    for o in objs:
        kind = str(o.get("type") or "")
        if kind == "response.output_text.delta":
            text, deltas = text + str(o.get("delta") or ""), True
        elif kind.startswith("response.reasoning") and kind.endswith(".delta"):
            reasoning, deltas = reasoning + str(o.get("delta") or ""), True
    if deltas:
        return reasoning, text
    # a plain answer, or a stream without deltas: the finished response's output items
    final = [o.get("response") if "response" in o else o for o in objs if o.get("object") == "response"
             or o.get("type") in ("response.completed", "response.incomplete")]
    for resp in final[-1:]:
        for item in (resp or {}).get("output") or ():
            if item.get("type") == "message":
                text += "".join(c.get("text", "") for c in item.get("content") or () if c.get("type") == "output_text")
            elif item.get("type") == "reasoning":
                reasoning += "".join(c.get("text", "") for c in item.get("content") or ()) or \
                    "".join(s.get("text", "") for s in item.get("summary") or ())
    return reasoning, text


def _google(objs: list[dict[str, Any]]) -> tuple[str, str]:
    reasoning = text = ""
    for o in objs:
        for cand in o.get("candidates") or ():
            for part in (cand.get("content") or {}).get("parts") or ():
                if part.get("thought"):
                    reasoning += part.get("text", "")
                elif "functionCall" not in part:
                    text += part.get("text", "")
    return reasoning, text


READERS: dict[str, Callable[[list[dict[str, Any]]], tuple[str, str]]] = {
    "openai_chat": _chat, "anthropic": _anthropic, "openai_responses": _responses, "google": _google}


def reasoning_and_text(provider: str, body: str) -> tuple[str, str] | None:
    """(reasoning, answer text) the harness received; None for a provider without a reader here."""
    reader = READERS.get(provider)
    return reader(payloads(body)) if reader else None
