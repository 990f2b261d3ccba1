"""Bad input: property-based fuzzing of request bodies, headers and paths for each provider.

Over 10,000 cases in total. 10,000 of them run in-process: the addon's own ``request`` hook
inside mitmproxy's test harness (``taddons``/``tflow``), against a real scripted upstream, in
*synthetic* stream mode (the upstream called whole, the stream replayed) so that every answer,
streamed or not, is complete when the hook returns: they fuzz request detection, translation, the
error shapes and the synthetic replay, not the relay. True streaming (the loopback relay, the
stream translators fed chunk by chunk) is fuzzed by the smaller share over real HTTP through
mitmdump (``FZ_HTTP`` per provider, 400 by default). Properties: the hook never raises and never
hangs; every 200 answer is read by the provider's client-side reader (tests/proxy/conftest.py:
the shape an SDK expects, a complete stream or an in-stream error event) and every other answer
is a provider-shaped 4xx/5xx; nothing stays in flight; the proxy process is alive and error-free
at the end.

Inputs: random JSON documents, raw bytes, and mutations of valid requests (real harness fixtures
and small hand-built ones): values replaced at random places by edge values (huge ints, lone
surrogates, NUL, deep nesting, wrong types), keys deleted or added, lists duplicated; random
header sets (session headers, API keys, encodings, Polar's own headers) and path suffixes.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import os
import socket
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polar_core.paths import harness_request_fixtures

REPO = Path(__file__).resolve().parents[3]
FIXTURES = harness_request_fixtures()
#: provider -> (host of the hosted API, Pi fixture)
HOSTS = {"openai_chat": ("api.openai.com", "pi.chat"), "anthropic": ("api.anthropic.com", "pi.anthropic"),
         "openai_responses": ("api.openai.com", "pi.responses"),
         "google": ("generativelanguage.googleapis.com", "pi.gemini")}
PROVIDERS = tuple(HOSTS)
IN_PROCESS = {"mutations": int(os.environ.get("FZ_M", 1500)), "random": int(os.environ.get("FZ_R", 500)), "headers": int(os.environ.get("FZ_H", 500))}  # per provider: 10,000 in all
OVER_HTTP = int(os.environ.get("FZ_HTTP", 100))  # per provider
SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=list(HealthCheck))

KEYS = ["model", "messages", "role", "content", "type", "text", "stream", "tools", "tool_choice", "max_tokens",
        "system", "input", "instructions", "contents", "parts", "functionCall", "functionResponse", "tool_calls",
        "function", "arguments", "name", "id", "tool_use_id", "thinking", "reasoning", "generationConfig",
        "stream_options", "n", "logprobs", "top_logprobs", "temperature", "stop", "previous_response_id",
        "image_url", "inlineData", "metadata", "max_output_tokens", "systemInstruction", "cache_control"]
EDGE = st.sampled_from([None, True, False, 0, -1, 2**31, 2**63, 2**64 + 1, -(2**70), 1e308, -0.0, "", " ", "\x00",
                        "\ud800", "\U0001f600" * 3, "a" * 10_000, [], {}, [[[[[[]]]]]], {"": {"": {"": None}}},
                        "user", "assistant", "system", "tool", "developer", "function_call", "text", "tool_use",
                        "tool_result", "image", "#scenario:tool", "#fault:500", "#fault:cut", "#scenario:length"]).map(copy.deepcopy)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30)
    | EDGE,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8),
                                                                      children, max_size=5),
    max_leaves=20)
HEADER_NAMES = ["content-type", "anthropic-version", "anthropic-beta", "authorization", "x-api-key",
                "x-goog-api-key", "x-polar-session", "x-session-id", "session-id", "x-claude-code-session-id",
                "proxy-authorization", "user-agent", "accept", "content-encoding", "x-polar-task", "x-polar-group",
                "x-polar-sample", "x-polar-harness", "originator", "cookie", "x-stainless-retry-count"]
HEADER_VALUES = st.sampled_from(["", "gzip", "br", "deflate", "identity", "Bearer ", "Bearer polar-", "Bearer polar-ok-1",
                                 "polar-../x", "polar-ok-2", "Basic !!", "Basic b2stMzp4", "application/json",
                                 "text/event-stream", "2023-06-01", "-1", "1e9", "NaN", "\u00e9", "a" * 5000]) \
    | st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, blacklist_characters="\r\n\x7f"), max_size=40)


# ------------------------------------------------------------------------------------------------
# Requests and answers
# ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def seed_bodies(provider: str) -> list[dict]:
    """Valid starting points: a small hand-built request and Pi's real first and second requests
    (cached: callers deep-copy before mutating)."""
    small = {"openai_chat": {"model": "m", "messages": [{"role": "user", "content": "hi #scenario:text"}]},
             "anthropic": {"model": "m", "max_tokens": 64,
                           "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
             "openai_responses": {"model": "m", "input": "hi"},
             "google": {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}}[provider]
    out = [small]
    if FIXTURES is not None:
        for suffix in ("", ".second"):
            out.append(json.loads((FIXTURES / f"{HOSTS[provider][1]}{suffix}.json").read_text())["body"])
    return out


def provider_path(provider: str, stream: bool) -> str:
    if provider == "google":
        return "/v1beta/models/gemini-x:" + ("streamGenerateContent?alt=sse" if stream else "generateContent")
    return {"openai_chat": "/v1/chat/completions", "anthropic": "/v1/messages",
            "openai_responses": "/v1/responses"}[provider]


def base_headers(provider: str, session: str = "fuzz") -> dict[str, str]:
    h = {"content-type": "application/json", "x-polar-session": session}
    if provider == "anthropic":
        h["anthropic-version"] = "2023-06-01"
    return h


def _nodes(doc, path=()):
    """Every (path, value) of a JSON document, containers first."""
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _nodes(v, path + (i,))


def _parent(doc, path):
    for p in path[:-1]:
        doc = doc[p]
    return doc


@st.composite
def mutated(draw, provider: str):
    """A valid request of ``provider`` with 1-4 random mutations."""
    doc = copy.deepcopy(draw(st.sampled_from(seed_bodies(provider))))
    stream = draw(st.booleans())
    if provider != "google" and isinstance(doc, dict):
        doc["stream"] = stream
    for _ in range(draw(st.integers(1, 4))):
        nodes = list(_nodes(doc))
        path, value = nodes[draw(st.integers(0, len(nodes) - 1))]
        op = draw(st.sampled_from(["replace", "delete", "add", "dup"]))
        if not path:
            if op == "replace":
                doc = draw(JSON)
            continue
        parent = _parent(doc, path)
        if op == "replace":
            parent[path[-1]] = draw(JSON)
        elif op == "delete":
            del parent[path[-1]]
        elif op == "add" and isinstance(value, dict):
            value[draw(st.sampled_from(KEYS))] = draw(JSON)
        elif op == "add" and isinstance(value, list):
            value.insert(draw(st.integers(0, len(value))), draw(JSON))
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(value))
    return provider_path(provider, stream), doc


def encode(doc) -> bytes:
    """JSON the way a sloppy client writes it (Python's json: big ints, lone surrogates escaped)."""
    return json.dumps(doc).encode()


ERROR_SHAPES = ("openai_chat", "anthropic", "google")


def expected_shape(provider: str, headers: dict[str, str]) -> str | None:
    """The error shape the caller must get, or None when headers make it ambiguous."""
    names = {k.lower() for k in headers}
    if provider != "anthropic" and "anthropic-version" in names:
        return None
    if provider != "google" and "x-goog-api-key" in names:
        return None
    return provider


def is_model_lookup(body: bytes) -> bool:
    """The proxy's answer to a GET of a model (list) path, in one of the providers' shapes."""
    d = json.loads(body)
    return (d.get("object") in ("model", "list") or d.get("type") == "model" or "models" in d
            or {"name", "supportedGenerationMethods"} <= set(d) or ("data" in d and "has_more" in d))


def check_answer(rel, helpers, provider: str | None, status: int, ctype: str, body: bytes,
                 method: str = "POST") -> None:
    """A valid provider answer, read the way its client reads it (``helpers.parsers``: a complete
    stream or one ending in an error event, a whole answer of the provider's shape, with a finish
    reason unless it carries an error), or a provider-shaped 4xx/5xx error. ``provider`` None: the
    request was ambiguous, any provider's shape will do. A GET may be a model lookup instead."""
    assert 200 <= status < 600 and status not in (204, 304), status
    if status == 200:
        stream = ctype.startswith("text/event-stream")
        assert stream or ctype.startswith("application/json"), ctype
        if method == "GET" and not stream and is_model_lookup(body):
            return
        problems = []
        for shape in [provider] if provider else list(helpers.parsers):
            try:
                parsed = helpers.parsers[shape](body, stream)
                assert parsed.error is not None or parsed.finish is not None, "an answer without a finish reason"
                return
            except (AssertionError, KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
                problems.append(f"{shape}: {exc!r}"[:300])
        raise AssertionError(f"not a valid answer ({'; '.join(problems)}): {body[:300]!r}")
    assert status >= 400, status
    assert ctype.startswith("application/json"), (status, ctype, body[:200])
    if provider is not None:
        rel.error_shape(provider if provider != "openai_responses" else "openai_chat", body)
        return
    errors = []
    for shape in ERROR_SHAPES:
        try:
            rel.error_shape(shape, body)
            return
        except (AssertionError, KeyError, TypeError) as exc:
            errors.append(exc)
    raise AssertionError(f"not a provider-shaped error: {body[:300]!r}")


# ------------------------------------------------------------------------------------------------
# In-process: the addon in mitmproxy's test harness
# ------------------------------------------------------------------------------------------------

class InProcess:
    """One Polar addon on its own event loop, configured like a regular-mode proxy."""

    def __init__(self, upstream_url: str, capture_dir: Path):
        from mitmproxy.test import taddons

        from polar_proxy.addon import Polar

        self.loop = asyncio.new_event_loop()
        self.addon = Polar()
        self.cases = 0

        async def setup():
            self.tctx = taddons.context(self.addon)
            if "connection_strategy" not in self.tctx.options:  # an option of mitmproxy's proxy server
                self.tctx.options.add_option("connection_strategy", str, "lazy", "")
            self.tctx.configure(self.addon, polar_upstream=upstream_url, polar_capture_dir=str(capture_dir),
                                polar_served_model="scripted-model", polar_upstream_timeout="5",
                                polar_stream_mode="synthetic")
            await self.addon.running()

        self.loop.run_until_complete(setup())

    def call(self, method: str, host: str, path: str, headers: dict[str, str], body: bytes):
        from mitmproxy import http
        from mitmproxy.test import tflow

        req = http.Request.make(method, f"https://{host}{path}", body, headers)
        flow = tflow.tflow(req=req)
        flow.response = None
        self.loop.run_until_complete(asyncio.wait_for(self.addon.request(flow), 10))
        self.cases += 1
        assert flow.response is not None, "no answer and not relayed (synthetic mode answers everything)"
        assert flow.request.host == host, "a model call was relayed in synthetic mode"
        resp = flow.response
        return resp.status_code, resp.headers.get("content-type", ""), resp.get_content(strict=False) or b""

    def close(self) -> None:
        self.loop.run_until_complete(self.addon.done())
        self.loop.close()


@pytest.fixture(scope="module")
def inproc(upstream_proc, tmp_path_factory):
    p = InProcess(upstream_proc.url, tmp_path_factory.mktemp("fuzz-captures"))
    try:
        yield p
    finally:
        assert not p.addon.state.calls, "calls left in flight"
        assert p.addon.state.stats["capture_errors"] == 0
        p.close()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_fuzz_mutated_requests(rel, helpers, inproc, provider):
    @settings(max_examples=IN_PROCESS["mutations"], **SETTINGS)
    @given(req=mutated(provider))
    def run(req):
        path, doc = req
        headers = base_headers(provider)
        status, ctype, body = inproc.call("POST", HOSTS[provider][0], path, headers, encode(doc))
        check_answer(rel, helpers, provider, status, ctype, body)

    run()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_fuzz_random_bodies(rel, helpers, inproc, provider):
    @settings(max_examples=IN_PROCESS["random"], **SETTINGS)
    @given(doc=JSON | st.binary(max_size=300).map(lambda b: ("raw", b)), stream=st.booleans(),
           method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]))
    def run(doc, stream, method):
        body = doc[1] if isinstance(doc, tuple) and len(doc) == 2 and doc[0] == "raw" else encode(doc)
        status, ctype, answer = inproc.call(method, HOSTS[provider][0], provider_path(provider, stream),
                                            base_headers(provider), body)
        check_answer(rel, helpers, provider if method == "POST" else None, status, ctype, answer, method)

    run()


