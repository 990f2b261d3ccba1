"""Issue 16 against the real vLLM (tiny-qwen, max_model_len 512): the context-overflow message of
current vLLM keeps its token counts in every provider's wording, and a harness limit above the
room the real prompt leaves (digit-heavy tool results: ~1 token a byte) is served, not refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from polar_proxy.process import ProxyProcess
from polar_proxy.providers.common import context_overflow_numbers
from polar_runtime import models
from polar_runtime.serve import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
MAX_LEN = 512


@pytest.fixture(scope="module")
def small_vllm():
    models.ensure_model(models.TINY_QWEN)
    with VLLMServer(models.TINY_QWEN, served_model_name="tiny-qwen", max_model_len=MAX_LEN, threads=1) as server:
        yield server  # the context manager starts it, waits until it answers, and stops it


@pytest.fixture(scope="module")
def proxy(small_vllm, tmp_path_factory):
    p = ProxyProcess(small_vllm.base_url, tmp_path_factory.mktemp("captures"),
                     confdir=tmp_path_factory.mktemp("mitm")).start()
    try:
        yield p
    finally:
        p.stop()


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_real_overflow_message_keeps_its_counts(small_vllm, proxy):
    long = " ".join(str(i % 10) for i in range(700))  # ~1400 tokens: far over 512
    status, raw = _post(small_vllm.base_url + "/v1/chat/completions",
                        {"model": "tiny-qwen", "messages": [{"role": "user", "content": long}], "max_tokens": 5})
    assert status == 400
    numbers = context_overflow_numbers(raw["error"]["message"])
    assert numbers is not None and numbers[1] == MAX_LEN and numbers[0] > MAX_LEN, raw
    status, ans = _post(proxy.url + "/v1/messages",
                        {"model": "claude-x", "max_tokens": 100, "messages": [{"role": "user", "content": long}]},
                        {"anthropic-version": "2023-06-01", "x-polar-session": "ctx-anthropic"})
    assert status == 400 and ans["error"]["message"] == f"prompt is too long: {numbers[0]} tokens > {MAX_LEN} maximum"
    status, ans = _post(proxy.url + "/v1/chat/completions",
                        {"model": "gpt-x", "messages": [{"role": "user", "content": long}]},
                        {"x-polar-session": "ctx-chat"})
    assert status == 400 and ans["error"]["code"] == "context_length_exceeded"
    assert f"resulted in {numbers[0]} tokens" in ans["error"]["message"]


def test_digit_heavy_prompt_near_the_limit_is_served(proxy):
    digits = " ".join(str(i % 10) for i in range(190))  # ~380 real tokens, ~95 by the old byte guess
    body = {"model": "claude-x", "max_tokens": 400, "messages": [
        {"role": "user", "content": "read the table"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "cat", "input": {"f": "t"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": digits}]}]}
    status, ans = _post(proxy.url + "/v1/messages", body, {"anthropic-version": "2023-06-01",
                                                            "x-polar-session": "near-limit"})
    assert status == 200, ans
    assert ans["usage"]["input_tokens"] + ans["usage"]["output_tokens"] <= MAX_LEN
