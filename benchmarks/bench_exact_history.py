"""Exact-history mode vs the normal path through the proxy: added latency per call, stream time to
first token, proxy CPU per call; and whether later turns were spliced (history labels).

Two proxies in front of the same upstream, one with ``polar_exact_history``; the same multi-turn
chat conversations (with tools) go through each, alternating, whole and streamed.

    python benchmarks/bench_exact_history.py                      # scripted upstream (in-process)
    python benchmarks/bench_exact_history.py --upstream http://127.0.0.1:8000 --model tiny-qwen
        # a real vLLM started with --enable-scale-out (the same served model for both proxies)

Prints per mode: median whole-call latency, median stream TTFT (first content delta), proxy CPU
ms per call, and the ratios exact / normal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_proxy.process import ProxyProcess  # noqa: E402
from polar_testing.scripted_upstream import ServerThread  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def call(url: str, body: dict[str, Any], sid: str) -> tuple[float, float | None, str]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "x-session-id": sid})
    t0 = time.perf_counter()
    ttft = None
    text = ""
    with urllib.request.urlopen(req, timeout=600) as r:
        if not body.get("stream"):
            text = json.loads(r.read())["choices"][0]["message"].get("content") or ""
        else:
            buf = b""
            while True:
                chunk = r.read1(65536)
                if not chunk:
                    break
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    if ev.startswith(b"data: {"):
                        for c in json.loads(ev[6:]).get("choices") or ():
                            delta = (c.get("delta") or {}).get("content")
                            if delta:
                                text += delta
                                if ttft is None:
                                    ttft = time.perf_counter() - t0
    return time.perf_counter() - t0, ttft, text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", default=None)
    ap.add_argument("--model", default="m")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    server = None
    if args.upstream is None:
        server = ServerThread(max_model_len=16384)
        server.start()
        upstream = server.url
    else:
        upstream = args.upstream
    tmp = Path(tempfile.mkdtemp(prefix="bench-exact-"))
    proxies = {"normal": ProxyProcess(upstream, tmp / "normal", upstream_timeout=600).start(),
               "exact": ProxyProcess(upstream, tmp / "exact", upstream_timeout=600,
                                     options={"polar_exact_history": True}).start()}
    results: dict[str, dict[str, list[float]]] = {m: {"whole": [], "ttft": [], "stream": []} for m in proxies}
    cpu = {m: 0.0 for m in proxies}
    calls = {m: 0 for m in proxies}
    try:
        for s in range(args.sessions):
            for stream in (False, True):
                convo = {m: [{"role": "system", "content": "You are a coding agent. " * 20},
                             {"role": "user", "content": f"task {s}: list the files #scenario:text"}] for m in proxies}
                for turn in range(args.turns):
                    for mode, proxy in (list(proxies.items()) if (s + turn) % 2 else list(proxies.items())[::-1]):
                        body = {"model": args.model, "messages": convo[mode], "tools": TOOLS, "stream": stream,
                                "max_tokens": args.max_tokens, "temperature": 1.0}
                        c0 = proc_cpu(proxy.proc.pid)
                        dt, ttft, text = call(proxy.url, body, f"b{s}-{int(stream)}-{mode}")
                        cpu[mode] += proc_cpu(proxy.proc.pid) - c0
                        calls[mode] += 1
                        if stream:
                            results[mode]["stream"].append(dt)
                            if ttft is not None:
                                results[mode]["ttft"].append(ttft)
                        else:
                            results[mode]["whole"].append(dt)
                        convo[mode] = convo[mode] + [{"role": "assistant", "content": text},
                                                     {"role": "user", "content": f"next {turn} #scenario:text"}]
        labels: dict[str, int] = {}
        for f in (tmp / "exact" / "sessions").glob("*.jsonl"):
            for line in f.read_text().splitlines():
                r = json.loads(line)
                key = f"{r.get('history')}/{r.get('history_cause')}"
                labels[key] = labels.get(key, 0) + 1
        med = {m: {k: (statistics.median(v) * 1000 if v else float("nan")) for k, v in d.items()} for m, d in results.items()}
        cpu_ms = {m: cpu[m] * 1000 / max(1, calls[m]) for m in proxies}
        print(f"upstream: {upstream} ({'scripted' if server else 'real'}), {calls['exact']} calls per mode, "
              f"max_tokens={args.max_tokens}")
        for k, name in (("whole", "whole call"), ("ttft", "stream TTFT"), ("stream", "stream total")):
            print(f"  {name:13s} normal {med['normal'][k]:8.1f} ms   exact {med['exact'][k]:8.1f} ms   "
                  f"ratio {med['exact'][k] / med['normal'][k]:.2f}x")
        print(f"  proxy CPU/call normal {cpu_ms['normal']:6.2f} ms   exact {cpu_ms['exact']:6.2f} ms   "
              f"ratio {cpu_ms['exact'] / max(cpu_ms['normal'], 1e-9):.2f}x")
        print(f"  exact-mode history labels: {labels}")
    finally:
        for p in proxies.values():
            p.stop()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
