"""The contract every provider translator implements.

A translator knows one wire format (Anthropic Messages, OpenAI Chat, OpenAI Responses, Google
generateContent). It turns the harness's request into an OpenAI Chat Completions request for the
engine, and the engine's chat answer (whole, or chunk by chunk) back into the harness's format.
Translators are pure: no I/O, no mitmproxy imports, so they are unit-testable with plain dicts.
Token ids are the engine adapter's business (addon/engines), not the translator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


class ProviderError(Exception):
    """A request the proxy refuses (malformed, unsupported feature). Answered in provider shape."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


#: Error kinds the core may pass to ``error_response``; translators map each to their own shape.
ERROR_KINDS = (
    "invalid_request",  # 400: malformed JSON, schema problems
    "unsupported",  # 400: images for a text-only model, unknown tool kinds that cannot be dropped
    "not_found",  # 404: unknown path
    "context_length",  # 400: prompt too long -> each provider's context-overflow error
    "rate_limited",  # 429
    "upstream_refused",  # 502
    "upstream_error",  # 502 / upstream status
    "timeout",  # 504
    "overloaded",  # 503 (paused gate timed out, no upstream alive)
)


@dataclass
class NormalizedCall:
    """The harness's request, normalized for the engine."""

    chat_request: dict[str, Any]  # OpenAI chat body; the engine adapter adds token/logprob fields
    stream: bool  # the harness asked for a streamed answer
    requested_model: str  # restored in every answer
    notes: list[str] = field(default_factory=list)  # what was dropped/flattened/stripped, counted
    # What the answer translation needs to know about the request and the engine must not see
    # (e.g. the harness asked for logprobs / a usage chunk). Pass the call to from_chat/new_stream.
    options: dict[str, Any] = field(default_factory=dict)


class StreamTranslator:
    """Turns a sequence of chat.completion.chunk dicts into the provider's SSE bytes, with state."""

    def feed(self, chunk: dict[str, Any]) -> bytes:  # one parsed upstream chunk
        raise NotImplementedError

    def finish(self) -> bytes:  # closing events once the upstream stream ended cleanly
        raise NotImplementedError

    def fail(self, kind: str, message: str) -> bytes:  # in-stream error after headers were sent
        raise NotImplementedError


class Provider:
    """One wire format. Subclasses are stateless singletons."""

    name: ClassVar[str]

    def detect(self, method: str, path: str, headers: dict[str, str], body: Any) -> bool:
        """True when this request is in this provider's format (path first, then headers/body)."""
        raise NotImplementedError

    def to_chat(self, body: dict[str, Any], path: str, query: dict[str, str]) -> NormalizedCall:
        """Native request -> normalized chat request. Raises ProviderError for bad input."""
        raise NotImplementedError

    def from_chat(
        self, response: dict[str, Any], requested_model: str, call: NormalizedCall | None = None
    ) -> dict[str, Any]:
        """A whole chat.completion (message.content / reasoning / tool_calls, finish_reason, usage)
        -> the native non-streaming answer. ``call`` (the to_chat result) carries its options."""
        raise NotImplementedError

    def new_stream(
        self, requested_model: str, call: NormalizedCall | None = None
    ) -> StreamTranslator:
        raise NotImplementedError

    def side_call(self, method: str, path: str) -> str | None:
        """Name of a side endpoint of this format that the core answers itself instead of
        generating (e.g. Anthropic's ``count_tokens``), or None for a normal generation call."""
        return None

    def count_tokens_answer(self, input_tokens: int) -> dict[str, Any]:
        """The answer to this format's ``count_tokens`` side call (Anthropic, Google)."""
        raise NotImplementedError(f"{self.name} has no count_tokens endpoint")

    def error_response(self, status: int, kind: str, message: str) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of an error in this provider's own shape."""
        raise NotImplementedError
