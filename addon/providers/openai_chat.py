"""OpenAI Chat Completions (``/v1/chat/completions``, also ``/chat/completions``) <-> chat.

Mostly pass-through, normalized so that the engine renders the same prompt for the same history:
``developer`` becomes ``system``; system messages before the conversation merge into one leading
system message (later ones stay in place, so the prefix of later calls does not move); content
part arrays (Qwen Code sends user text and tool results as parts) become strings joined with
``"\\n"`` as vLLM itself would; the harness's own logprob / usage-chunk requests are stripped
from the engine request and honoured when answering.
"""

from __future__ import annotations

import copy
from typing import Any

from polar_proxy import jsonutil

from . import media
from .base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .common import (
    PART_SEPARATOR,
    SYSTEM_SEPARATOR,
    Notes,
    context_overflow_numbers,
    iter_text_parts,
    path_only,
    require_dict,
    require_list,
    require_str,
)

TEXT_PARTS = ("text", "input_text", "output_text")
MEDIA_PARTS = ("image_url", "input_image", "input_audio", "audio", "file", "input_file", "video_url")
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
#: OpenAI-platform request fields with no meaning for a local engine.
DROPPED_FIELDS = (
    "store",
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "prediction",
    "modalities",
    "audio",
    "web_search_options",
    "verbosity",
)
#: Engine-only fields removed from answers (the engine adapter has read them already).
ENGINE_RESPONSE_FIELDS = ("prompt_token_ids", "prompt_logprobs", "prompt_text", "kv_transfer_params",
                          "ec_transfer_params", "metrics")
ENGINE_CHOICE_FIELDS = ("token_ids", "stop_reason", "routed_experts")


def _content_text(content: Any, where: str) -> Any:
    """Parts joined with ``"\n"``; a part array when images or files are among them (settled
    for the served model by the core, see ``media``)."""
    parts = require_list(content, f"{where}.content")
    texts: list[Any] = []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "refusal":
            texts.append(require_str(part.get("refusal"), f"{where} refusal"))
        else:
            texts.extend(iter_text_parts([part], text_types=TEXT_PARTS, media_types=MEDIA_PARTS,
                                         where=where))
    return media.join(texts, PART_SEPARATOR)


