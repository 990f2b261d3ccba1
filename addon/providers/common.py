"""Helpers shared by the provider translators: text joining, tool-argument (de)serialization,
translation notes, SSE framing, and a reader that turns vLLM chat chunks into simple events.

Choices that affect the rendered prompt (and so prefix merging) live here, in one place:

* text parts are joined with ``"\\n"`` -- the same separator vLLM uses when it flattens a content
  part array itself, so a harness that sends parts gets the prompt it would have got directly;
* tool-call arguments that arrive as objects (Anthropic ``input``, Google ``args``) are serialized
  with ``json.dumps(obj, ensure_ascii=False)`` (default separators), the form vLLM's Hermes tool
  parser produces from what the model wrote; any drift is visible to the analysis, never hidden;
* separate system sources (instructions, several system messages) are joined with ``"\\n\\n"``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from polar_proxy import jsonutil

from .base import ProviderError

PART_SEPARATOR = "\n"
SYSTEM_SEPARATOR = "\n\n"

#: Key under which tool arguments that are not a JSON object reach object-based wire formats
#: (Anthropic ``input``, Google ``args``), so the harness sees what the model produced.
RAW_ARGUMENTS_KEY = "_raw_arguments"


def dump_arguments(obj: Any) -> str:
    """Serialize object-shaped tool arguments for a chat ``function.arguments`` string."""
    return json.dumps(obj, ensure_ascii=False)


def load_arguments(raw: str | None) -> dict[str, Any]:
    """A chat ``arguments`` string -> an object. Malformed or non-object JSON is kept verbatim
    under ``RAW_ARGUMENTS_KEY`` rather than dropped."""
    if raw is None or raw.strip() == "":
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {RAW_ARGUMENTS_KEY: raw}
    return value if isinstance(value, dict) else {RAW_ARGUMENTS_KEY: raw}


def arguments_complete(raw: str | None) -> bool:
    """True when a chat ``arguments`` string is a whole JSON object (a call the output budget cut
    mid-way is not: it must never reach a harness as a finished call)."""
    if raw is None or raw.strip() == "":
        return True  # a call without arguments
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


def path_only(path: str) -> str:
    """A request path without its query string and trailing slash (what ``detect`` matches)."""
    return path.split("?", 1)[0].rstrip("/")


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event; ``data`` is JSON-encoded unless already bytes/str."""
    if isinstance(data, bytes):
        payload = data
    elif isinstance(data, str):
        payload = data.encode()
    else:
        payload = jsonutil.dumps(data)
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + payload + b"\n\n"


