"""Upstream faults under load: each becomes an error in the caller's provider shape within the
configured timeout, leaves a capture record, and the proxy keeps serving every other session.

Faults come from the scripted upstream (directives in the user text): HTTP 500, 429 with
Retry-After, a hang before any byte, a hang mid-stream, a stream cut mid-way, a connection dropped
before the answer; plus a real connection refusal (nothing listening) and recovery when the server
comes back on that port.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from polar_core.net import OPENER  # never via HTTP(S)_PROXY

TIMEOUT = 1.5  # polar_upstream_timeout of these proxies
#: fault -> (streams it applies to, expected status, expected error kinds in the record)
FAULTS = {
    "500": ((False, True), 500, {"upstream_error"}),
    "429": ((False, True), 429, {"rate_limited"}),
    "hang": ((False, True), 504, {"timeout"}),
    "refuse": ((False, True), 502, {"upstream_refused", "upstream_error"}),
    "cut": ((True,), 200, {"upstream_error"}),  # headers already sent: the error is in the stream
    "hang_stream": ((True,), 200, {"timeout"}),
}
HEALTHY = "#scenario:words:8 #delay:2"


def _session(fault: str, provider: str, stream: bool) -> str:
    return f"fault-{fault.replace('_', '-')}-{provider.replace('_', '-')}-{int(stream)}"


def _fault_of(session: str) -> str:
    return max((f for f in FAULTS if session.startswith(f"fault-{f.replace('_', '-')}-")), key=len)


def _check_answer(rel, r, fault: str) -> None:
    streams, status, _ = FAULTS[fault]
    assert r.error is None, f"{r.provider}/{fault}: transport error {r.error}"
    assert r.status == status, f"{r.provider}/{fault}/stream={r.stream}: HTTP {r.status} {r.body[:300]!r}"
    limit = TIMEOUT + 3.0  # the configured timeout, plus room for a loaded CI machine
    assert r.seconds < limit, f"{r.provider}/{fault} took {r.seconds:.2f}s"
    if fault.startswith("hang"):
        assert r.seconds >= TIMEOUT * 0.9
    if status == 200:
        err = rel.stream_error(r.provider, r.body)
        assert err is not None and err.get("message"), f"{r.provider}/{fault}: no in-stream error in {r.body[-300:]!r}"
    else:
        err = rel.error_shape(r.provider, r.body)
        assert err["message"]


@pytest.mark.slow
def test_faults_answer_in_shape_and_others_keep_going(rel, upstream_proc, proxies):
    import aiohttp

    proxy = proxies(upstream_proc.url, upstream_timeout=TIMEOUT)
    load = rel.Load(proxy.url)
    stop = asyncio.Event()

    async def healthy(k: int, s: aiohttp.ClientSession) -> None:
        i = 0
        while not stop.is_set():
            provider = rel.PROVIDERS[(k + i) % 4]
            await load.call(s, provider, HEALTHY, i % 2 == 0, f"healthy-{k}", f"h-{k}-{i}")
            i += 1

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            background = [asyncio.create_task(healthy(k, s)) for k in range(8)]
            await asyncio.sleep(0.3)
            faulty = []
            for fault, (streams, _, _) in FAULTS.items():
                for provider in rel.PROVIDERS:
                    for stream in streams:
                        sid = _session(fault, provider, stream)
                        faulty.append(load.call(s, provider, f"#scenario:words:20 #fault:{fault}", stream, sid,
                                                f"f-{sid}"))
            results = await asyncio.gather(*faulty)
            await asyncio.sleep(0.3)  # the healthy sessions go on after the faults too
            stop.set()
            await asyncio.gather(*background)
            return results

    t0 = time.monotonic()
    faulty = asyncio.run(main())
    assert time.monotonic() - t0 < TIMEOUT + 8
    for r in faulty:
        _check_answer(rel, r, _fault_of(r.session))

    healthy_results = [r for r in load.results if r.session.startswith("healthy-")]
    bad = [(r.provider, r.status, r.error, r.body[:200]) for r in healthy_results if not r.complete]
    assert len(healthy_results) >= 16 and not bad, bad[:3]

    # every fault is recorded, with its kind; the healthy calls are all recorded as ok
    sessions = proxy.capture_dir / "sessions"
    for r in faulty:
        fault = _fault_of(r.session)
        records = rel.read_jsonl(sessions / f"{r.session}.jsonl")
        assert len(records) == 1, (r.session, len(records))
        rec = records[0]
        assert rec["status"] == "error" and rec["error_kind"] in FAULTS[fault][2], (r.session, rec["error_kind"])
        assert rec["provider"] == r.provider and rec["stream"] == r.stream and rec["http_status"] == r.status
        if fault in ("cut", "hang_stream"):
            assert rec["prompt_token_ids"], "what the upstream sent before failing is kept"
        if fault == "cut":
            assert rec["sampled_token_ids"] and len(rec["sampled_logprobs"]) == len(rec["sampled_token_ids"])
    ok_records = sum(1 for f in sessions.glob("healthy-*.jsonl") for rec in rel.read_jsonl(f) if rec["status"] == "ok")
    assert ok_records == len(healthy_results)
    assert proxy.control.status()["in_flight"] == 0


@pytest.mark.slow
def test_connection_refused_then_recovery(rel, proxies):
    """Nothing listens on the upstream port: provider-shaped 502 at once, recorded; once a server
    comes up on that port, the proxy serves again (after its short backoff)."""
    up = rel.UpstreamProcess()
    proxy = proxies(up.url, upstream_timeout=TIMEOUT)
    for provider in rel.PROVIDERS:
        for stream in (False, True):
            path, headers, body = rel.build_call(provider, "hi", stream, "refused-1")
            t0 = time.monotonic()
            ans = _post(proxy.url + path, body, headers)
            assert time.monotonic() - t0 < TIMEOUT  # refused at once, never waiting for the timeout
            assert ans[0] == 502 and "refused" in rel.error_shape(provider, ans[1])["message"]
    records = rel.read_jsonl(proxy.capture_dir / "sessions" / "refused-1.jsonl")
    assert len(records) == 8 and {r["error_kind"] for r in records} == {"upstream_refused"}
    assert all(r["t_upstream_sent"] is None for r in records)

    up.start()
    try:
        deadline = time.monotonic() + 35  # backoff is exponential from 0.5 s, capped at 30 s
        status = None
        while time.monotonic() < deadline:
            path, headers, body = rel.build_call("anthropic", "#scenario:text", False, "refused-2")
            status, data = _post(proxy.url + path, body, headers)
            if status == 200:
                break
            time.sleep(0.25)
        assert status == 200 and rel.is_complete("anthropic", False, status, data)
        for provider in rel.PROVIDERS:  # and keeps serving, streamed too
            path, headers, body = rel.build_call(provider, "#scenario:text", True, "refused-2")
            status, data = _post(proxy.url + path, body, headers)
            assert rel.is_complete(provider, True, status, data), data[:300]
        assert proxy.control.status()["upstreams"][0]["healthy"] is True
    finally:
        up.stop()


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with OPENER.open(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
