"""Added latency of the proxy per call (median), versus calling the scripted upstream directly.

Same client, same keep-alive policy (a fresh connection per call on both paths), sequential
calls so the number is latency, not throughput. Printed for the record; the bound is loose
because the CI machine is small and shared.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time

import pytest

N = 150


def _timed(port: int, path: str, body: bytes, headers: dict[str, str]) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    assert resp.status == 200 and data
    return time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_added_latency_median(upstream, reverse_proxy, stream, capsys):
    text = "hi #scenario:text"
    direct_body = json.dumps({"model": "scripted-model", "stream": stream, "logprobs": True, "return_token_ids": True,
                              "messages": [{"role": "user", "content": text}]}).encode()
    proxy_body = json.dumps({"model": "gpt-x", "stream": stream, "messages": [{"role": "user", "content": text}]}).encode()
    up_port = int(upstream.url.rsplit(":", 1)[1])
    h = {"content-type": "application/json"}
    for _ in range(10):  # warm up both paths
        _timed(up_port, "/v1/chat/completions", direct_body, h)
        _timed(reverse_proxy.port, "/v1/chat/completions", proxy_body, {**h, "x-polar-session": "latency"})
    direct, proxied = [], []
    for _ in range(N):  # interleaved, so load changes on the shared machine hit both alike
        direct.append(_timed(up_port, "/v1/chat/completions", direct_body, h))
        proxied.append(_timed(reverse_proxy.port, "/v1/chat/completions", proxy_body, {**h, "x-polar-session": "latency"}))
    d, p = statistics.median(direct), statistics.median(proxied)
    with capsys.disabled():
        print(f"\n[latency {'stream' if stream else 'whole'}] direct median {d * 1e3:.2f} ms, "
              f"through proxy {p * 1e3:.2f} ms, added {(p - d) * 1e3:.2f} ms (n={N})")
    assert p - d < 0.050