@pytest.mark.slow
@pytest.mark.parametrize("provider", PROVIDERS)
def test_fuzz_headers_and_paths(rel, helpers, inproc, provider):
    @settings(max_examples=IN_PROCESS["headers"], **SETTINGS)
    @given(headers=st.dictionaries(st.sampled_from(HEADER_NAMES) | st.from_regex(r"\A[a-z][a-z0-9-]{0,20}\Z"),
                                   HEADER_VALUES, max_size=6),
           suffix=st.sampled_from(["", "?alt=sse", "?key=polar-q1", "?key=../x", "?beta=true", "/", "//", "?x=%00",
                                   "?session_id=a/b", "?key="]),
           prefix=st.sampled_from(["", "/openai", "/v1beta/../v1", "/%2e%2e"]),
           stream=st.booleans(), body_index=st.integers(0, 2))
    def run(headers, suffix, prefix, stream, body_index):
        seeds = seed_bodies(provider)
        doc = copy.deepcopy(seeds[body_index % len(seeds)])
        if provider != "google":
            doc["stream"] = stream
        path = prefix + provider_path(provider, stream) + suffix
        status, ctype, body = inproc.call("POST", HOSTS[provider][0], path, {**base_headers(provider), **headers},
                                          encode(doc))
        check_answer(rel, helpers, None, status, ctype, body)

    run()


