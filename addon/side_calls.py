"""Requests that are not model calls but that harnesses make on the way: answered here, never
captured, never sent upstream as they are.

Health checks and model lists/lookups (``GET /v1/models`` and the Anthropic and Gemini shapes of
it) name what the upstream serves; token counts (Anthropic ``count_tokens``, Gemini
``countTokens``) come from the upstream's ``/tokenize`` (vLLM), or a rough estimate.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp
import orjson
from mitmproxy import http

from polar_proxy import jsonutil

from .calls import answer_error
from .httputil import json_response
from .providers import media
from .providers.base import Provider, ProviderError
from .state import ProxyState
from .upstreams import model_info


async def side_call(s: ProxyState, flow: http.HTTPFlow, method: str, path: str, headers: dict[str, str]) -> bool:
    """Health, model lists and model lookups: answered here (no capture record). False: not one."""
    google = path.startswith("/v1beta/") or path.startswith("/v1alpha/") or "x-goog-api-key" in headers
    anthropic = "anthropic-version" in headers
    if method in ("GET", "HEAD") and path in ("/", "/health", "/v1", "/v1/"):
        json_response(flow, 200, {"status": "ok", "proxy": "polar"})
    elif method == "GET" and "/models" in path:
        served = await _served_name(s)
        name = path.rsplit("/models/", 1)[1].strip("/") if "/models/" in path else ""
        if not name:  # the list: what the upstream serves
            names = [served]
            if google:
                json_response(flow, 200, {"models": [_google_model(s, n) for n in names]})
            elif anthropic:
                data = [{"type": "model", "id": n, "display_name": n, "created_at": "2025-01-01T00:00:00Z"}
                        for n in names]
                json_response(flow, 200, {"data": data, "has_more": False, "first_id": served, "last_id": served})
            else:
                json_response(flow, 200, {"object": "list", "data": [
                    {"id": n, "object": "model", "created": 0, "owned_by": "polar",
                     "max_model_len": _max_model_len(s)} for n in names]})
        elif google:  # a lookup: whatever name the harness asked for is served
            json_response(flow, 200, _google_model(s, name.removeprefix("models/")))
        elif anthropic:
            json_response(flow, 200, {"type": "model", "id": name, "display_name": name,
                                      "created_at": "2025-01-01T00:00:00Z"})
        else:
            json_response(flow, 200, {"id": name, "object": "model", "created": 0, "owned_by": "polar",
                                      "max_model_len": _max_model_len(s)})
    else:
        return False
    s.stats["side_calls"] += 1
    flow.metadata["polar"] = {"side_call": path}
    return True


async def provider_side_call(s: ProxyState, flow: http.HTTPFlow, provider: Provider, kind: str | None, body: Any,
                             path: str, query: dict[str, str]) -> None:
    """Token counts (Anthropic count_tokens, Google countTokens): the engine's tokenizer counts."""
    s.stats["side_calls"] += 1
    flow.metadata["polar"] = {"side_call": kind, "provider": provider.name}
    try:
        normalized = provider.to_chat(body, path, query)
    except ProviderError as exc:
        answer_error(flow, provider, exc.status, exc.kind, exc.message)
        return
    if kind != "count_tokens":
        answer_error(flow, provider, 404, "not_found", f"polar: unsupported side call {kind}")
        return
    media.settle(normalized, s.media_mode)
    count = await _count_tokens(s, normalized.chat_request)
    json_response(flow, 200, provider.count_tokens_answer(count))


async def _count_tokens(s: ProxyState, chat: dict[str, Any]) -> int:
    """Prompt tokens via the upstream's /tokenize (vLLM); a rough estimate if that fails."""
    if s.pool is not None and s.http is not None:
        up = s.pool.pick(None)
        try:
            await model_info(s.http, up, s.served_model, s.client_timeout())
            payload = {"model": up.served_model, "messages": chat.get("messages") or [],
                       "add_generation_prompt": True}
            if chat.get("tools"):
                payload["tools"] = chat["tools"]
            async with s.http.post(up.url + "/tokenize", data=jsonutil.dumps(payload),
                                   headers={"content-type": "application/json"},
                                   timeout=s.client_timeout()) as resp:
                if resp.status == 200:
                    return int(orjson.loads(await resp.read())["count"])
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, KeyError, ValueError, TypeError):
            pass
    return _estimate_tokens(chat.get("messages"))


def _estimate_tokens(body: Any) -> int:
    """A rough count for count_tokens side calls (no capture, no engine round trip)."""
    return max(1, math.ceil(len(jsonutil.dumps(body)) / 4)) if body else 1


def _google_model(s: ProxyState, name: str) -> dict[str, Any]:
    limit = _max_model_len(s) or 0
    return {"name": f"models/{name}", "version": "polar", "displayName": name, "description": "served by Polar",
            "inputTokenLimit": limit, "outputTokenLimit": limit,
            "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"]}


async def _served_name(s: ProxyState) -> str:
    """The served model (asking an upstream if nobody has yet); the option wins."""
    if s.served_model:
        return s.served_model
    if s.pool is not None:
        for up in s.pool.upstreams:
            if up.served_model:
                return up.served_model
        if s.http is not None:
            up = s.pool.pick(None)
            try:
                await model_info(s.http, up, s.served_model, s.client_timeout())
                return up.served_model or "polar-model"
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                pass
    return "polar-model"


def _max_model_len(s: ProxyState) -> int | None:
    if s.pool is not None:
        for up in s.pool.upstreams:
            if up.max_model_len:
                return up.max_model_len
    return None
