"""What vLLM 0.32's streaming derender costs, against one whole derender (why exact-history mode
streams the engine's own text deltas and derenders the whole answer once at the end).

Needs a vLLM started with --enable-scale-out (and a tool parser, as Polar serves it)::

    python benchmarks/bench_derender_stream.py --upstream http://127.0.0.1:8000 --model tiny-qwen --tokens 32 128

The streaming derender carries ``stream_state`` between per-chunk calls and replays the parser from the
start each time: one call per generated token costs O(n) per call, O(n^2) per answer.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    args = ap.parse_args()

    def post(path: str, body: Any) -> Any:
        req = urllib.request.Request(args.upstream + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    tools = [{"type": "function", "function": {"name": "bash", "description": "run",
                                               "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
    for n in args.tokens:
        chat = {"model": args.model, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": n,
                "logprobs": True, "seed": 1, "ignore_eos": True}
        g = post("/v1/chat/completions/render", chat)
        ids = post("/inference/v1/generate", g)["choices"][0]["token_ids"]
        whole = []
        for _ in range(5):
            t = time.perf_counter()
            post("/v1/chat/completions/derender", {
                "generate_response": {"request_id": "x", "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length"}]},
                "chat_request": chat, "prompt_token_ids": g["token_ids"][-64:]})
            whole.append(time.perf_counter() - t)
        state, sent = None, 0
        t = time.perf_counter()
        for i, tid in enumerate(ids):
            body = {"stream": True, "stream_state": state, "chat_request": chat, "prompt_token_ids": g["token_ids"],
                    "generate_chunk": {"request_id": "x", "choices": [
                        {"index": 0, "token_ids": [tid], "finish_reason": "length" if i == len(ids) - 1 else None}]}}
            raw = json.dumps(body)
            sent += len(raw)
            state = post("/v1/chat/completions/derender", json.loads(raw))["stream_state"]
        streamed = time.perf_counter() - t
        print(f"{len(ids)} tokens: whole derender {min(whole) * 1000:.1f} ms; streaming derender (one call per token) "
              f"{streamed * 1000:.0f} ms = {streamed * 1000 / len(ids):.1f} ms/token, {sent / 1024:.0f} KiB sent")


if __name__ == "__main__":
    main()
