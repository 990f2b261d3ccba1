"""Anthropic Messages (``POST /v1/messages``, Claude Code adds ``?beta=true``) <-> chat.

Claude Code specifics handled here: the per-request ``x-anthropic-billing-header:`` first system
block (it changes on every call and would break prefix merging) is stripped; ``role:"system"``
messages inside ``messages`` (Claude Code without ``--bare``) that come before the conversation
are merged into the system prompt, later ones stay where they are as chat system messages
(merging them would change the system prompt mid-session and break every later prefix);
server tools are dropped and counted; ``defer_loading`` tools reach the engine once a
``tool_reference`` in the history (ToolSearch's answer) names them (the tool-search contract), and
are dropped (counted) until then.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import media
from .base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .common import (
    PART_SEPARATOR,
    SYSTEM_SEPARATOR,
    ChunkReader,
    Event,
    Notes,
    arguments_complete,
    base_id,
    cached_tokens,
    context_overflow_numbers,
    dump_arguments,
    iter_text_parts,
    load_arguments,
    path_only,
    read_answer,
    refuse_media,
    require_dict,
    require_list,
    require_str,
    sse,
)

BILLING_PREFIX = "x-anthropic-billing-header:"
#: How a tool_result with ``is_error: true`` reaches the model.
TOOL_ERROR_PREFIX = "Error: "
MEDIA_BLOCKS = ("image", "document", "container_upload")
#: Top-level request fields that do not reach the engine (metadata is dropped without a note).
IGNORED_FIELDS = (
    "context_management",
    "output_config",
    "service_tier",
    "container",
    "mcp_servers",
    "cache_control",
    "inference_geo",
)


def _strip_billing(text: str, notes: Notes) -> str | None:
    """Drop the billing-header line; keep anything after it. None when nothing is left."""
    if not text.startswith(BILLING_PREFIX):
        return text
    notes.add("stripped x-anthropic-billing-header system block")
    rest = text.partition("\n")[2]
    return rest or None


def _system_text(value: Any, notes: Notes, where: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return _strip_billing(value, notes)
    texts = []
    for block in require_list(value, where):
        block = require_dict(block, f"{where} block")
        if block.get("type", "text") != "text":
            if block.get("type") in MEDIA_BLOCKS:
                raise refuse_media(f"{where}: {block.get('type')}")
            raise ProviderError(f"{where}: unsupported block type {block.get('type')!r}")
        text = _strip_billing(require_str(block.get("text"), f"{where} text"), notes)
        if text is not None:
            texts.append(text)
    return PART_SEPARATOR.join(texts) if texts else None


def _tool_result_text(block: dict[str, Any], notes: Notes) -> Any:
    content = block.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[Any] = []
    for part in require_list(content, "tool_result content"):
        part = require_dict(part, "tool_result content block")
        kind = part.get("type")
        if kind == "text":
            texts.append(require_str(part.get("text"), "tool_result text"))
        elif kind in ("image", "document"):
            texts.append(media.anthropic_media(part))  # e.g. Claude Code's Read of a PNG
        elif kind in MEDIA_BLOCKS:
            raise refuse_media(f"tool_result: {kind}")
        elif kind == "tool_reference":
            # Claude Code's tool search answers with references to deferred tools.
            texts.append(str(part.get("tool_name", "")))
            notes.add("tool_reference block rendered as its tool name")
        else:
            raise ProviderError(f"tool_result: unsupported block type {kind!r}")
    return media.join(texts, PART_SEPARATOR)


def _user_messages(content: Any, index: int, notes: Notes) -> list[dict[str, Any]]:
    """One Anthropic user turn -> tool messages (in order) then a user message with the text."""
    where = f"messages[{index}]"
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools: list[dict[str, Any]] = []
    texts: list[Any] = []
    for block in require_list(content, f"{where}.content"):
        block = require_dict(block, f"{where} block")
        kind = block.get("type")
        if kind == "text":
            texts.append(require_str(block.get("text"), f"{where} text"))
        elif kind == "tool_result":
            if texts:
                notes.add("user text before tool_result moved after the tool results")
            text = _tool_result_text(block, notes)
            if block.get("is_error"):
                # chat has no error flag: the model reads it as the result's first word
                if isinstance(text, str):
                    text = TOOL_ERROR_PREFIX + text
                else:
                    text = [{"type": "text", "text": TOOL_ERROR_PREFIX}, *text]
                notes.add("tool_result is_error rendered as an error prefix")
            tools.append(
                {
                    "role": "tool",
                    "tool_call_id": require_str(block.get("tool_use_id"), "tool_use_id"),
                    "content": text,
                }
            )
        elif kind in ("image", "document"):
            texts.append(media.anthropic_media(block))
        elif kind in MEDIA_BLOCKS:
            raise refuse_media(f"{where}: {kind}")
        elif kind == "search_result":
            texts.extend(iter_text_parts(block.get("content") or [], text_types=("text",),
                                         media_types=MEDIA_BLOCKS, where=f"{where} search_result"))
            notes.add("search_result block flattened to text")
        else:
            raise ProviderError(f"{where}: unsupported user block type {kind!r}")
    out = tools
    if texts or not tools:
        out.append({"role": "user", "content": media.join(texts, PART_SEPARATOR)})
    return out


def _assistant_message(content: Any, index: int, notes: Notes) -> dict[str, Any]:
    where = f"messages[{index}]"
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in require_list(content, f"{where}.content"):
        block = require_dict(block, f"{where} block")
        kind = block.get("type")
        if kind == "text":
            texts.append(require_str(block.get("text"), f"{where} text"))
        elif kind == "thinking":
            reasoning.append(require_str(block.get("thinking"), f"{where} thinking"))
        elif kind == "redacted_thinking":
            notes.add("dropped redacted_thinking block")
        elif kind == "tool_use":
            tool_input = block.get("input", {})
            calls.append(
                {
                    "id": require_str(block.get("id"), f"{where} tool_use id"),
                    "type": "function",
                    "function": {
                        "name": require_str(block.get("name"), f"{where} tool_use name"),
                        "arguments": dump_arguments(tool_input),
                    },
                }
            )
        elif kind in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                      "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result"):
            notes.add(f"dropped assistant block {kind}")
        elif kind in MEDIA_BLOCKS:
            raise refuse_media(f"{where}: {kind}")
        else:
            raise ProviderError(f"{where}: unsupported assistant block type {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": PART_SEPARATOR.join(texts)}
    if reasoning:
        message["reasoning"] = PART_SEPARATOR.join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def referenced_tools(raw_messages: list[Any]) -> set[str]:
    """Names of the tools that ``tool_reference`` blocks in the history point to (Claude Code's
    ToolSearch answers with them: from then on the tool's schema is part of the model's tools)."""
    names: set[str] = set()
    for msg in raw_messages:
        if not isinstance(msg, dict) or msg.get("role") != "user" or not isinstance(msg.get("content"), list):
            continue
        for block in msg["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_result" and isinstance(block.get("content"), list):
                for part in block["content"]:
                    if isinstance(part, dict) and part.get("type") == "tool_reference" \
                            and isinstance(part.get("tool_name"), str):
                        names.add(part["tool_name"])
    return names


def _tools(tools: Any, notes: Notes, referenced: set[str] = frozenset()) -> list[dict[str, Any]]:
    out = []
    for tool in require_list(tools, "tools"):
        tool = require_dict(tool, "tool")
        kind = tool.get("type")
        if tool.get("defer_loading"):
            if tool.get("name") not in referenced:
                notes.add("dropped defer_loading tool")
                continue
            notes.add("deferred tool loaded (referenced by a tool_reference)")
        if kind not in (None, "custom"):
            notes.add(f"dropped tool kind {kind}")
            continue
        fn: dict[str, Any] = {"name": require_str(tool.get("name"), "tool name")}
        if tool.get("description"):
            fn["description"] = tool["description"]
        schema = tool.get("input_schema")
        fn["parameters"] = schema if isinstance(schema, dict) else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """Anthropic tool_choice -> (chat tool_choice, parallel_tool_calls or None)."""
    choice = require_dict(choice, "tool_choice")
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = require_str(choice.get("name"), "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    raise ProviderError(f"unknown tool_choice type {kind!r}")


def stop_reason_of(finish: str | None, stop_reason: Any, has_tools: bool,
                   stop_sequences: list[str]) -> tuple[str, str | None]:
    """chat finish_reason -> (Anthropic stop_reason, stop_sequence). A budget that ended the
    answer wins over tool calls: a call cut mid-way is not one to run."""
    if finish == "length":
        return "max_tokens", None
    if has_tools or finish == "tool_calls":
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _signature(thinking: str) -> str:
    """A stable stand-in signature (Claude Code sends thinking blocks back with it)."""
    return "polar-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _usage(prompt: int, completion: int, usage: dict[str, Any]) -> dict[str, int]:
    cached = min(cached_tokens(usage), prompt)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }


_ERROR_TYPES = {
    "invalid_request": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "context_length": (400, "invalid_request_error"),
    "not_found": (404, "not_found_error"),
    "permission": (403, "permission_error"),
    "rate_limited": (429, "rate_limit_error"),
    "overloaded": (529, "overloaded_error"),  # what the real API (and Claude Code's retry) uses
    "timeout": (None, "timeout_error"),
    "upstream_refused": (None, "api_error"),
    "upstream_error": (None, "api_error"),
}


def _error_body(kind: str, message: str) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(kind, (None, "api_error"))[1]
    if kind == "context_length" and not message.startswith("prompt is too long"):
        numbers = context_overflow_numbers(message)
        if numbers:  # the form Claude Code parses to decide how much to compact
            message = f"prompt is too long: {numbers[0]} tokens > {numbers[1]} maximum"
        else:
            message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": error_type, "message": message}}


class AnthropicProvider(Provider):
    name = "anthropic"

    def detect(self, method: str, path: str, headers: dict[str, str], body: Any) -> bool:
        p = path_only(path)
        return method.upper() == "POST" and (
            p.endswith("/v1/messages") or p.endswith("/v1/messages/count_tokens")
        )

    def side_call(self, method: str, path: str) -> str | None:
        return "count_tokens" if path_only(path).endswith("/messages/count_tokens") else None

    def count_tokens_answer(self, input_tokens: int) -> dict[str, Any]:
        """The body of a ``/v1/messages/count_tokens`` answer (the core counts the tokens of
        ``to_chat(...).chat_request`` with the served model's tokenizer)."""
        return {"input_tokens": input_tokens}

    def to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        body = require_dict(body)
        notes = Notes()
        model = require_str(body.get("model"), "model")
        raw_messages = require_list(body.get("messages"), "messages")
        system_parts = []
        top_system = _system_text(body.get("system"), notes, "system")
        if top_system is not None:
            system_parts.append(top_system)
        messages: list[dict[str, Any]] = []
        for i, msg in enumerate(raw_messages):
            msg = require_dict(msg, f"messages[{i}]")
            role = msg.get("role")
            if "content" not in msg:
                raise ProviderError(f"messages[{i}]: content is required")
            if role == "system":
                text = _system_text(msg["content"], notes, f"messages[{i}]")
                if text is None:
                    continue
                if not messages:
                    system_parts.append(text)
                    notes.add("merged system message from messages into the system prompt")
                else:
                    messages.append({"role": "system", "content": text})
                    notes.add("kept inline system message in place")
            elif role == "user":
                messages.extend(_user_messages(msg["content"], i, notes))
            elif role == "assistant":
                messages.append(_assistant_message(msg["content"], i, notes))
            else:
                raise ProviderError(f"messages[{i}]: unknown role {role!r}")
        if system_parts:
            messages.insert(0, {"role": "system", "content": SYSTEM_SEPARATOR.join(system_parts)})

        chat: dict[str, Any] = {"model": model, "messages": messages}
        if messages and messages[-1]["role"] == "assistant":
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
            notes.add("assistant prefill continued")
        if body.get("tools") is not None:
            tools = _tools(body["tools"], notes, referenced_tools(raw_messages))
            if tools:
                chat["tools"] = tools
        if body.get("tool_choice") is not None and chat.get("tools"):
            chat["tool_choice"], parallel = _tool_choice(body["tool_choice"])
            if parallel is not None:
                chat["parallel_tool_calls"] = parallel
        is_count = self.side_call("POST", path) == "count_tokens"
        if "max_tokens" in body:
            if not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1:
                raise ProviderError("max_tokens must be a positive integer")
            chat["max_tokens"] = body["max_tokens"]
        elif not is_count:
            raise ProviderError("max_tokens: field required")
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
            if body.get(src) is not None:
                chat[dst] = body[src]
        stops = body.get("stop_sequences") or []
        if stops:
            chat["stop"] = list(require_list(stops, "stop_sequences"))
        thinking = body.get("thinking")
        if thinking is not None:
            kind = require_dict(thinking, "thinking").get("type")
            if kind not in ("enabled", "adaptive", "disabled"):
                raise ProviderError(f"unknown thinking type {kind!r}")
            chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        elif not is_count:
            # The Messages API thinks only when asked; a template's default (Qwen3: on) must
            # not decide for the harness.
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        for key in IGNORED_FIELDS:
            if key in body:
                notes.add(f"ignored field {key}")
        stream = bool(body.get("stream"))
        chat["stream"] = stream
        return NormalizedCall(
            chat_request=chat,
            stream=stream,
            requested_model=model,
            notes=notes.render(),
            options={"stop_sequences": list(stops)},
        )

    def from_chat(self, response: dict[str, Any], requested_model: str,
                  call: NormalizedCall | None = None) -> dict[str, Any]:
        answer = read_answer(response)
        stops = (call.options.get("stop_sequences") if call else None) or []
        content: list[dict[str, Any]] = []
        if answer.reasoning:
            content.append({"type": "thinking", "thinking": answer.reasoning,
                            "signature": _signature(answer.reasoning)})
        if answer.content:
            content.append({"type": "text", "text": answer.content})
        for tc in answer.tool_calls:
            if answer.finish_reason == "length" and not arguments_complete(tc.arguments):
                continue  # cut by max_tokens: the real API's answer ends before a whole call
            content.append({"type": "tool_use", "id": tc.id, "name": tc.name,
                            "input": load_arguments(tc.arguments)})
        stop_reason, stop_sequence = stop_reason_of(
            answer.finish_reason, answer.stop_reason, bool(answer.tool_calls), stops)
        usage = answer.usage
        return {
            "id": "msg_" + base_id(answer.id),
            "type": "message",
            "role": "assistant",
            "model": requested_model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0,
                            usage),
        }

    def new_stream(self, requested_model: str,
                   call: NormalizedCall | None = None) -> StreamTranslator:
        stops = (call.options.get("stop_sequences") if call else None) or []
        return AnthropicStream(requested_model, stops)

    def error_response(self, status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        fixed = _ERROR_TYPES.get(kind, (None, "api_error"))[0]
        return fixed or status, _error_body(kind, message)


class AnthropicStream(StreamTranslator):
    """chat chunks -> ``message_start``, content blocks (thinking / text / tool_use), ``message_delta``,
    ``message_stop``. Blocks are opened lazily and closed when another kind starts."""

    def __init__(self, requested_model: str, stop_sequences: list[str]):
        self.model = requested_model
        self.stops = stop_sequences
        self.reader = ChunkReader()
        self.started = False
        self.next_index = 0
        self.open: tuple[str, int] | None = None  # (kind, block index)
        self.thinking_text: list[str] = []
        self.tool_blocks: dict[int, int] = {}  # chat tool index -> block index
        self.has_tools = False

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        message = {
            "id": "msg_" + base_id(self.reader.id),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.reader.prompt_tokens, 0, self.reader.usage),
        }
        return (sse({"type": "message_start", "message": message}, "message_start")
                + sse({"type": "ping"}, "ping"))

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        kind, index = self.open
        self.open = None
        out = b""
        if kind == "thinking":
            signature = _signature("".join(self.thinking_text))
            self.thinking_text = []
            out += sse({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": signature}},
                       "content_block_delta")
        return out + sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    def _open(self, kind: str, block: dict[str, Any]) -> tuple[bytes, int]:
        out = self._close()
        index = self.next_index
        self.next_index += 1
        self.open = (kind, index)
        out += sse({"type": "content_block_start", "index": index, "content_block": block},
                   "content_block_start")
        return out, index

    def _event(self, ev: Event) -> bytes:
        out = b""
        if ev.kind == "reasoning":
            if self.open is None or self.open[0] != "thinking":
                out, _ = self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking_text.append(ev.text)
            return out + sse({"type": "content_block_delta", "index": self.open[1],
                              "delta": {"type": "thinking_delta", "thinking": ev.text}},
                             "content_block_delta")
        if ev.kind == "text":
            if self.open is None or self.open[0] != "text":
                out, _ = self._open("text", {"type": "text", "text": ""})
            return out + sse({"type": "content_block_delta", "index": self.open[1],
                              "delta": {"type": "text_delta", "text": ev.text}},
                             "content_block_delta")
        if ev.kind == "tool_start":
            self.has_tools = True
            out, index = self._open(
                "tool_use", {"type": "tool_use", "id": ev.call_id, "name": ev.name, "input": {}})
            self.tool_blocks[ev.index] = index
            return out
        # tool_args: addressed by block index, even if a later block already started
        return sse({"type": "content_block_delta", "index": self.tool_blocks[ev.index],
                    "delta": {"type": "input_json_delta", "partial_json": ev.text}},
                   "content_block_delta")

    def feed(self, chunk: dict[str, Any]) -> bytes:
        events = list(self.reader.feed(chunk))
        return self._start() + b"".join(self._event(ev) for ev in events)

    def finish(self) -> bytes:
        out = self._start() + b"".join(self._event(ev) for ev in self.reader.flush())
        out += self._close()
        stop_reason, stop_sequence = stop_reason_of(
            self.reader.finish_reason, self.reader.stop_reason, self.has_tools, self.stops)
        usage = _usage(self.reader.prompt_tokens, self.reader.completion_tokens, self.reader.usage)
        out += sse({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage}, "message_delta")
        return out + sse({"type": "message_stop"}, "message_stop")

    def fail(self, kind: str, message: str) -> bytes:
        return sse(_error_body(kind, message), "error")