# ------------------------------------------------------------------------------------------------
# Over real HTTP, through mitmdump (true streaming)
# ------------------------------------------------------------------------------------------------

def _http(port: int, path: str, headers: dict[str, str], body: bytes) -> tuple[int, str, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type", ""), resp.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_fuzz_over_http(rel, helpers, upstream_proc, proxies):
    proxy = proxies(upstream_proc.url, upstream_timeout=5)
    counter = {"n": 0}
    safe = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30)

    for provider in PROVIDERS:
        @settings(max_examples=OVER_HTTP, **SETTINGS)
        @given(req=mutated(provider), extra=st.dictionaries(st.sampled_from(HEADER_NAMES[:12]), safe, max_size=3))
        def run(req, extra):
            path, doc = req
            headers = {**base_headers(provider, f"fuzz-http-{provider.replace('_', '-')}"), **extra}
            status, ctype, body = _http(proxy.port, path, headers, encode(doc))
            counter["n"] += 1
            check_answer(rel, helpers, expected_shape(provider, extra), status, ctype, body)

        run()
    assert counter["n"] >= len(PROVIDERS) * OVER_HTTP * 0.9
    # still alive, still serving, nothing left behind, no addon error in its log
    path, h, body = rel.build_call("anthropic", "#scenario:text", True, "fuzz-after")
    status, _, data = _http(proxy.port, path, h, body)
    assert rel.is_complete("anthropic", True, status, data)
    status_doc = proxy.control.status()
    assert status_doc["in_flight"] == 0 and status_doc["capture_errors"] == 0
    log = proxy.log_tail(200_000)
    assert "Traceback" not in log and "Addon error" not in log, log[-3000:]
    assert proxy.proc.poll() is None
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5):
        pass
    os.sync()
