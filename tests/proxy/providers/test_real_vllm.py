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


def _args(value):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def _from_chunks(chunks):
    """What vLLM generated, accumulated straight from its chunks: (text, reasoning, [(name, args)])."""
    text, reasoning, tools = "", "", {}
    for c in chunks:
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            text += d.get("content") or ""
            reasoning += d.get("reasoning") or d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                t = tools.setdefault(tc["index"], ["", ""])
                t[0] += (tc.get("function") or {}).get("name") or ""
                t[1] += (tc.get("function") or {}).get("arguments") or ""
    return text, reasoning, [(name, _args(args)) for _, (name, args) in sorted(tools.items())]


def _from_whole(whole):
    """The same from a whole vLLM chat completion."""
    msg = whole["choices"][0]["message"]
    return (msg.get("content") or "", msg.get("reasoning") or msg.get("reasoning_content") or "",
            [(t["function"]["name"], _args(t["function"]["arguments"])) for t in msg.get("tool_calls") or []])


def _received(parsed):
    """What a client of the wire format read from our translation (tests/proxy/conftest.py's readers)."""
    assert parsed.error is None, parsed.error
    return parsed.text, parsed.reasoning, [(t["name"], _args(t["arguments"])) for t in parsed.tool_calls]


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
def test_real_vllm_accepts_and_answers_translate(h, helpers, vllm_tiny, name):
    req = _request(h, name)
    provider = detect_provider(req["method"], req["path"], req["headers"], req["body"])
    call = provider.to_chat(req["body"], req["path"], req["query"])
    url = vllm_tiny.base_url + "/v1/chat/completions"
    engine = get_engine("vllm")
    read = helpers.parsers[provider.name]

    body = engine.prepare(dict(call.chat_request, model="tiny-qwen", max_tokens=6,
                               temperature=0, stream=False))
    whole = _post(url, body, stream=False)
    assert whole["prompt_token_ids"] and whole["choices"][0]["token_ids"]
    native = provider.from_chat(whole, call.requested_model, call)
    dumped = json.dumps(native)
    assert "prompt_token_ids" not in dumped and "token_ids" not in dumped
    assert call.requested_model in dumped
    # the client reads exactly vLLM's answer: text, reasoning, tool calls
    assert _received(read(dumped.encode(), False)) == _from_whole(whole)

    body = engine.prepare(dict(call.chat_request, model="tiny-qwen", max_tokens=6,
                               temperature=0, stream=True,
                               stream_options={"include_usage": True}))
    chunks = _post(url, body, stream=True)
    translator = provider.new_stream(call.requested_model, call)
    raw = b"".join(translator.feed(c) for c in chunks) + translator.finish()
    assert _received(read(raw, True)) == _from_chunks(chunks)
    # greedy both times: the stream is the same generation as the whole answer
    assert [i for c in chunks for ch in c.get("choices") or [] for i in ch.get("token_ids") or []] == \
        whole["choices"][0]["token_ids"]
