"""OpenAI Responses (``/v1/responses``, also ``/responses``) <-> chat. Codex's only wire API.

Input items become chat messages: ``instructions`` and leading system/developer items form the
system message; the reasoning / message / function_call items of one model turn are merged back
into one assistant message (``reasoning``, ``content``, ``tool_calls``), exactly the shape our own
answer had, so re-rendering a history reproduces the sampled turn; ``function_call_output`` items
become tool messages. Only ``function`` tools reach the engine (``namespace`` tools are flattened
into their function tools); hosted tool kinds are dropped and counted.

Answers: a ``response`` object with reasoning (summary_text), message (output_text) and
function_call items; streams are the Responses event sequence with ``sequence_number`` on every
event, ending in ``response.completed`` with the full response (also when the answer hit
max_output_tokens: then its status is ``incomplete``, see ``ResponsesStream.finish``). The answer
objects and the stream translator are in ``openai_responses_answer``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from polar_core.compaction import COMPACT_ITEM_MARKER, COMPACT_REQUEST, COMPACT_SUMMARY_PREFIX

from . import media
from .base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .common import (
    PART_SEPARATOR,
    SYSTEM_SEPARATOR,
    Notes,
    arguments_complete,
    base_id,
    dump_arguments,
    iter_text_parts,
    path_only,
    read_answer,
    require_dict,
    require_list,
    require_str,
)
from .openai_chat import openai_error
from .openai_responses_answer import (
    ResponsesStream,
    call_item,
    message_item,
    reasoning_item,
    response_object,
    usage_object,
)

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url")
IGNORED_FIELDS = (
    "store",
    "include",
    "prompt_cache_key",
    "prompt_cache_retention",
    "metadata",
    "user",
    "service_tier",
    "truncation",
    "background",
    "safety_identifier",
    "stream_options",
    "client_metadata",
    "top_logprobs",
    "max_tool_calls",
)
HANDLED_FIELDS = (
    "model", "input", "instructions", "stream", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "reasoning", "text",
    "previous_response_id", "conversation",
)
DROPPED_ITEMS = (
    "web_search_call", "file_search_call", "computer_call", "computer_call_output",
    "image_generation_call", "code_interpreter_call", "mcp_call", "mcp_list_tools",
    "mcp_approval_request", "mcp_approval_response", "tool_search_call",
    "tool_search_output",
)


COMPACT_PATH = "/responses/compact"


def _parts_text(content: Any, where: str, keep_media: bool = False) -> Any:
    """Text of parts joined with ``"\n"``; with ``keep_media`` a part array when images or files
    are among them (user turns and tool outputs; settled by the core, see ``media``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[Any] = []
    for part in require_list(content, where):
        if isinstance(part, dict) and part.get("type") == "refusal":
            texts.append(require_str(part.get("refusal"), f"{where} refusal"))
        else:
            texts.extend(iter_text_parts([part], text_types=TEXT_PARTS, media_types=MEDIA_PARTS,
                                         where=where))
    joined = media.join(texts, PART_SEPARATOR)
    return joined if keep_media else media.as_text(joined)


def _tool_output_text(output: Any, where: str) -> Any:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _parts_text(output, where, keep_media=True)
    raise ProviderError(f"{where}: output must be a string or an array of parts")


class _Builder:
    """Accumulates chat messages; one open assistant message collects a model turn's items."""

    def __init__(self, notes: Notes):
        self.notes = notes
        self.system: list[str] = []
        self.messages: list[dict[str, Any]] = []
        self.assistant: dict[str, Any] | None = None

    def close(self) -> None:
        self.assistant = None

    def _assistant(self, fresh_if: tuple[str, ...]) -> dict[str, Any]:
        a = self.assistant
        if a is None or any(a.get(k) for k in fresh_if):
            a = {"role": "assistant", "content": ""}
            self.messages.append(a)
            self.assistant = a
        return a

    def system_text(self, text: str, role: str) -> None:
        self.close()
        if role == "developer":
            self.notes.add("developer role mapped to system")
        if self.messages:
            self.messages.append({"role": "system", "content": text})
            self.notes.add("kept inline system message in place")
        else:
            self.system.append(text)

    def user(self, text: str) -> None:
        self.close()
        self.messages.append({"role": "user", "content": text})

    def assistant_text(self, text: str) -> None:
        a = self._assistant(("content", "tool_calls"))
        a["content"] = text

    def reasoning(self, text: str) -> None:
        a = self._assistant(("content", "tool_calls", "reasoning"))
        # keep key order role, content, reasoning, tool_calls for a deterministic request
        a["reasoning"] = text

    def tool_call(self, call_id: str, name: str, arguments: str) -> None:
        a = self._assistant(())
        a.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        )

    def tool_output(self, call_id: str, text: str) -> None:
        self.close()
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def result(self) -> list[dict[str, Any]]:
        out = list(self.messages)
        if self.system:
            out.insert(0, {"role": "system", "content": SYSTEM_SEPARATOR.join(self.system)})
        return out


