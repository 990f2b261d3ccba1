"""The proxy in front of a real vLLM (tiny-qwen: random weights, the real Qwen2.5 tokenizer and
chat template). Every provider, streaming and not, gets a valid answer, and the captured ids and
logprobs equal what vLLM returns for the same normalized request called directly; the scripted
upstream's wire format has the same shape as vLLM's."""

from __future__ import annotations

import copy
import json
import math

import pytest

pytestmark = pytest.mark.vllm

CALLS = {
    "openai_chat": ("/v1/chat/completions",
                    lambda stream: {"model": "gpt-x", "stream": stream, "temperature": 0, "max_tokens": 12,
                                    "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Name a color."}]}, {}),
    "anthropic": ("/v1/messages",
                  lambda stream: {"model": "claude-x", "stream": stream, "temperature": 0, "max_tokens": 12,
                                  "system": "Be brief.", "messages": [{"role": "user", "content": "Name a color."}]},
                  {"anthropic-version": "2023-06-01"}),
    "openai_responses": ("/v1/responses",
                         lambda stream: {"model": "gpt-x", "stream": stream, "temperature": 0,
                                         "max_output_tokens": 12, "instructions": "Be brief.",
                                         "input": "Name a color."}, {}),
    "google": ("/v1beta/models/gemini-x:{method}",
               lambda stream: {"systemInstruction": {"parts": [{"text": "Be brief."}]},
                               "contents": [{"role": "user", "parts": [{"text": "Name a color."}]}],
                               "generationConfig": {"temperature": 0, "maxOutputTokens": 12}}, {}),
}


@pytest.fixture(scope="module")
def vllm_proxy(vllm_tiny, confdir, tmp_path_factory):
    from polar_proxy.process import ProxyProcess

    proxy = ProxyProcess(vllm_tiny.base_url, tmp_path_factory.mktemp("captures-vllm"), confdir=confdir,
                         upstream_timeout=120).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def tokenizer(vllm_tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_tiny.model_dir)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("provider", list(CALLS))
def test_real_vllm_exact_capture(helpers, vllm_tiny, vllm_proxy, tokenizer, session_id, provider, stream):
    path, make, headers = CALLS[provider]
    path = path.format(method="streamGenerateContent?alt=sse" if stream else "generateContent")
    ans = helpers.request(vllm_proxy.url + path, make(stream), headers={**headers, "x-polar-session": session_id},
                          timeout=120)
    assert ans.status == 200, ans.body[:500]
    parsed = helpers.parsers[provider](ans.body, stream)
    assert parsed.error is None
    [rec] = helpers.read_records(vllm_proxy.capture_dir, session_id)
    assert rec["status"] == "ok" and rec["served_model"] == "tiny-qwen"
    ids, lps = rec["sampled_token_ids"], rec["sampled_logprobs"]
    assert 0 < len(ids) <= 12 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
    assert rec["completion_tokens"] == len(ids) and rec["prompt_tokens"] == len(rec["prompt_token_ids"])
    # the prompt ids are the chat template's rendering of the normalized request
    norm = rec["normalized_request"]
    rendered = tokenizer.apply_chat_template(norm["messages"], add_generation_prompt=True, tokenize=True)
    assert rec["prompt_token_ids"] == list(rendered)
    # a direct call with the same normalized request (temperature 0) samples the same ids
    direct_req = copy.deepcopy(norm)
    direct_req["stream"] = False
    direct_req.pop("stream_options", None)
    direct = helpers.request(vllm_tiny.base_url + "/v1/chat/completions", direct_req, timeout=120).json()
    assert direct["prompt_token_ids"] == rec["prompt_token_ids"]
    assert direct["choices"][0]["token_ids"] == ids
    direct_lps = [e["logprob"] for e in direct["choices"][0]["logprobs"]["content"]]
    assert len(direct_lps) == len(lps) and all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(direct_lps, lps))
    # ... and the harness received exactly vLLM's answer to it: text, reasoning, tool calls, finish
    assert received(parsed) == vllm_answer(direct), (received(parsed), vllm_answer(direct))
    assert parsed.finish == FINISH[provider][direct["choices"][0]["finish_reason"]]


#: vLLM's finish_reason as each client reads it (no tools here: stop or length).
FINISH = {
    "openai_chat": {"stop": "stop", "length": "length"},
    "anthropic": {"stop": "end_turn", "length": "max_tokens"},
    "openai_responses": {"stop": "completed", "length": "incomplete:max_output_tokens"},
    "google": {"stop": "STOP", "length": "MAX_TOKENS"},
}


def _args(value):
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


def vllm_answer(direct: dict) -> tuple[str, str, list]:
    """(text, reasoning, [(tool name, arguments)]) of a whole vLLM chat completion."""
    msg = direct["choices"][0]["message"]
    return (msg.get("content") or "", msg.get("reasoning") or msg.get("reasoning_content") or "",
            [(t["function"]["name"], _args(t["function"]["arguments"])) for t in msg.get("tool_calls") or []])


def received(parsed) -> tuple[str, str, list]:
    """The same, as the harness's client read it from the proxy's answer."""
    return parsed.text, parsed.reasoning, [(t["name"], _args(t["arguments"])) for t in parsed.tool_calls]

def test_scripted_upstream_has_vllms_wire_shape(helpers, vllm_tiny, upstream):
    """Same keys at every level as real vLLM, streaming and not (the tests' upstream is faithful)."""
    def call(url, model, stream):
        body = {"model": model, "messages": [{"role": "user", "content": "hi #scenario:words:3"}], "max_tokens": 3,
                "temperature": 0, "logprobs": True, "return_token_ids": True, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        ans = helpers.request(url + "/v1/chat/completions", body, timeout=120)
        return ans.json() if not stream else [e for _, e in helpers.sse_events(ans.body)]

    def shape(obj):
        if isinstance(obj, dict):
            return {k: shape(v) for k, v in obj.items() if k not in ("system_fingerprint",)}
        if isinstance(obj, list):
            return [shape(obj[0])] if obj else []
        return type(obj).__name__ if obj is not None else None

    real = call(vllm_tiny.base_url, "tiny-qwen", False)
    fake = call(upstream.url, "scripted-model", False)
    assert shape(fake) == shape(real)
    real_s, fake_s = call(vllm_tiny.base_url, "tiny-qwen", True), call(upstream.url, "scripted-model", True)
    assert real_s[-1] == fake_s[-1] == "[DONE]"
    assert shape(fake_s[0]) == shape(real_s[0])  # role chunk with prompt_token_ids
    assert shape(fake_s[1]) == shape(real_s[1])  # a token chunk
    assert shape(fake_s[-2]) == shape(real_s[-2])  # usage chunk
    assert json.dumps(sorted(fake_s[-3]["choices"][0])) == json.dumps(sorted(real_s[-3]["choices"][0]))
