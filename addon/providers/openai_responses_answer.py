"""OpenAI Responses answers: the ``response`` object and its output items (reasoning, message,
function_call), whole (``OpenAIResponsesProvider.from_chat``) and streamed (``ResponsesStream``:
chat chunks -> the Responses event sequence, ``sequence_number`` on every event, ending in
``response.completed`` with the full response).
"""

from __future__ import annotations

import json
import time
from typing import Any

from .base import StreamTranslator
from .common import ChunkReader, Event, arguments_complete, base_id, cached_tokens, sse
from .openai_chat import openai_error


def usage_object(prompt: int, completion: int, usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached_tokens(usage)},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response_object(rid: str, model: str, created: int, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": options.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": options.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": options.get("reasoning_effort"), "summary": None},
        "store": False,
        "temperature": options.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": options.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content if status == "completed" else []}


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    summary = [] if text is None else [{"type": "summary_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": summary}


def custom_input(arguments: str) -> str:
    """The freeform input of a call to a custom tool: ``input`` of its arguments (the raw
    arguments when they are not an object with a string ``input``)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return value["input"]
    return arguments


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed", custom: bool = False) -> dict[str, Any]:
    if custom:  # a call of a freeform tool: its input, not JSON arguments
        return {"id": item_id, "type": "custom_tool_call", "status": status, "call_id": call_id,
                "name": name, "input": custom_input(arguments)}
    return {"id": item_id, "type": "function_call", "status": status, "arguments": arguments,
            "call_id": call_id, "name": name}


class ResponsesStream(StreamTranslator):
    """chat chunks -> Responses events. Items are opened lazily, closed when another starts;
    the final ``response.completed`` carries every item in output order."""

    def __init__(self, requested_model: str, options: dict[str, Any]):
        self.model = requested_model
        self.options = options
        self.reader = ChunkReader()
        self.seq = 0
        self.started = False
        self.base = ""
        self.created = 0
        self.output: list[dict[str, Any] | None] = []  # finished items by output_index
        self.open: dict[str, Any] | None = None  # {kind, index, id, text[]}
        self.tools: dict[int, dict[str, Any]] = {}  # chat tool index -> state
        self.tool_seq = 0
        self.custom = set(options.get("custom_tools") or ())

    def _emit(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return sse(data, kind)

    def _snapshot(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        output = [item for item in self.output if item is not None]
        return response_object(f"resp_{self.base}", self.model, self.created, status, output, usage,
                         self.options)

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        self.base = base_id(self.reader.id)
        self.created = self.reader.created or int(time.time())
        snap = self._snapshot("in_progress")
        return (self._emit("response.created", {"response": snap})
                + self._emit("response.in_progress", {"response": snap}))

    def _new_index(self) -> int:
        self.output.append(None)
        return len(self.output) - 1

    def _close(self, cut: bool = False) -> bytes:
        o = self.open
        if o is None:
            return b""
        self.open = None
        idx, item_id = o["index"], o["id"]
        if o["kind"] == "reasoning":
            text = "".join(o["text"])
            part = {"type": "summary_text", "text": text}
            item = reasoning_item(item_id, text)
            out = self._emit("response.reasoning_summary_text.done",
                             {"item_id": item_id, "output_index": idx, "summary_index": 0,
                              "text": text})
            out += self._emit("response.reasoning_summary_part.done",
                              {"item_id": item_id, "output_index": idx, "summary_index": 0,
                               "part": part})
        elif o["kind"] == "message":
            text = "".join(o["text"])
            item = message_item(item_id, text)
            part = item["content"][0]
            out = self._emit("response.output_text.done",
                             {"item_id": item_id, "output_index": idx, "content_index": 0,
                              "text": text, "logprobs": []})
            out += self._emit("response.content_part.done",
                              {"item_id": item_id, "output_index": idx, "content_index": 0,
                               "part": part})
        else:
            t = o["tool"]
            arguments = "".join(t["args"])
            # a call the output budget cut is closed as incomplete, never as a call to run
            status = "incomplete" if cut and not arguments_complete(arguments) else "completed"
            custom = t["name"] in self.custom
            item = call_item(item_id, t["call_id"], t["name"], arguments, status, custom)
            if custom:  # its input goes out whole: JSON fragments are not pieces of it
                out = self._emit("response.custom_tool_call_input.delta",
                                 {"item_id": item_id, "output_index": idx, "delta": item["input"]})
                out += self._emit("response.custom_tool_call_input.done",
                                  {"item_id": item_id, "output_index": idx, "input": item["input"]})
            else:
                out = self._emit("response.function_call_arguments.done",
                                 {"item_id": item_id, "output_index": idx, "name": t["name"],
                                  "arguments": arguments})
        self.output[idx] = item
        return out + self._emit("response.output_item.done", {"output_index": idx, "item": item})

    def _event(self, ev: Event) -> bytes:
        out = b""
        o = self.open
        if ev.kind == "reasoning":
            if o is None or o["kind"] != "reasoning":
                out += self._close()
                idx = self._new_index()
                item_id = f"rs_{self.base}_{idx}"
                self.open = o = {"kind": "reasoning", "index": idx, "id": item_id, "text": []}
                out += self._emit("response.output_item.added",
                                  {"output_index": idx, "item": reasoning_item(item_id, None)})
                out += self._emit("response.reasoning_summary_part.added",
                                  {"item_id": item_id, "output_index": idx, "summary_index": 0,
                                   "part": {"type": "summary_text", "text": ""}})
            o["text"].append(ev.text)
            return out + self._emit("response.reasoning_summary_text.delta",
                                    {"item_id": o["id"], "output_index": o["index"],
                                     "summary_index": 0, "delta": ev.text})
        if ev.kind == "text":
            if o is None or o["kind"] != "message":
                out += self._close()
                idx = self._new_index()
                item_id = f"msg_{self.base}_{idx}"
                self.open = o = {"kind": "message", "index": idx, "id": item_id, "text": []}
                out += self._emit("response.output_item.added",
                                  {"output_index": idx,
                                   "item": message_item(item_id, "", "in_progress")})
                out += self._emit("response.content_part.added",
                                  {"item_id": item_id, "output_index": idx, "content_index": 0,
                                   "part": {"type": "output_text", "text": "",
                                            "annotations": [], "logprobs": []}})
            o["text"].append(ev.text)
            return out + self._emit("response.output_text.delta",
                                    {"item_id": o["id"], "output_index": o["index"],
                                     "content_index": 0, "delta": ev.text, "logprobs": []})
        if ev.kind == "tool_start":
            out += self._close()
            idx = self._new_index()
            item_id = f"fc_{self.base}_{idx}"
            t = {"call_id": ev.call_id, "name": ev.name, "args": [], "index": idx, "id": item_id}
            self.tools[ev.index] = t
            self.open = {"kind": "function_call", "index": idx, "id": item_id, "tool": t}
            return out + self._emit(
                "response.output_item.added",
                {"output_index": idx,
                 "item": call_item(item_id, ev.call_id, ev.name, "", "in_progress",
                                   ev.name in self.custom)})
        t = self.tools[ev.index]  # tool_args
        t["args"].append(ev.text)
        custom = t["name"] in self.custom
        if self.output[t["index"]] is not None:  # fragment after its item closed: keep it
            key, value = ("input", custom_input("".join(t["args"]))) if custom else ("arguments", "".join(t["args"]))
            self.output[t["index"]][key] = value
        if custom:
            return b""
        return self._emit("response.function_call_arguments.delta",
                          {"item_id": t["id"], "output_index": t["index"], "delta": ev.text})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        events = list(self.reader.feed(chunk))
        return self._start() + b"".join(self._event(ev) for ev in events)

    def finish(self) -> bytes:
        out = self._start() + b"".join(self._event(ev) for ev in self.reader.flush())
        status = "incomplete" if self.reader.finish_reason == "length" else "completed"
        out += self._close(cut=status == "incomplete")
        usage = usage_object(self.reader.prompt_tokens, self.reader.completion_tokens, self.reader.usage)
        # Always ``response.completed`` (an incomplete answer says so in its status and
        # incomplete_details): Codex treats a ``response.incomplete`` event as a failed stream and
        # retries the same prompt, and the openai SDK's stream helper requires the completed event.
        return out + self._emit("response.completed", {"response": self._snapshot(status, usage)})

    def fail(self, kind: str, message: str) -> bytes:
        out = self._start()
        snap = self._snapshot("failed")
        code = openai_error(500, kind, message)[1]["error"]
        snap["error"] = {"code": code["code"] or code["type"], "message": code["message"]}
        return out + self._emit("response.failed", {"response": snap})
