"""No API key or auth header value ever reaches the disk (captures or saved flows), and saved
flows carry Polar's annotations (metadata, comment) for mitmweb and flow files."""

from __future__ import annotations

import base64
import time

from mitmproxy import io

SECRETS = ["sk-live-SECRET-openai-0001", "sk-ant-SECRET-0002", "AIza-SECRET-0003", "SECRET-proxy-pass-0004",
           "SECRET-query-key-0005"]


def encoded_forms(secret: str) -> list[bytes]:
    """The secret as it would appear base64-encoded inside any longer encoded string (Basic
    credentials, a JSON-in-base64 blob): the full 4-character groups of each of the three
    alignments, standard and URL-safe alphabets."""
    raw = secret.encode()
    out = []
    for offset in range(3):
        tail = raw[offset:]
        groups = len(tail) // 3 * 4
        for enc in (base64.b64encode, base64.urlsafe_b64encode):
            out.append(enc(tail)[:groups])
    return out


def test_no_secret_on_disk(helpers, upstream, proxy_factory, tmp_path):
    flows = tmp_path / "flows.mitm"
    proxy = proxy_factory(upstream.url, mode="regular", options={"save_stream_file": str(flows)})
    s = SECRETS
    calls = [  # (url, body, headers, provider, stream, the status this call must get)
        ("https://api.openai.com/v1/chat/completions",
         {"model": "gpt", "messages": [{"role": "user", "content": "hi #scenario:text"}]},
         {"authorization": f"Bearer {s[0]}", "x-polar-session": "sec-1"}, "openai_chat", False, 200),
        ("https://api.openai.com/v1/chat/completions",
         {"model": "gpt", "stream": True, "messages": [{"role": "user", "content": "hi #scenario:text"}]},
         {"authorization": f"Bearer {s[0]}", "x-polar-session": "sec-1"}, "openai_chat", True, 200),
        ("https://api.anthropic.com/v1/messages",
         {"model": "claude", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
         {"x-api-key": s[1], "anthropic-version": "2023-06-01", "cookie": f"session={s[1]}"}, "anthropic", True, 200),
        (f"https://generativelanguage.googleapis.com/v1beta/models/g:generateContent?key={s[4]}",
         {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, {"x-goog-api-key": s[2]}, "google", False, 200),
        ("https://api.openai.com/v1/chat/completions",
         {"model": "gpt", "messages": [{"role": "user", "content": "hi #fault:500"}]},
         {"authorization": f"Bearer {s[0]}"}, "openai_chat", False, 500),
    ]
    for url, body, headers, provider, stream, status in calls:
        ans = helpers.request(url, body, headers=headers, proxy=f"http://sec-2:{s[3]}@127.0.0.1:{proxy.port}",
                              cafile=str(proxy.ca_cert))
        assert ans.status == status, (url, ans.status, ans.body[:300])
        if status == 200:  # a real answer, read as the provider's client reads it
            parsed = helpers.parsers[provider](ans.body, stream)
            assert parsed.error is None and parsed.finish and (parsed.text or parsed.tool_calls), parsed
        else:
            assert helpers.parse_error(provider, ans.body)["message"]
    time.sleep(0.2)
    proxy.stop()  # flush the flow file
    files = [p for p in proxy.capture_dir.rglob("*") if p.is_file()] + [flows]
    assert len(files) >= 3 and flows.stat().st_size > 0
    for f in files:
        data = f.read_bytes()
        for secret in SECRETS:
            assert secret.encode() not in data, f"{secret} leaked into {f}"
            for form in encoded_forms(secret):  # e.g. the Basic proxy credentials, base64-encoded
                assert form not in data, f"{secret} leaked base64-encoded ({form!r}) into {f}"
    # the check would see the credentials the client sent (Proxy-Authorization: Basic base64(user:pass))
    assert any(form in base64.b64encode(f"sec-2:{s[3]}".encode()) for form in encoded_forms(s[3]))

    with open(flows, "rb") as fh:
        saved = [f for f in io.FlowReader(fh).stream()
                 if f.type == "http" and "control" not in f.metadata.get("polar", {})]
    assert len(saved) == 5
    anth = next(f for f in saved if f.metadata.get("polar", {}).get("provider") == "anthropic")
    meta = anth.metadata["polar"]
    assert meta["session"] == "sec-2" and meta["status"] == "ok" and meta["sampled_tokens"] > 0
    assert meta["prompt_tokens"] > 0 and meta["finish_reason"]
    assert "session=sec-2#0" in anth.comment and "sampled=" in anth.comment
    failed = [f for f in saved if f.metadata.get("polar", {}).get("status") == "error"]
    assert len(failed) == 1 and failed[0].marked