def _input_items(items: list[Any], b: _Builder) -> None:
    notes = b.notes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        item = require_dict(item, where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _parts_text(item.get("content"), where, keep_media=role == "user")
            if role in ("system", "developer"):
                b.system_text(text, role)
            elif role == "user":
                b.user(text)
            elif role == "assistant":
                b.assistant_text(text)
            else:
                raise ProviderError(f"{where}: unknown role {role!r}")
        elif kind == "reasoning":
            texts = [_parts_text(item.get("content"), where)] if item.get("content") else []
            if not texts:
                texts = [_parts_text([s], where) for s in item.get("summary") or []]
            text = SYSTEM_SEPARATOR.join(t for t in texts if t)
            if text:
                b.reasoning(text)
            else:
                notes.add("reasoning item without readable text dropped")
            if item.get("encrypted_content"):
                notes.add("ignored reasoning encrypted_content")
        elif kind == "function_call":
            arguments = item.get("arguments")
            b.tool_call(require_str(item.get("call_id"), f"{where}.call_id"),
                        require_str(item.get("name"), f"{where}.name"),
                        arguments if isinstance(arguments, str) else dump_arguments(arguments))
        elif kind == "function_call_output":
            b.tool_output(require_str(item.get("call_id"), f"{where}.call_id"),
                          _tool_output_text(item.get("output"), where))
        elif kind == "custom_tool_call":
            b.tool_call(require_str(item.get("call_id"), f"{where}.call_id"),
                        require_str(item.get("name"), f"{where}.name"),
                        dump_arguments({"input": item.get("input", "")}))
            notes.add("custom_tool_call rendered as a function call with {input}")
        elif kind == "custom_tool_call_output":
            b.tool_output(require_str(item.get("call_id"), f"{where}.call_id"),
                          _tool_output_text(item.get("output"), where))
        elif kind == "local_shell_call":
            call_id = item.get("call_id") or item.get("id")
            b.tool_call(require_str(call_id, f"{where}.call_id"), "local_shell",
                        dump_arguments(item.get("action") or {}))
            notes.add("local_shell_call rendered as a local_shell function call")
        elif kind == "local_shell_call_output":
            call_id = item.get("call_id") or item.get("id")
            b.tool_output(require_str(call_id, f"{where}.call_id"),
                          _tool_output_text(item.get("output"), where))
        elif kind in ("compaction", "compaction_summary"):
            # Codex's remote compaction: the summary our /responses/compact answer carried
            content = item.get("encrypted_content")
            if isinstance(content, str) and content.startswith(COMPACT_ITEM_MARKER):
                b.user(COMPACT_SUMMARY_PREFIX + content[len(COMPACT_ITEM_MARKER):])
                notes.add("compaction: compaction item rendered as a summary user message")
            else:
                notes.add("compaction: dropped a compaction item another server encrypted")
        elif kind == "item_reference":
            raise ProviderError("item_reference needs stored responses, which the proxy does "
                                "not keep: send the items themselves", kind="unsupported")
        elif kind in DROPPED_ITEMS:
            notes.add(f"dropped input item {kind}")
        else:
            raise ProviderError(f"{where}: unknown input item type {kind!r}")


def _codex_request_kind(body: dict[str, Any]) -> str | None:
    """``request_kind`` of Codex's ``client_metadata["x-codex-turn-metadata"]`` (turn, compaction)."""
    meta = body.get("client_metadata")
    raw = meta.get("x-codex-turn-metadata") if isinstance(meta, dict) else None
    if not isinstance(raw, str):
        return None
    try:
        kind = json.loads(raw).get("request_kind")
    except (ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None


def _function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": require_str(tool.get("name"), "tool name")}
    if tool.get("description"):
        fn["description"] = tool["description"]
    params = tool.get("parameters")
    fn["parameters"] = params if isinstance(params, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _custom_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A freeform ``custom`` tool (Codex's ``apply_patch`` for some models) as a function with one
    string parameter ``input`` -- the shape ``custom_tool_call`` items take in the history."""
    fn: dict[str, Any] = {"name": require_str(tool.get("name"), "tool name")}
    description = tool.get("description") or ""
    fmt = tool.get("format") if isinstance(tool.get("format"), dict) else {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description += (f"\n\nThe input is free text in this {fmt.get('syntax') or ''} grammar:\n"
                        + fmt["definition"])
    if description:
        fn["description"] = description
    fn["parameters"] = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
    return {"type": "function", "function": fn}


def _tools(tools: list[Any], notes: Notes) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        tool = require_dict(tool, "tool")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool))
        elif kind == "custom":
            out.append(_custom_tool(tool))
            notes.add("custom tool sent as a function with one string parameter input")
        elif kind == "namespace":
            inner = [t for t in tool.get("tools") or [] if isinstance(t, dict)
                     and t.get("type", "function") == "function"]
            if inner:
                out.extend(_function_tool(t) for t in inner)
                notes.add(f"flattened namespace tool {tool.get('name')} ({len(inner)} functions)")
            else:
                notes.add("dropped tool kind namespace")
        else:
            notes.add(f"dropped tool kind {kind}")
    return out


def _tool_choice(choice: Any, tool_names: set[str], notes: Notes) -> Any:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ProviderError(f"unknown tool_choice {choice!r}")
        return choice
    choice = require_dict(choice, "tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = require_str(choice.get("name"), "tool_choice.name")
        if name in tool_names:
            return {"type": "function", "function": {"name": name}}
    elif kind == "allowed_tools":
        notes.add("allowed_tools tool_choice reduced to its mode")
        return "required" if choice.get("mode") == "required" else "auto"
    notes.add(f"tool_choice {kind} for a dropped tool replaced by auto")
    return "auto"


def _response_format(fmt: Any) -> dict[str, Any] | None:
    fmt = require_dict(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        for key in ("description", "strict"):
            if key in fmt:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}
    if kind == "json_object":
        return {"type": "json_object"}
    if kind in (None, "text"):
        return None
    raise ProviderError(f"unknown text.format type {kind!r}")


class OpenAIResponsesProvider(Provider):
    name = "openai_responses"

    def detect(self, method: str, path: str, headers: dict[str, str], body: Any) -> bool:
        p = path_only(path)
        return method.upper() == "POST" and (p.endswith("/responses") or p.endswith(COMPACT_PATH))

    def to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        body = require_dict(body)
        if path_only(path).endswith(COMPACT_PATH):
            return self._compact_to_chat(body, path, query)
        notes = Notes()
        model = require_str(body.get("model"), "model")
        for key in ("previous_response_id", "conversation"):
            if body.get(key):
                raise ProviderError(f"{key} needs stored responses, which the proxy does not "
                                    "keep: send the full input (store=false)", kind="unsupported")
        b = _Builder(notes)
        instructions = body.get("instructions")
        if instructions:
            b.system.append(_parts_text(instructions, "instructions"))
        raw_input = body.get("input")
        if isinstance(raw_input, str):
            b.user(raw_input)
        elif isinstance(raw_input, list):
            _input_items(raw_input, b)
        else:
            raise ProviderError("input must be a string or an array of items")
        messages = b.result()
        if not messages:
            raise ProviderError("input must not be empty")
        chat: dict[str, Any] = {"model": model, "messages": messages}
        if body.get("tools"):
            tools = _tools(require_list(body["tools"], "tools"), notes)
            if tools:
                chat["tools"] = tools
        if body.get("tool_choice") is not None and chat.get("tools"):
            names = {t["function"]["name"] for t in chat["tools"]}
            chat["tool_choice"] = _tool_choice(body["tool_choice"], names, notes)
        if body.get("parallel_tool_calls") is not None and chat.get("tools"):
            chat["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for key in ("temperature", "top_p"):
            if body.get(key) is not None:
                chat[key] = body[key]
        effort = None
        reasoning = body.get("reasoning")
        if reasoning is not None:
            effort = require_dict(reasoning, "reasoning").get("effort")
            if effort is not None:
                chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        text = body.get("text")
        if text is not None:
            text = require_dict(text, "text")
            if text.get("format") is not None:
                fmt = _response_format(text["format"])
                if fmt:
                    chat["response_format"] = fmt
            if "verbosity" in text:
                notes.add("ignored text.verbosity")
        if _codex_request_kind(body) == "compaction":  # Codex's own (local) compaction call
            notes.add("compaction: codex summary call (request_kind compaction)")
        for key in body:
            if key in IGNORED_FIELDS:
                notes.add(f"ignored field {key}")
            elif key not in HANDLED_FIELDS:
                notes.add(f"ignored unknown field {key}")
        stream = bool(body.get("stream"))
        chat["stream"] = stream
        options = {
            "max_output_tokens": body.get("max_output_tokens"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "reasoning_effort": effort,
            "custom_tools": sorted({t.get("name") for t in body.get("tools") or []
                                    if isinstance(t, dict) and t.get("type") == "custom"
                                    and isinstance(t.get("name"), str)}),
        }
        return NormalizedCall(chat_request=chat, stream=stream, requested_model=model,
                              notes=notes.render(), options=options)

    def _compact_to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        """Codex's ``POST /v1/responses/compact`` (``remote_compaction_v2``): the history, then a
        request for a handoff summary, as one normal (captured) call without tools."""
        plain = {k: v for k, v in body.items() if k not in ("tools", "tool_choice", "parallel_tool_calls",
                                                            "stream", "text")}
        call = self.to_chat(plain, path.replace(COMPACT_PATH, "/responses"), query)
        call.chat_request["messages"].append({"role": "user", "content": COMPACT_REQUEST})
        call.chat_request["stream"] = False
        call.stream = False
        call.notes.insert(0, "compaction: codex /responses/compact summary call")
        if body.get("tools"):
            call.notes.append("compaction: tools left out of the summary call")
        users = []
        for item in body.get("input") or []:
            if isinstance(item, dict) and (item.get("type") or "message") == "message" and item.get("role") == "user":
                users.append({"type": "message", "role": "user", "content": item.get("content")})
        call.options["compact"] = {"user_items": users}
        return call

    def _compact_answer(self, answer: Any, requested_model: str, users: list[dict[str, Any]]) -> dict[str, Any]:
        """A ``response.compaction`` object: the user's own messages, then one ``compaction`` item
        whose ``encrypted_content`` is the summary (plain text after our marker: only this proxy
        reads it back)."""
        b = base_id(answer.id)
        output = [{"id": f"msg_{b}_{i}", "status": "completed", **u} for i, u in enumerate(users)]
        output.append({"id": f"cmp_{b}", "type": "compaction",
                       "encrypted_content": COMPACT_ITEM_MARKER + answer.content.strip()})
        usage = answer.usage
        return {"id": f"resp_{b}", "object": "response.compaction", "created_at": answer.created or int(time.time()),
                "output": output,
                "usage": usage_object(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0, usage)}

    def from_chat(self, response: dict[str, Any], requested_model: str,
                  call: NormalizedCall | None = None) -> dict[str, Any]:
        answer = read_answer(response)
        if call is not None and call.options.get("compact") is not None:
            return self._compact_answer(answer, requested_model, call.options["compact"]["user_items"])
        b = base_id(answer.id)
        output: list[dict[str, Any]] = []
        if answer.reasoning:
            output.append(reasoning_item(f"rs_{b}", answer.reasoning))
        if answer.content:
            output.append(message_item(f"msg_{b}", answer.content))
        status = "incomplete" if answer.finish_reason == "length" else "completed"
        custom = set((call.options.get("custom_tools") if call else None) or ())
        for i, tc in enumerate(answer.tool_calls):
            cut = status == "incomplete" and not arguments_complete(tc.arguments)
            output.append(call_item(f"fc_{b}_{i}", tc.id, tc.name, tc.arguments,
                                    "incomplete" if cut else "completed", tc.name in custom))
        usage = answer.usage
        return response_object(
            f"resp_{b}", requested_model, answer.created or int(time.time()), status, output,
            usage_object(usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0, usage),
            call.options if call else {},
        )

    def new_stream(self, requested_model: str,
                   call: NormalizedCall | None = None) -> StreamTranslator:
        return ResponsesStream(requested_model, call.options if call else {})

    def error_response(self, status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        return openai_error(status, kind, message)
