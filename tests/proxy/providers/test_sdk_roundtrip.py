"""The vendors' own SDKs accept what the translators emit: whole answers parse into the SDK's
types, streams go through the SDK's stream parsers (openai ``chat.completions.stream`` and
``responses.stream``, anthropic ``messages.stream``, google-genai ``generate_content_stream``),
and each reconstructs the same text, reasoning and tool calls; errors become the SDK's error
classes with the codes harnesses look for. The SDKs live in their own venv
($POLAR_HOME/venvs/sdk-check) because they need a newer h11 than mitmproxy allows."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_proxy.providers import PROVIDERS, NormalizedCall, detect_provider
from polar_core.paths import polar_home

pytestmark = pytest.mark.slow

SDK_REQUIREMENTS = ("openai==3.57.0", "anthropic==2.14.0", "google-genai==3.6.1")
SCRIPT = Path(__file__).with_name("sdk_check.py")
SCENARIOS = ("text", "reasoning", "one_tool", "two_tools", "length", "length_empty")
VLLM_OVERFLOW = ("This model's maximum context length is 32768 tokens. However, you requested "
                 "40000 tokens (39000 in the messages, 1000 in the completion).")
FINISH = {
    "openai_chat": {"stop": "stop", "tool_calls": "tool_calls", "length": "length"},
    "openai_responses": {"stop": "completed", "tool_calls": "completed", "length": "incomplete"},
    "anthropic": {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"},
    "google": {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS"},
}


def ensure_sdk_venv() -> Path:
    """Create (once, under a file lock) the venv with the pinned SDKs; reuse it afterwards."""
    venv = polar_home() / "venvs" / "sdk-check"
    python = venv / "bin" / "python"
    stamp = venv / ".polar-stamp"
    want = " ".join(SDK_REQUIREMENTS)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".sdk-check.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.exists() and stamp.read_text() == want:
            return python
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                       timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *SDK_REQUIREMENTS], check=True, timeout=900)
        stamp.write_text(want)
    return python


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    return ensure_sdk_venv()


def _call(provider: str) -> NormalizedCall:
    options = {"include_usage": True} if provider == "openai_chat" else {}
    return NormalizedCall(chat_request={}, stream=True, requested_model="asked-model",
                          options=options)


def build_cases(h) -> list[dict]:
    cases = []

    def add(**case):
        case["id"] = len(cases)
        cases.append(case)

    for provider in PROVIDERS:
        p = PROVIDERS[provider]
        for name in SCENARIOS:
            s = h.scenario(name)
            whole = p.from_chat(h.completion(s), "asked-model", _call(provider))
            add(sdk=provider, stream=False, status=200, content_type="application/json",
                body=json.dumps(whole, ensure_ascii=False), scenario=name)
            raw = h.run_stream(p.new_stream("asked-model", _call(provider)), h.chunks(s))
            add(sdk=provider, stream=True, status=200, content_type="text/event-stream",
                body=raw.decode(), scenario=name)
        status, body = p.error_response(400, "context_length", VLLM_OVERFLOW)
        add(sdk=provider, stream=False, status=status, content_type="application/json",
            body=json.dumps(body), scenario="context_length")
        stream = p.new_stream("asked-model", _call(provider))
        head = h.chunks(h.scenario("text"))[:3]
        raw = b"".join(stream.feed(c) for c in head) + stream.fail("upstream_error", "engine died")
        add(sdk=provider, stream=True, status=200, content_type="text/event-stream",
            body=raw.decode(), scenario="midstream_failure")
    return cases


@pytest.fixture(scope="module")
def sdk_results(h, sdk_python, tmp_path_factory):
    cases = build_cases(h)
    path = tmp_path_factory.mktemp("sdk") / "cases.json"
    path.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and
           not k.endswith("_proxy")}  # talk to the loopback server directly
    proc = subprocess.run([str(sdk_python), str(SCRIPT), str(path)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    return [(case, result) for case, result in zip(cases, results, strict=True)]


@pytest.mark.parametrize("provider", list(FINISH))
def test_sdk_reconstructs_answers(sdk_results, h, provider):
    checked = 0
    for case, result in sdk_results:
        if case["sdk"] != provider or case["scenario"] not in SCENARIOS:
            continue
        where = f"{provider} {case['scenario']} stream={case['stream']}"
        assert result["ok"], (where, result.get("error"), result.get("trace"))
        s = h.scenario(case["scenario"])
        want = h.expected(s)
        assert result["text"] == want["text"], where
        assert result["reasoning"] == want["reasoning"], where
        assert [tuple(t) for t in result["tools"]] == want["tools"], where
        assert result["finish"] == FINISH[provider][s["finish"]], where
        assert result["model"] == "asked-model", where
        assert result["usage"] == 17, where
        # the SDK's own path is one the proxy recognizes as this provider
        assert detect_provider("POST", result["seen_path"], {}, {}).name == provider, where
        if provider == "google":
            assert result["seen_path"].endswith(
                ":streamGenerateContent?alt=sse" if case["stream"] else ":generateContent")
        checked += 1
    assert checked == 2 * len(SCENARIOS)


def test_sdk_errors(sdk_results):
    errors = {(c["sdk"], c["scenario"]): r for c, r in sdk_results
              if c["scenario"] in ("context_length", "midstream_failure")}
    assert len(errors) == 8
    assert not any(r["ok"] for r in errors.values()), errors
    e = errors[("openai_chat", "context_length")]["error"]
    assert e["class"] == "BadRequestError" and e["code"] == "context_length_exceeded"
    e = errors[("openai_responses", "context_length")]["error"]
    assert e["class"] == "BadRequestError" and e["code"] == "context_length_exceeded"
    e = errors[("anthropic", "context_length")]["error"]
    assert e["class"] == "BadRequestError" and e["status_code"] == 400
    assert "prompt is too long: 40000 tokens > 32768 maximum" in e["message"]
    e = errors[("google", "context_length")]["error"]
    assert e["class"] == "ClientError" and e["code"] == 400 and e["status"] == "INVALID_ARGUMENT"
    mid = {"openai_chat": "APIError", "anthropic": "APIStatusError", "google": "ServerError",
           "openai_responses": "RuntimeError"}  # the last: our script's reaction to response.failed
    for provider, cls in mid.items():
        e = errors[(provider, "midstream_failure")]["error"]
        assert e["class"] == cls and "engine died" in e["message"], (provider, e)
