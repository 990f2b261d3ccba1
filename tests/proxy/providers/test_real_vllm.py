"""The real vLLM accepts every normalized harness request (with the engine's token-id fields
added, as the proxy sends them) and its real answers -- whole and streamed, token ids and all --
translate back into each wire format that reconstructs exactly what vLLM generated."""

from __future__ import annotations

import json
import urllib.request

import pytest

from polar_core.net import OPENER  # never via HTTP(S)_PROXY
from polar_proxy.engines import get_engine
from polar_proxy.providers import detect_provider

from .handbuilt import CLAUDE_NON_BARE, CODEX, GEMINI_CLI, GEMINI_PATH

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FIXTURES = ["claude-code.bare", "pi.anthropic", "pi.anthropic.second", "pi.chat.second",
            "pi.responses.second", "pi.gemini.second", "qwen-code.second"]


def _post(url: str, body: dict, stream: bool):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with OPENER.open(req, timeout=300) as resp:
        if not stream:
            return json.loads(resp.read())
        chunks = []
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return chunks


def _from_chunks(chunks):
    """What vLLM generated, accumulated straight from its chunks."""
    text, reasoning, tools = "", "", {}
    for c in chunks:
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            text += d.get("content") or ""
            reasoning += d.get("reasoning") or ""
            for tc in d.get("tool_calls") or []:
                t = tools.setdefault(tc["index"], ["", "", ""])
                t[0] = t[0] or tc.get("id") or ""
                t[1] += (tc.get("function") or {}).get("name") or ""
                t[2] += (tc.get("function") or {}).get("arguments") or ""
    return text, reasoning, [tuple(t) for _, t in sorted(tools.items())]


def _native_text(provider: str, h, raw: bytes) -> str:
    """Text a client of this wire format reads from our translated stream."""
    events = h.parse_sse(raw)
    if provider == "anthropic":
        return "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    if provider == "openai_responses":
        assert events[-1][0] == "response.completed"
        return "".join(d["delta"] for e, d in events if e == "response.output_text.delta")
    if provider == "google":
        return "".join(p.get("text", "") for _, d in events
                       for p in d["candidates"][0]["content"]["parts"] if not p.get("thought"))
    return "".join((c["choices"][0]["delta"].get("content") or "") for _, c in events
                   if c != "[DONE]" and c["choices"])


HANDBUILT = {  # inline system messages, reasoning fields, positional ids, flattened tools
    "codex": ("POST", "/v1/responses", {}, CODEX),
    "gemini-cli": ("POST", GEMINI_PATH, {"alt": "sse"}, GEMINI_CLI),
    "claude-code.non-bare": ("POST", "/v1/messages?beta=true", {"beta": "true"}, CLAUDE_NON_BARE),
}


def _request(h, name):
    if name in HANDBUILT:
        method, path, query, body = HANDBUILT[name]
        return {"method": method, "path": path, "query": query, "headers": {}, "body": body}
    return h.load_request(name)


@pytest.mark.parametrize("name", FIXTURES + list(HANDBUILT))
def test_real_vllm_accepts_and_answers_translate(h, vllm_tiny, name):
    req = _request(h, name)
    provider = detect_provider(req["method"], req["path"], req["headers"], req["body"])
    call = provider.to_chat(req["body"], req["path"], req["query"])
    url = vllm_tiny.base_url + "/v1/chat/completions"
    engine = get_engine("vllm")

    body = engine.prepare(dict(call.chat_request, model="tiny-qwen", max_tokens=6,
                               temperature=0, stream=False))
    whole = _post(url, body, stream=False)
    assert whole["prompt_token_ids"] and whole["choices"][0]["token_ids"]
    native = provider.from_chat(whole, call.requested_model, call)
    dumped = json.dumps(native)
    assert "prompt_token_ids" not in dumped and "token_ids" not in dumped
    assert call.requested_model in dumped

    body = engine.prepare(dict(call.chat_request, model="tiny-qwen", max_tokens=6,
                               temperature=0, stream=True,
                               stream_options={"include_usage": True}))
    chunks = _post(url, body, stream=True)
    translator = provider.new_stream(call.requested_model, call)
    raw = b"".join(translator.feed(c) for c in chunks) + translator.finish()
    text, _, tools = _from_chunks(chunks)
    assert _native_text(provider.name, h, raw) == text
    if not tools:
        assert text == (whole["choices"][0]["message"]["content"] or "")  # greedy: same tokens
