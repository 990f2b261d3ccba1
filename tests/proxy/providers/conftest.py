"""Shared pieces of the provider tests: real harness requests, vLLM-shaped answers and chunk
streams (split at awkward places), and parsers that read our SSE output back the way a client
would. Exposed through fixtures because test modules cannot import each other."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qsl

import pytest
from polar_core.paths import harness_request_fixtures

REPO = Path(__file__).resolve().parents[3]
FIXTURES = harness_request_fixtures()


def load_request(name: str) -> dict[str, Any]:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    path, _, qs = data["path"].partition("?")
    data["query"] = dict(parse_qsl(qs))
    return data


# ---------------------------------------------------------------------------------------------
# vLLM-shaped answers
# ---------------------------------------------------------------------------------------------

SPLITS = (1, 4, 2, 7, 3, 1, 5)  # cycled piece sizes: cuts JSON inside keys, strings and escapes


def split_awkwardly(text: str) -> list[str]:
    pieces, i, k = [], 0, 0
    while i < len(text):
        n = SPLITS[k % len(SPLITS)]
        pieces.append(text[i:i + n])
        i += n
        k += 1
    return pieces


def scenario(name: str) -> dict[str, Any]:
    """What the model 'generated' in each test scenario."""
    s = {
        "text": dict(content="Hello, wörld! ✓ done.\nSecond line.", finish="stop"),
        "reasoning": dict(reasoning="Let me think: 2+2 is 4.", content="The answer is 4.",
                          finish="stop"),
        "one_tool": dict(tools=[("chatcmpl-tool-aaa111", "bash",
                                 json.dumps({"command": 'echo "hi" > hi.txt && cat hi.txt'}))],
                         finish="tool_calls"),
        "two_tools": dict(content="I'll check both.",
                          tools=[("chatcmpl-tool-bbb222", "read", json.dumps({"path": "a b.txt"})),
                                 ("chatcmpl-tool-ccc333", "bash",
                                  json.dumps({"command": "ls -la", "timeout": 5}))],
                          finish="tool_calls"),
        "length": dict(content="This answer was cut sho", finish="length"),
        "length_empty": dict(content="", finish="length"),
    }[name]
    s.setdefault("reasoning", "")
    s.setdefault("content", "")
    s.setdefault("tools", [])
    s["usage"] = {"prompt_tokens": 120, "completion_tokens": 17, "total_tokens": 137,
                  "prompt_tokens_details": {"cached_tokens": 20}}
    return s


SCENARIOS = ("text", "reasoning", "one_tool", "two_tools", "length", "length_empty")


def completion(s: dict[str, Any]) -> dict[str, Any]:
    """A whole vLLM chat.completion, with the engine-only fields vLLM adds for RL."""
    message: dict[str, Any] = {"role": "assistant", "content": s["content"] or None,
                               "reasoning": s["reasoning"] or None}
    if s["tools"]:
        message["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": name, "arguments": args}}
                                 for cid, name, args in s["tools"]]
    return {
        "id": "chatcmpl-9f8e7d6c5b4a",
        "object": "chat.completion",
        "created": 1764500000,
        "model": "served-model",
        "choices": [{"index": 0, "message": message, "finish_reason": s["finish"],
                     "stop_reason": None, "token_ids": [1, 2, 3],
                     "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97],
                                               "top_logprobs": [{"token": "a", "logprob": -0.5}]}]}}],
        "usage": s["usage"],
        "prompt_token_ids": [151644, 8948, 198],
        "prompt_logprobs": None,
    }


def chunks(s: dict[str, Any], name_late: bool = False) -> list[dict[str, Any]]:
    """The same answer as a vLLM stream: role chunk (with prompt_token_ids), reasoning and text
    pieces, tool calls (id+name first, arguments in awkward fragments), a finish chunk and a
    usage-only chunk. ``name_late`` sends a tool's first argument fragment before its name."""
    head = {"id": "chatcmpl-9f8e7d6c5b4a", "object": "chat.completion.chunk",
            "created": 1764500000, "model": "served-model"}
    out = []
    tok = iter(range(1000, 100000))

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        c = dict(head, choices=[{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish, "token_ids": [next(tok)]}])
        c.update(extra)
        return c

    out.append(chunk({"role": "assistant", "content": ""}, prompt_token_ids=[151644, 8948, 198]))
    for piece in split_awkwardly(s["reasoning"]):
        out.append(chunk({"reasoning": piece}))
    for piece in split_awkwardly(s["content"]):
        out.append(chunk({"content": piece}))
    for i, (cid, name, args) in enumerate(s["tools"]):
        pieces = split_awkwardly(args)
        if name_late:
            out.append(chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                              "function": {"arguments": pieces[0]}}]}))
            out.append(chunk({"tool_calls": [{"index": i, "function": {"name": name}}]}))
            pieces = pieces[1:]
        else:
            out.append(chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                              "function": {"name": name, "arguments": ""}}]}))
        for piece in pieces:
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    out.append(chunk({}, s["finish"]))
    out.append(dict(head, choices=[], usage=s["usage"]))
    return out


# ---------------------------------------------------------------------------------------------
# Reading our SSE output back
# ---------------------------------------------------------------------------------------------


def parse_sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) per event; ``[DONE]`` stays a string."""
    events = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].lstrip().decode())
            else:
                raise AssertionError(f"unexpected SSE line {line!r}")
        payload = "\n".join(data)
        events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return events


def expected(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "reasoning": s["reasoning"],
        "text": s["content"],
        "tools": [(cid, name, json.loads(args)) for cid, name, args in s["tools"]],
    }


def run_stream(translator: Any, stream: list[dict[str, Any]]) -> bytes:
    return b"".join(translator.feed(c) for c in stream) + translator.finish()


@pytest.fixture
def fixture_dir() -> Path:
    assert FIXTURES.is_dir(), f"harness request fixtures not found at {FIXTURES}"
    return FIXTURES


@pytest.fixture(scope="session")
def h() -> SimpleNamespace:
    return SimpleNamespace(
        load_request=load_request, scenario=scenario, completion=completion, chunks=chunks,
        parse_sse=parse_sse, expected=expected, run_stream=run_stream,
        split_awkwardly=split_awkwardly,
    )