def normalize_messages(raw: list[Any], notes: Notes) -> list[dict[str, Any]]:
    leading_system: list[str] = []
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(raw):
        msg = require_dict(msg, f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise ProviderError(f"messages[{i}]: unknown role {role!r}")
        new = dict(msg)
        if role == "developer":
            new["role"] = role = "system"
            notes.add("developer role mapped to system")
        content = msg.get("content")
        if isinstance(content, list):
            new["content"] = _content_text(content, f"messages[{i}]")
            if role not in ("user", "tool"):
                new["content"] = media.as_text(new["content"])
            notes.add(f"{role} content parts joined")
        elif content is not None and not isinstance(content, str):
            raise ProviderError(f"messages[{i}].content must be a string or an array")
        if role == "system":
            if not out:
                leading_system.append(new.get("content") or "")
                continue
            notes.add("kept inline system message in place")
        out.append(new)
    if leading_system:
        if len(leading_system) > 1:
            notes.add(f"merged {len(leading_system)} leading system messages")
        out.insert(0, {"role": "system", "content": SYSTEM_SEPARATOR.join(leading_system)})
    return out


def openai_error(status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
    """(status, body) in OpenAI's error shape; shared by Chat and Responses."""
    code: str | None = None
    error_type = "invalid_request_error"
    if kind in ("invalid_request", "unsupported"):
        status = 400
    elif kind == "not_found":
        status, code = 404, "not_found"
    elif kind == "context_length":
        status, code = 400, "context_length_exceeded"
        numbers = context_overflow_numbers(message)
        if numbers:
            message = (f"This model's maximum context length is {numbers[1]} tokens. However, "
                       f"your messages resulted in {numbers[0]} tokens. Please reduce the length "
                       "of the messages.")
    elif kind == "permission":
        status, code = 403, "permission_denied"
    elif kind == "rate_limited":
        status, error_type, code = 429, "requests", "rate_limit_exceeded"
    elif kind == "overloaded":
        status, error_type, code = 503, "server_error", "server_is_overloaded"
    elif kind == "timeout":
        error_type, code = "server_error", "timeout"
    else:
        error_type = "server_error"
    return status, {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def clean_choice(choice: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in choice.items() if k not in ENGINE_CHOICE_FIELDS}
    if "logprobs" in out:
        if not options.get("logprobs"):
            del out["logprobs"]
        elif isinstance(out["logprobs"], dict):
            keep = options.get("top_logprobs") or 0
            lp = copy.deepcopy(out["logprobs"])
            for entry in lp.get("content") or []:
                if isinstance(entry, dict) and isinstance(entry.get("top_logprobs"), list):
                    entry["top_logprobs"] = entry["top_logprobs"][:keep]
            out["logprobs"] = lp
    return out


class OpenAIChatProvider(Provider):
    name = "openai_chat"

    def detect(self, method: str, path: str, headers: dict[str, str], body: Any) -> bool:
        return method.upper() == "POST" and path_only(path).endswith("/chat/completions")

    def to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        body = require_dict(body)
        notes = Notes()
        model = require_str(body.get("model"), "model")
        messages = normalize_messages(require_list(body.get("messages"), "messages"), notes)
        if not messages:
            raise ProviderError("messages must not be empty")
        options: dict[str, Any] = {
            "include_usage": bool((body.get("stream_options") or {}).get("include_usage")),
            "logprobs": bool(body.get("logprobs")),
            "top_logprobs": body.get("top_logprobs") if body.get("logprobs") else None,
        }
        chat: dict[str, Any] = {}
        for key, value in body.items():
            if key == "model":
                chat["model"] = model
            elif key == "messages":
                chat["messages"] = messages
            elif key in ("stream_options", "logprobs", "top_logprobs"):
                notes.add(f"harness {key} handled by the proxy")
                if key == "top_logprobs" and body.get("logprobs") and isinstance(value, int) and value > 0:
                    chat["top_logprobs"] = value  # the engine computes them; the capture ignores them
            elif key in DROPPED_FIELDS:
                notes.add(f"ignored field {key}")
            elif key == "max_completion_tokens":
                if "max_tokens" in body:
                    notes.add("max_tokens overridden by max_completion_tokens")
                chat["max_tokens"] = value
            elif key == "max_tokens":
                if "max_completion_tokens" not in body:
                    chat["max_tokens"] = value
            elif key == "n":
                if value not in (None, 1):
                    raise ProviderError("n > 1 is not supported: one sample per call is captured",
                                        kind="unsupported")
            elif key == "tools":
                if value is None:
                    continue
                tools = []
                for tool in require_list(value, "tools"):
                    tool = require_dict(tool, "tool")
                    if tool.get("type", "function") != "function":
                        notes.add(f"dropped tool kind {tool.get('type')}")
                        continue
                    tools.append(tool)
                chat["tools"] = tools
            else:
                chat[key] = value
        stream = bool(body.get("stream"))
        chat["stream"] = stream
        return NormalizedCall(chat_request=chat, stream=stream, requested_model=model,
                              notes=notes.render(), options=options)

    def from_chat(self, response: dict[str, Any], requested_model: str,
                  call: NormalizedCall | None = None) -> dict[str, Any]:
        options = call.options if call else {}
        out = {k: v for k, v in response.items() if k not in ENGINE_RESPONSE_FIELDS}
        out["model"] = requested_model
        out["choices"] = [clean_choice(c, options) for c in response.get("choices") or []]
        return out

    def new_stream(self, requested_model: str,
                   call: NormalizedCall | None = None) -> StreamTranslator:
        return OpenAIChatStream(requested_model, call.options if call else {})

    def error_response(self, status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        return openai_error(status, kind, message)


class OpenAIChatStream(StreamTranslator):
    """Cleans each chunk; usage-only chunks reach the harness only if it asked for them."""

    def __init__(self, requested_model: str, options: dict[str, Any]):
        self.model = requested_model
        self.options = options

    def feed(self, chunk: dict[str, Any]) -> bytes:
        out = {k: v for k, v in chunk.items() if k not in ENGINE_RESPONSE_FIELDS}
        out["model"] = self.model
        choices = chunk.get("choices") or []
        if not self.options.get("include_usage"):
            out.pop("usage", None)
        if not choices and out.get("usage") is None:
            return b""
        out["choices"] = [clean_choice(c, self.options) for c in choices]
        return b"data: " + jsonutil.dumps(out) + b"\n\n"

    def finish(self) -> bytes:
        return b"data: [DONE]\n\n"

    def fail(self, kind: str, message: str) -> bytes:
        return b"data: " + jsonutil.dumps(openai_error(500, kind, message)[1]) + b"\n\n"
