"""The scripted upstream speaks vLLM's chat wire format, renders real chat templates when given a
tokenizer, injects faults on demand, and is fast enough to be the benchmark upstream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest

from polar_proxy.process import free_port
from polar_core import paths
from polar_testing.scripted_upstream import DEFAULT_SCENARIOS, ServerThread, token_logprob

TINY = paths.models_dir() / "tiny-qwen"


def _chat(helpers, url, content, **extra):
    body = {"model": "scripted-model", "messages": [{"role": "user", "content": content}],
            "logprobs": True, "return_token_ids": True, **extra}
    return helpers.request(url + "/v1/chat/completions", body)


def test_wire_format(helpers, upstream):
    ans = helpers.request(upstream.url + "/v1/models")
    card = ans.json()["data"][0]
    assert card["id"] == "scripted-model" and card["max_model_len"] == 8192 and card["object"] == "model"

    whole = _chat(helpers, upstream.url, "#scenario:reasoning").json()
    choice = whole["choices"][0]
    assert whole["object"] == "chat.completion" and whole["prompt_token_ids"]
    assert choice["message"]["reasoning"] == DEFAULT_SCENARIOS["reasoning"]["reasoning"]
    assert choice["message"]["content"] == DEFAULT_SCENARIOS["reasoning"]["text"]
    lp = choice["logprobs"]["content"]
    assert len(lp) == len(choice["token_ids"]) and set(lp[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert [e["logprob"] for e in lp] == [token_logprob(t, i) for i, t in enumerate(choice["token_ids"])]
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])

    # the same request whole and streamed: same prompt ids, and the stream's chunks carry the same
    # sampled ids and logprobs, one token per chunk
    tools_whole = _chat(helpers, upstream.url, "#scenario:tools2").json()
    ans = _chat(helpers, upstream.url, "#scenario:tools2", stream=True, stream_options={"include_usage": True})
    events = helpers.sse_events(ans.body)
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == tools_whole["prompt_token_ids"] != whole["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("prompt_token_ids" not in c for c in chunks[1:])  # only in the first chunk
    token_chunks = [c for c in chunks[1:] if c["choices"]]
    assert all(len(c["choices"][0]["token_ids"]) == 1 for c in token_chunks)
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [i for c in token_chunks for i in c["choices"][0]["token_ids"]] == tools_whole["choices"][0]["token_ids"]
    assert [e["logprob"] for c in token_chunks for e in c["choices"][0]["logprobs"]["content"]] == \
        [e["logprob"] for e in tools_whole["choices"][0]["logprobs"]["content"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(token_chunks)
    names = [tc["function"]["name"] for c in token_chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])
             if tc.get("function", {}).get("name")]
    assert names == ["bash", "read"]
    # without return_token_ids there are no ids (vLLM's behaviour)
    plain = helpers.request(upstream.url + "/v1/chat/completions",
                            {"model": "scripted-model", "messages": [{"role": "user", "content": "x"}]}).json()
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None


def test_faults(helpers, upstream):
    ans = _chat(helpers, upstream.url, "#fault:429")
    assert ans.status == 429 and ans.headers["retry-after"] == "7" and ans.json()["error"]["code"] == 429
    assert _chat(helpers, upstream.url, "#fault:500").status == 500
    ans = _chat(helpers, upstream.url, "#fault:context")
    assert ans.status == 400 and "maximum context length" in ans.json()["error"]["message"]
    ans = helpers.request(upstream.url + "/v1/chat/completions", {"model": "other", "messages": []})
    assert ans.status == 404
    with pytest.raises(Exception):
        _chat(helpers, upstream.url, "#fault:refuse")
    with pytest.raises(Exception):  # chunked body never terminated
        _chat(helpers, upstream.url, "#fault:cut #scenario:words:10", stream=True)
    assert _chat(helpers, upstream.url, "#scenario:length", max_tokens=3).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.skipif(not (TINY / "tokenizer_config.json").exists(), reason="tiny-qwen not built")
def test_real_chat_template_prompt_ids(helpers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    tools = [{"type": "function", "function": {"name": "bash", "description": "run",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with ServerThread(tokenizer=tok) as server:
        ans = helpers.request(server.url + "/v1/chat/completions",
                              {"model": "scripted-model", "messages": messages, "tools": tools,
                               "return_token_ids": True}).json()
    expected_msgs = [dict(m) for m in messages]
    expected_msgs[2]["tool_calls"] = [{**messages[2]["tool_calls"][0],
                                       "function": {"name": "bash", "arguments": {"command": "ls"}}}]
    want = tok.apply_chat_template(expected_msgs, tools=tools, add_generation_prompt=True, tokenize=True)
    assert ans["prompt_token_ids"] == list(want)
    ids = ans["choices"][0]["token_ids"]
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(ids[:-1]) == DEFAULT_SCENARIOS["text"]["text"]  # turn 1 of the default script


def test_cli_and_throughput(tmp_path):
    """``python -m polar_testing.scripted_upstream`` serves; hundreds of requests per second at least."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "polar_testing.scripted_upstream", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        rate = asyncio.run(_hammer(f"http://127.0.0.1:{port}", 600, 16))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"scripted upstream: {rate:.0f} req/s (non-streaming, 16 concurrent, one shared CPU)")
    assert rate > 300


async def _hammer(url: str, n: int, concurrency: int) -> float:
    body = json.dumps({"model": "scripted-model", "messages": [{"role": "user", "content": "hi #scenario:text"}],
                       "logprobs": True, "return_token_ids": True}).encode()
    async with aiohttp.ClientSession() as s:
        for _ in range(100):
            try:
                async with s.get(url + "/v1/models") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
        sem = asyncio.Semaphore(concurrency)

        async def one():
            async with sem, s.post(url + "/v1/chat/completions", data=body,
                                   headers={"content-type": "application/json"}) as r:
                assert r.status == 200
                await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0)


def test_script_file_per_session(helpers, tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"alice": [{"text": "A0"}, {"text": "A1"}], "*": ["words:2"]}))
    from polar_testing.scripted_upstream import Script

    with ServerThread(script=Script.load(script)) as server:
        def ask(session, n_assistant):
            msgs = [{"role": "user", "content": "q"}]
            for _ in range(n_assistant):
                msgs += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "q"}]
            return helpers.request(server.url + "/v1/chat/completions", {"model": "scripted-model", "messages": msgs},
                                   headers={"x-polar-session": session}).json()["choices"][0]["message"]["content"]

        # alice's turns in order (then round again), any other session the "*" entry
        assert [ask("alice", 0), ask("alice", 1), ask("alice", 2), ask("bob", 0), ask("bob", 1)] == \
            ["A0", "A1", "A0", "w0 w1", "w0 w1"]
