"""Provider translators, one module per wire format, and the registry the proxy core uses.

``detect_provider`` decides by path (any prefix before the API path is allowed, so base URLs like
``http://host/openai/v1`` work); paths of no known format return None and the core passes them on.
"""

from __future__ import annotations

from typing import Any

from .anthropic import AnthropicProvider
from .base import NormalizedCall, Provider, ProviderError, StreamTranslator
from .google import GoogleProvider
from .openai_chat import OpenAIChatProvider
from .openai_responses import OpenAIResponsesProvider

PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (AnthropicProvider(), OpenAIChatProvider(), OpenAIResponsesProvider(), GoogleProvider())
}


def detect_provider(method: str, path: str, headers: dict[str, str], body: Any) -> Provider | None:
    """The provider whose wire format this request uses, or None (not a model call)."""
    for provider in PROVIDERS.values():
        if provider.detect(method, path, headers, body):
            return provider
    return None


def chat_request_of(provider: str, body: Any, path: str, query: dict[str, str]) -> dict[str, Any] | None:
    """The normalized chat request the proxy would send for a native request, or None when the
    translator refuses it. Used to read saved flows back into records (``polar flows``)."""
    p = PROVIDERS.get(provider)
    if p is None or not isinstance(body, dict):
        return None
    try:
        return p.to_chat(body, path, query).chat_request
    except Exception:
        return None


__all__ = [
    "PROVIDERS",
    "NormalizedCall",
    "Provider",
    "ProviderError",
    "StreamTranslator",
    "chat_request_of",
    "detect_provider",
]
