"""The real vLLM returns what Polar captures: prompt ids, sampled ids and per-token logprobs.

Checked against the model's own tokenizer and chat template, for a plain and a streaming request,
on the tiny model (fast) and on the real 0.5B.
"""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from transformers import AutoTokenizer

from polar_runtime import models
from polar_core.net import OPENER, http_json

pytestmark = pytest.mark.vllm

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three prime numbers, comma separated. Ünïcödé ✓"},
]
_NO_PROXY = OPENER  # never via HTTP(S)_PROXY


@pytest.fixture(params=["vllm_tiny", "vllm_qwen05"], scope="module")
def server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tokenizer(server):
    return AutoTokenizer.from_pretrained(str(server.model_dir))


@pytest.fixture(scope="module")
def plain(server):
    """One non-streaming greedy call per server (the 0.5B decodes ~7 tokens/s on 2 cores)."""
    return http_json(f"{server.openai_base_url}/chat/completions", _body(server), timeout=300)


def _body(server, **extra):
    return {
        "model": server.served_model_name,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        **extra,
    }


def _stream(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    chunks = []
    with _NO_PROXY.open(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _check_logprobs(entries: list[dict], token_ids: list[int]) -> None:
    assert len(entries) == len(token_ids)
    for e in entries:
        assert math.isfinite(e["logprob"]) and e["logprob"] <= 0
        assert len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        # greedy: the sampled token is the most likely one, with the same logprob
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"], abs=1e-5)


def test_chat_completion_token_ids_and_logprobs(plain, tokenizer):
    resp = plain
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert resp["prompt_token_ids"] == list(expected_prompt)
    choice = resp["choices"][0]
    ids = choice["token_ids"]
    assert 0 < len(ids) <= 12 and choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        assert ids[-1] in (151645, 151643)  # the stop token is kept among the sampled ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    _check_logprobs(choice["logprobs"]["content"], ids)
    assert resp["usage"]["completion_tokens"] == len(ids)
    assert resp["usage"]["prompt_tokens"] == len(expected_prompt)


def test_streaming_token_ids_match(server, tokenizer, plain):
    chunks = _stream(f"{server.openai_base_url}/chat/completions", _body(server, stream=True))
    firsts = [c for c in chunks if c.get("prompt_token_ids")]
    assert len(firsts) == 1 and firsts[0] is chunks[0]  # prompt ids come once, in the first chunk
    expected_prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert firsts[0]["prompt_token_ids"] == list(expected_prompt)
    ids, text, entries, finish = [], "", [], None
    for c in chunks:
        for ch in c["choices"]:
            ids += ch.get("token_ids") or []
            text += ch["delta"].get("content") or ""
            entries += (ch.get("logprobs") or {}).get("content") or []
            finish = ch.get("finish_reason") or finish
    assert ids and finish in ("stop", "length")
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    _check_logprobs(entries, ids)
    # greedy decoding: the stream samples exactly what the non-streaming call sampled
    assert plain["choices"][0]["token_ids"] == ids


def test_prompt_ids_follow_the_tools_template(server, tokenizer):
    if not models.SPECS[server.served_model_name].supports_tools:
        pytest.skip("template without tools")
    body = _body(server, tools=models.VERIFY_TOOLS, max_tokens=1, logprobs=False, top_logprobs=None)
    resp = http_json(f"{server.openai_base_url}/chat/completions", body, timeout=300)
    expected = tokenizer.apply_chat_template(MESSAGES, tools=models.VERIFY_TOOLS, add_generation_prompt=True, tokenize=True)
    assert resp["prompt_token_ids"] == list(expected)
    assert 151657 in resp["prompt_token_ids"]  # "<tool_call>" from the tool instructions, as one id
