"""Google Gemini ``generateContent`` / ``streamGenerateContent?alt=sse`` <-> chat.

The model name comes from the path (``/v1beta/models/{model}:method``, also ``/v1/``). Google's
history may carry function calls without ids (Pi) and responses matched only by name: ids are
then generated from the position of the call (``call_<content>_<part>``), so re-rendering the same
history gives the same request, and each ``functionResponse`` is paired with the call of the same
id, else the oldest unanswered call of the same name. ``thoughtSignature`` is ignored (counted).
Model-turn text parts are joined with ``""``: they are pieces of one generation (a harness may
store our streamed chunks as separate parts); user-side parts are joined with ``"\\n"``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from polar_proxy import jsonutil

from . import media
from .base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .common import (
    PART_SEPARATOR,
    ChunkReader,
    Notes,
    arguments_complete,
    base_id,
    cached_tokens,
    context_overflow_numbers,
    dump_arguments,
    load_arguments,
    path_only,
    read_answer,
    refuse_media,
    require_dict,
    require_list,
    require_str,
)

PATH_RE = re.compile(r"/models/(?P<model>[^/:]+):(?P<method>generateContent|streamGenerateContent|countTokens)$")
MEDIA_KEYS = ("inlineData", "fileData")
DROPPED_PART_KEYS = ("executableCode", "codeExecutionResult")
IGNORED_FIELDS = ("safetySettings", "labels", "store")
#: A functionResponse.response with only one of these keys (a string) reaches the model as that
#: plain string; anything else (errors, structured results) as its JSON.
PLAIN_RESPONSE_KEYS = ("output", "result", "content")


def parse_path(path: str) -> tuple[str, str] | None:
    m = PATH_RE.search(path_only(path))
    return (m.group("model"), m.group("method")) if m else None


def _lower_types(schema: Any) -> Any:
    """Gemini ``parameters`` (OpenAPI subset) may spell types in upper case; JSON Schema wants
    lower case. Applied to ``parametersJsonSchema`` and ``responseJsonSchema`` too (Gemini CLI
    sends upper-case types there as well); lower-case types pass unchanged."""
    if isinstance(schema, list):
        return [_lower_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "type" and isinstance(value, list):
            out[key] = [v.lower() if isinstance(v, str) else v for v in value]
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _lower_types(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "additionalProperties", "not"):
            out[key] = _lower_types(value)
        else:
            out[key] = value
    return out


def _response_text(response: Any) -> str:
    if isinstance(response, dict) and len(response) == 1:
        (key, value), = response.items()
        if key in PLAIN_RESPONSE_KEYS and isinstance(value, str):
            return value
    if isinstance(response, str):
        return response
    return json.dumps(response, ensure_ascii=False)


def _parts(content: Any, where: str) -> list[dict[str, Any]]:
    content = require_dict(content, where)
    return [require_dict(p, f"{where} part") for p in require_list(content.get("parts") or [],
                                                                    f"{where}.parts")]


def _system_text(value: Any, notes: Notes) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    texts = []
    for part in _parts(value, "systemInstruction"):
        if any(k in part for k in MEDIA_KEYS):
            raise refuse_media("systemInstruction: inlineData")
        if isinstance(part.get("text"), str):
            texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


class _History:
    """contents -> chat messages, pairing function responses with calls."""

    def __init__(self, notes: Notes):
        self.notes = notes
        self.messages: list[dict[str, Any]] = []
        self.unanswered: list[tuple[str, str]] = []  # (id, name) in call order

    def model_turn(self, ci: int, parts: list[dict[str, Any]]) -> None:
        texts, thoughts, calls = [], [], []
        for pi, part in enumerate(parts):
            if "thoughtSignature" in part:
                self.notes.add("ignored thoughtSignature")
            if "functionCall" in part:
                fc = require_dict(part["functionCall"], f"contents[{ci}] functionCall")
                call_id = fc.get("id") or f"call_{ci}_{pi}"
                name = require_str(fc.get("name"), f"contents[{ci}] functionCall.name")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name,
                                           "arguments": dump_arguments(fc.get("args") or {})}})
                self.unanswered.append((call_id, name))
            elif isinstance(part.get("text"), str):
                (thoughts if part.get("thought") else texts).append(part["text"])
            elif any(k in part for k in MEDIA_KEYS):
                raise refuse_media(f"contents[{ci}]: inlineData")
            elif any(k in part for k in DROPPED_PART_KEYS):
                self.notes.add("dropped code-execution part")
            elif "thoughtSignature" not in part:
                raise ProviderError(f"contents[{ci}].parts[{pi}]: unsupported part {sorted(part)}")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            message["reasoning"] = "".join(thoughts)
        if calls:
            message["tool_calls"] = calls
        self.messages.append(message)

    def _match(self, response_id: Any, name: str, ci: int, pi: int) -> str:
        if isinstance(response_id, str) and response_id:
            for k, (call_id, _) in enumerate(self.unanswered):
                if call_id == response_id:
                    del self.unanswered[k]
                    return call_id
            self.notes.add("functionResponse id without a matching call")
            return response_id
        for k, (call_id, call_name) in enumerate(self.unanswered):
            if call_name == name:
                del self.unanswered[k]
                return call_id
        self.notes.add("functionResponse without a matching call")
        return f"call_{ci}_{pi}"

    def user_turn(self, ci: int, parts: list[dict[str, Any]]) -> None:
        texts: list[Any] = []
        for pi, part in enumerate(parts):
            if "functionResponse" in part:
                fr = require_dict(part["functionResponse"], f"contents[{ci}] functionResponse")
                name = require_str(fr.get("name"), f"contents[{ci}] functionResponse.name")
                content: list[Any] = [_response_text(fr.get("response", {}))]
                for inner in fr.get("parts") or []:  # multimodal function responses
                    if isinstance(inner, dict) and any(k in inner for k in MEDIA_KEYS):
                        content.append(media.google_media(inner))
                if texts:
                    self.notes.add("user text before functionResponse moved after the results")
                self.messages.append({"role": "tool",
                                      "tool_call_id": self._match(fr.get("id"), name, ci, pi),
                                      "content": media.join(content, PART_SEPARATOR)})
            elif isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif any(k in part for k in MEDIA_KEYS):
                # e.g. Gemini CLI's read_file of an image: an inlineData part in the user turn
                texts.append(media.google_media(part))
            elif "functionCall" in part:
                raise ProviderError(f"contents[{ci}]: functionCall in a user turn")
            else:
                raise ProviderError(f"contents[{ci}].parts[{pi}]: unsupported part {sorted(part)}")
        if texts or not parts:
            self.messages.append({"role": "user", "content": media.join(texts, PART_SEPARATOR)})


def _tools(tools: list[Any], notes: Notes) -> list[dict[str, Any]]:
    out = []
    for tool in tools:
        tool = require_dict(tool, "tool")
        for key, value in tool.items():
            if key != "functionDeclarations":
                notes.add(f"dropped tool kind {key}")
                continue
            for decl in require_list(value, "functionDeclarations"):
                decl = require_dict(decl, "functionDeclaration")
                fn: dict[str, Any] = {"name": require_str(decl.get("name"), "function name")}
                if decl.get("description"):
                    fn["description"] = decl["description"]
                if isinstance(decl.get("parametersJsonSchema"), dict):
                    fn["parameters"] = _lower_types(decl["parametersJsonSchema"])
                elif isinstance(decl.get("parameters"), dict):
                    fn["parameters"] = _lower_types(decl["parameters"])
                else:
                    fn["parameters"] = {"type": "object", "properties": {}}
                out.append({"type": "function", "function": fn})
    return out


def _tool_choice(config: Any, notes: Notes) -> Any:
    fcc = require_dict(require_dict(config, "toolConfig").get("functionCallingConfig") or {},
                       "functionCallingConfig")
    mode = (fcc.get("mode") or "AUTO").upper()
    names = fcc.get("allowedFunctionNames") or []
    if mode == "NONE":
        return "none"
    if mode == "ANY":
        if len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}
        if names:
            notes.add("allowedFunctionNames with several names reduced to required")
        return "required"
    if mode == "VALIDATED":
        notes.add("VALIDATED function calling mode treated as AUTO")
    return "auto"


def _generation_config(cfg: dict[str, Any], chat: dict[str, Any], notes: Notes) -> None:
    simple = {"temperature": "temperature", "topP": "top_p", "topK": "top_k",
              "maxOutputTokens": "max_tokens", "seed": "seed",
              "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty"}
    for src, dst in simple.items():
        if cfg.get(src) is not None:
            chat[dst] = cfg[src]
    if cfg.get("stopSequences"):
        chat["stop"] = list(require_list(cfg["stopSequences"], "stopSequences"))
    if cfg.get("candidateCount") not in (None, 1):
        raise ProviderError("candidateCount must be 1: one sample per call is captured",
                            kind="unsupported")
    thinking = cfg.get("thinkingConfig")
    if thinking is not None:
        thinking = require_dict(thinking, "thinkingConfig")
        budget = thinking.get("thinkingBudget")
        if budget is not None:
            chat["chat_template_kwargs"] = {"enable_thinking": budget != 0}
        elif thinking.get("thinkingLevel") or thinking.get("includeThoughts"):
            chat["chat_template_kwargs"] = {"enable_thinking": True}
    schema = cfg.get("responseJsonSchema") or cfg.get("responseSchema")
    if schema is not None:
        # Gemini CLI's router sends responseJsonSchema with OBJECT / STRING; JSON Schema (and
        # vLLM's guided decoding) wants lower case. Lower-case types pass unchanged.
        schema = _lower_types(schema)
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "response", "schema": schema}}
    elif cfg.get("responseMimeType") == "application/json":
        chat["response_format"] = {"type": "json_object"}
    for key in ("responseLogprobs", "logprobs", "mediaResolution", "speechConfig",
                "responseModalities"):
        if key in cfg:
            notes.add(f"ignored generationConfig.{key}")


FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS",
          "content_filter": "SAFETY"}


def _usage_metadata(prompt: int, completion: int, usage: dict[str, Any]) -> dict[str, Any]:
    out = {"promptTokenCount": prompt, "candidatesTokenCount": completion,
           "totalTokenCount": prompt + completion}
    cached = cached_tokens(usage)
    if cached:
        out["cachedContentTokenCount"] = cached
    return out


def _call_part(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"functionCall": {"id": call_id, "name": name, "args": load_arguments(arguments)}}


_STATUS = {
    "invalid_request": (400, "INVALID_ARGUMENT"),
    "unsupported": (400, "INVALID_ARGUMENT"),
    "context_length": (400, "INVALID_ARGUMENT"),
    "not_found": (404, "NOT_FOUND"),
    "permission": (403, "PERMISSION_DENIED"),
    "rate_limited": (429, "RESOURCE_EXHAUSTED"),
    "overloaded": (503, "UNAVAILABLE"),
    "timeout": (504, "DEADLINE_EXCEEDED"),
    "upstream_refused": (None, "UNAVAILABLE"),
    "upstream_error": (None, "INTERNAL"),
}


def _error(status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
    fixed, code_name = _STATUS.get(kind, (None, "INTERNAL"))
    status = fixed or status
    if kind == "context_length":
        numbers = context_overflow_numbers(message)
        if numbers:
            message = (f"The input token count ({numbers[0]}) exceeds the maximum number of "
                       f"tokens allowed ({numbers[1]}).")
    return status, {"error": {"code": status, "message": message, "status": code_name}}


class GoogleProvider(Provider):
    name = "google"

    def detect(self, method: str, path: str, headers: dict[str, str], body: Any) -> bool:
        return method.upper() == "POST" and parse_path(path) is not None

    def side_call(self, method: str, path: str) -> str | None:
        parsed = parse_path(path)
        return "count_tokens" if parsed and parsed[1] == "countTokens" else None

    def count_tokens_answer(self, input_tokens: int) -> dict[str, Any]:
        """Body of a ``:countTokens`` answer (the core counts ``to_chat(...)``'s prompt)."""
        return {"totalTokens": input_tokens}

    def to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        body = require_dict(body)
        parsed = parse_path(path)
        if parsed is None:
            raise ProviderError(f"not a Gemini model path: {path}", status=404, kind="not_found")
        model, method = parsed
        if method == "countTokens" and isinstance(body.get("generateContentRequest"), dict):
            body = body["generateContentRequest"]
        stream = method == "streamGenerateContent"
        if stream and (query or {}).get("alt") != "sse":
            raise ProviderError("streamGenerateContent is supported with alt=sse only",
                                kind="unsupported")
        notes = Notes()
        history = _History(notes)
        contents = require_list(body.get("contents"), "contents")
        for ci, content in enumerate(contents):
            parts = _parts(content, f"contents[{ci}]")
            role = content.get("role") or "user"
            if role == "model":
                history.model_turn(ci, parts)
            elif role in ("user", "function"):
                history.user_turn(ci, parts)
            else:
                raise ProviderError(f"contents[{ci}]: unknown role {role!r}")
        messages = history.messages
        system = _system_text(body.get("systemInstruction"), notes)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        if not contents:
            raise ProviderError("contents must not be empty")
        chat: dict[str, Any] = {"model": model, "messages": messages}
        if body.get("tools"):
            tools = _tools(require_list(body["tools"], "tools"), notes)
            if tools:
                chat["tools"] = tools
        if body.get("toolConfig") is not None and chat.get("tools"):
            chat["tool_choice"] = _tool_choice(body["toolConfig"], notes)
        if body.get("generationConfig") is not None:
            _generation_config(require_dict(body["generationConfig"], "generationConfig"), chat,
                               notes)
        if body.get("cachedContent"):
            raise ProviderError("cachedContent is not supported: send the contents",
                                kind="unsupported")
        for key in IGNORED_FIELDS:
            if key in body:
                notes.add(f"ignored field {key}")
        chat["stream"] = stream
        return NormalizedCall(chat_request=chat, stream=stream, requested_model=model,
                              notes=notes.render())

    def from_chat(self, response: dict[str, Any], requested_model: str,
                  call: NormalizedCall | None = None) -> dict[str, Any]:
        answer = read_answer(response)
        parts: list[dict[str, Any]] = []
        if answer.reasoning:
            parts.append({"text": answer.reasoning, "thought": True})
        if answer.content:
            parts.append({"text": answer.content})
        parts.extend(_call_part(tc.id, tc.name, tc.arguments) for tc in answer.tool_calls
                     if answer.finish_reason != "length" or arguments_complete(tc.arguments))
        usage = answer.usage
        return {
            "candidates": [{"content": {"parts": parts, "role": "model"},
                            "finishReason": FINISH.get(answer.finish_reason or "stop", "OTHER"),
                            "index": 0}],
            "usageMetadata": _usage_metadata(usage.get("prompt_tokens") or 0,
                                             usage.get("completion_tokens") or 0, usage),
            "modelVersion": requested_model,
            "responseId": base_id(answer.id),
        }

    def new_stream(self, requested_model: str,
                   call: NormalizedCall | None = None) -> StreamTranslator:
        return GoogleStream(requested_model)

    def error_response(self, status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        return _error(status, kind, message)


def _frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + jsonutil.dumps(obj) + b"\r\n\r\n"  # Google's SSE frames end in CRLF CRLF


class GoogleStream(StreamTranslator):
    """chat chunks -> SSE of partial GenerateContentResponses. Text and thoughts go out as they
    come; function calls go out whole once their arguments are complete (text follows them, the
    engine reported its finish reason, or the stream ended); the last chunk carries finishReason
    and usageMetadata."""

    def __init__(self, requested_model: str):
        self.model = requested_model
        self.reader = ChunkReader()
        self.pending: dict[int, dict[str, Any]] = {}  # chat tool index -> {id, name, args[]}
        self.order: list[int] = []
        self.response_id = ""

    def _chunk(self, parts: list[dict[str, Any]], final: bool = False) -> bytes:
        if not self.response_id:
            self.response_id = base_id(self.reader.id)
        candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
        obj: dict[str, Any] = {"candidates": [candidate]}
        if final:
            candidate["finishReason"] = FINISH.get(self.reader.finish_reason or "stop", "OTHER")
            obj["usageMetadata"] = _usage_metadata(self.reader.prompt_tokens,
                                                   self.reader.completion_tokens, self.reader.usage)
        obj["modelVersion"] = self.model
        obj["responseId"] = self.response_id
        return _frame(obj)

    def _flush_calls(self, parts: list[dict[str, Any]]) -> None:
        for index in self.order:
            t = self.pending.pop(index)
            arguments = "".join(t["args"])
            if self.reader.finish_reason == "length" and not arguments_complete(arguments):
                continue  # cut by the budget: Gemini never sends half a call (MAX_TOKENS says why)
            parts.append(_call_part(t["id"], t["name"], arguments))
        self.order = []

    def _apply(self, events: Any, parts: list[dict[str, Any]]) -> None:
        for ev in events:
            if ev.kind in ("text", "reasoning"):
                self._flush_calls(parts)
                thought = ev.kind == "reasoning"
                last = parts[-1] if parts else None
                if last is not None and "text" in last and bool(last.get("thought")) == thought:
                    last["text"] += ev.text
                else:
                    parts.append({"text": ev.text, "thought": True} if thought else
                                 {"text": ev.text})
            elif ev.kind == "tool_start":
                self.pending[ev.index] = {"id": ev.call_id, "name": ev.name, "args": []}
                self.order.append(ev.index)
            elif ev.index in self.pending:
                self.pending[ev.index]["args"].append(ev.text)
            else:
                # a fragment for a call already sent cannot be added to it: keep it visible
                parts.append({"text": ev.text})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        parts: list[dict[str, Any]] = []
        self._apply(self.reader.feed(chunk), parts)
        if self.reader.finish_reason:  # arguments are complete once the engine says it stopped
            self._flush_calls(parts)
        return self._chunk(parts) if parts else b""

    def finish(self) -> bytes:
        parts: list[dict[str, Any]] = []
        self._apply(self.reader.flush(), parts)
        self._flush_calls(parts)
        return self._chunk(parts or [{"text": ""}], final=True)

    def fail(self, kind: str, message: str) -> bytes:
        return _frame(_error(500, kind, message)[1])