def require_dict(body: Any, what: str = "request body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProviderError(f"{what} must be a JSON object")
    return body


def require_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProviderError(f"{what} must be an array")
    return value


def require_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ProviderError(f"{what} must be a string")
    return value


class Notes:
    """Counted translation notes, rendered in first-seen order (deterministic)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def add(self, note: str, n: int = 1) -> None:
        self._counts[note] = self._counts.get(note, 0) + n

    def render(self) -> list[str]:
        return [note if n == 1 else f"{note} (x{n})" for note, n in self._counts.items()]


def refuse_media(kind: str) -> ProviderError:
    return ProviderError(
        f"{kind} content is not supported: the served model is text-only", kind="unsupported"
    )


_CTX_PATTERNS = (
    # vLLM 0.32 (renderers/params.py): "This model's maximum context length is 4096 tokens.
    # However, your prompt contains [at least ]5000 input tokens, which exceeds this limit ..."
    re.compile(r"maximum context length is (?P<max>\d+) tokens\. However, your prompt contains "
               r"(?:at least )?(?P<req>\d+) input tokens", re.S),
    # vLLM 0.32 (v1/engine/input_processor.py): "The decoder prompt (length 5000) is longer than
    # the maximum model length of 4096." / "... (length 4096) plus the number of requested output
    # tokens (at least 1) is longer than the maximum model length of 4096."
    re.compile(r"prompt \(length (?P<req>\d+)\).*?longer than the maximum model length of (?P<max>\d+)",
               re.S),
    # vLLM 0.32 (get_max_tokens): "Input length (5000) exceeds model's maximum context length (4096)."
    re.compile(r"Input length \((?P<req>\d+)\) exceeds model's maximum context length \((?P<max>\d+)\)"),
    # older vLLM: "This model's maximum context length is 32768 tokens. However, you requested 40000 ..."
    re.compile(r"maximum context length is (?P<max>\d+) tokens.*?(?P<req>\d+) tokens", re.S),
    # "... (40000 tokens) ... maximum (32768) ..." in either order, or "40000 tokens > 32768 maximum"
    re.compile(r"(?P<req>\d+) tokens? > (?P<max>\d+)"),
    re.compile(r"input token count \((?P<req>\d+)\) exceeds the maximum .*?\((?P<max>\d+)\)", re.S),
)


def context_overflow_numbers(message: str) -> tuple[int, int] | None:
    """(requested, maximum) token counts found in an engine's context-overflow message."""
    for pattern in _CTX_PATTERNS:
        m = pattern.search(message)
        if m:
            return int(m.group("req")), int(m.group("max"))
    return None


def base_id(upstream_id: Any) -> str:
    """An id suffix derived from the upstream completion id (stable for one answer)."""
    if isinstance(upstream_id, str) and upstream_id:
        tail = re.sub(r"^(chatcmpl|cmpl)-", "", upstream_id)
        tail = re.sub(r"[^A-Za-z0-9]", "", tail)
        if tail:
            return tail[:48]
    return uuid.uuid4().hex


def tool_id_or_new(value: Any, prefix: str = "call_") -> str:
    if isinstance(value, str) and value:
        return value
    return prefix + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------------------------------------
# Reading the engine's answers
# ---------------------------------------------------------------------------------------------


@dataclass
class ChatToolCall:
    id: str
    name: str
    arguments: str  # JSON string exactly as the engine produced it


@dataclass
class ChatAnswer:
    """The parts of a whole chat.completion the translators need."""

    id: str
    created: int | None
    content: str
    reasoning: str
    tool_calls: list[ChatToolCall]
    finish_reason: str | None
    stop_reason: Any
    usage: dict[str, Any]


def reasoning_of(obj: dict[str, Any]) -> str | None:
    value = obj.get("reasoning")
    if value is None:
        value = obj.get("reasoning_content")
    return value if isinstance(value, str) else None


def read_answer(response: dict[str, Any]) -> ChatAnswer:
    """Extract choice 0 of a whole chat.completion (token fields are the engine's business)."""
    choices = response.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    calls = []
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        calls.append(
            ChatToolCall(
                id=tool_id_or_new(tc.get("id")),
                name=fn.get("name") or "",
                arguments=fn.get("arguments") or "",
            )
        )
    content = message.get("content")
    return ChatAnswer(
        id=str(response.get("id") or ""),
        created=response.get("created") if isinstance(response.get("created"), int) else None,
        content=content if isinstance(content, str) else "",
        reasoning=reasoning_of(message) or "",
        tool_calls=calls,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        usage=response.get("usage") or {},
    )


@dataclass
class Event:
    """One step of an answer being generated: kind is reasoning | text | tool_start | tool_args."""

    kind: str
    text: str = ""
    index: int = 0  # tool-call index (chat's ``tool_calls[].index``)
    call_id: str = ""
    name: str = ""


@dataclass
class _PendingTool:
    id: str | None = None
    name: str | None = None
    started: bool = False
    buffered: list[str] = field(default_factory=list)


class ChunkReader:
    """Turns chat.completion.chunk dicts into ordered ``Event``s, remembering id, finish reason
    and usage. A tool call starts once its name is known; argument fragments that arrive before
    that are buffered, never dropped. Token-id / logprob fields are ignored here."""

    def __init__(self) -> None:
        self.id: str = ""
        self.created: int | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] = {}
        self.prompt_token_count: int | None = None
        self.started = False
        self._tools: dict[int, _PendingTool] = {}

    def feed(self, chunk: dict[str, Any]) -> Iterator[Event]:
        if not isinstance(chunk, dict):
            return
        self.started = True
        if not self.id and isinstance(chunk.get("id"), str):
            self.id = chunk["id"]
        if self.created is None and isinstance(chunk.get("created"), int):
            self.created = chunk["created"]
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        # only a count, for usage shown before the engine's usage chunk arrives (Anthropic's
        # message_start); the ids themselves are the engine adapter's business
        ids = chunk.get("prompt_token_ids")
        if self.prompt_token_count is None and ids is not None and not isinstance(ids, (str, bytes, dict)) \
                and hasattr(ids, "__len__"):  # a list, or the engine's lifted raw ids
            self.prompt_token_count = len(ids)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                yield Event("reasoning", reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                yield Event("text", content)
            for tc in delta.get("tool_calls") or []:
                yield from self._tool_delta(tc)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def _tool_delta(self, tc: dict[str, Any]) -> Iterator[Event]:
        index = tc.get("index", 0)
        pending = self._tools.setdefault(index, _PendingTool())
        fn = tc.get("function") or {}
        if tc.get("id") and not pending.id:
            pending.id = tc["id"]
        if fn.get("name") and not pending.name:
            pending.name = fn["name"]
        fragment = fn.get("arguments")
        if not pending.started and pending.name:
            pending.started = True
            pending.id = tool_id_or_new(pending.id)
            yield Event("tool_start", index=index, call_id=pending.id, name=pending.name)
            for buffered in pending.buffered:
                yield Event("tool_args", buffered, index=index)
            pending.buffered.clear()
        if isinstance(fragment, str) and fragment:
            if pending.started:
                yield Event("tool_args", fragment, index=index)
            else:
                pending.buffered.append(fragment)

    def flush(self) -> Iterator[Event]:
        """At the end: start tool calls whose name never came (so their arguments still reach
        the harness)."""
        for index, pending in sorted(self._tools.items()):
            if not pending.started:
                pending.started = True
                pending.id = tool_id_or_new(pending.id)
                yield Event("tool_start", index=index, call_id=pending.id, name="")
                for buffered in pending.buffered:
                    yield Event("tool_args", buffered, index=index)
                pending.buffered.clear()

    @property
    def prompt_tokens(self) -> int:
        value = self.usage.get("prompt_tokens")
        if isinstance(value, int):
            return value
        return self.prompt_token_count or 0

    @property
    def completion_tokens(self) -> int:
        value = self.usage.get("completion_tokens")
        return value if isinstance(value, int) else 0


def cached_tokens(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else 0


def iter_text_parts(
    parts: Iterable[Any], *, text_types: tuple[str, ...], media_types: tuple[str, ...], where: str
) -> Iterator[Any]:
    """Text (str) of typed parts, and a media part (dict, see ``media``) for each image, file or
    audio part; unknown kinds are malformed input."""
    from .media import openai_media

    for part in parts:
        if isinstance(part, str):
            yield part
            continue
        if not isinstance(part, dict):
            raise ProviderError(f"{where}: content parts must be objects")
        kind = part.get("type")
        if kind in text_types:
            text = part.get("text")
            if not isinstance(text, str):
                raise ProviderError(f"{where}: {kind} part without text")
            yield text
        elif kind in media_types:
            yield openai_media(part)
        else:
            raise ProviderError(f"{where}: unknown content part type {kind!r}")
