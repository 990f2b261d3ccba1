"""Added latency of the proxy per call (median), versus calling the scripted upstream directly.

Same client and connection policy on both paths (one keep-alive connection, as SDKs use, or a
fresh connection per call), sequential calls so the number is latency, not throughput. Printed for
the record. The latency *goal* lives in the benchmark (benchmarks/bench_proxy.py: ~2 ms added p50,
<= 0.25x LiteLLM's), measured on a quiet machine; this test runs on a small shared CI machine, so
its bound is a sanity bound, far above the goal (so a loaded machine does not fail it) and below
what the faults it is there for cost: a call that waits on a poll interval, a retry back-off or a
timeout (the proxy's upstream timeout here is 1.5 s) -- hundreds of milliseconds and more.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time

import pytest

N = 40
#: Added median latency beyond which something is broken, not merely slow (see the docstring).
SANITY_BOUND_S = 0.2


def _cpu_seconds(pid: int) -> float:
    """User+system CPU of a process: the proxy's cost per call, whatever the machine's load."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client:
    """Sequential calls on one keep-alive connection (what SDKs do), or a fresh one per call."""

    def __init__(self, port: int, keep_alive: bool):
        self.port, self.keep_alive, self.conn = port, keep_alive, None

    def __call__(self, path: str, body: bytes, headers: dict[str, str]) -> float:
        t0 = time.perf_counter()
        if self.conn is None or not self.keep_alive:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        self.conn.request("POST", path, body=body, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if not self.keep_alive:
            self.conn.close()
        assert resp.status == 200 and data
        return time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize("keep_alive", [True, False], ids=["keepalive", "fresh-conn"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_added_latency_median(upstream, reverse_proxy, stream, keep_alive, capsys):
    text = "hi #scenario:text"
    direct_body = json.dumps({"model": "scripted-model", "stream": stream, "logprobs": True, "return_token_ids": True,
                              "messages": [{"role": "user", "content": text}]}).encode()
    proxy_body = json.dumps({"model": "gpt-x", "stream": stream, "messages": [{"role": "user", "content": text}]}).encode()
    h = {"content-type": "application/json"}
    hp = {**h, "x-polar-session": "latency"}
    to_upstream = _Client(int(upstream.url.rsplit(":", 1)[1]), keep_alive)
    to_proxy = _Client(reverse_proxy.port, keep_alive)
    for _ in range(10):  # warm up both paths
        to_upstream("/v1/chat/completions", direct_body, h)
        to_proxy("/v1/chat/completions", proxy_body, hp)
    direct, proxied = [], []
    cpu0 = _cpu_seconds(reverse_proxy.proc.pid)
    for _ in range(N):  # interleaved, so load changes on the shared machine hit both alike
        direct.append(to_upstream("/v1/chat/completions", direct_body, h))
        proxied.append(to_proxy("/v1/chat/completions", proxy_body, hp))
    cpu_per_call = (_cpu_seconds(reverse_proxy.proc.pid) - cpu0) / N
    d, p = statistics.median(direct), statistics.median(proxied)
    with capsys.disabled():
        print(f"\n[latency {'stream' if stream else 'whole'}, {'keep-alive' if keep_alive else 'fresh connection'}] "
              f"direct median {d * 1e3:.2f} ms, through proxy {p * 1e3:.2f} ms, added {(p - d) * 1e3:.2f} ms "
              f"(n={N}, load average {os.getloadavg()[0]:.1f}); proxy CPU {cpu_per_call * 1e3:.2f} ms per call")
    assert p - d < SANITY_BOUND_S, f"added {(p - d) * 1e3:.1f} ms per call: waiting on something"
