"""Live check (heavy: starts vLLM; run under `flock /tmp/polar-heavy.lock`): vLLM serving tiny-r1 with its
deepseek_r1 reasoning parser, the proxy in exact-history mode, three chat turns (streamed, whole, streamed)
re-sending the reasoning; prints what the harness got and each record's history label and cause.

    .venv/bin/python benchmarks/check_reasoning_exact.py
"""
import json
import sys
import tempfile
import time

import requests

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from polar_runtime.serve import VLLMServer  # noqa: E402
from polar_proxy.process import ProxyProcess  # noqa: E402

t0 = time.time()
with VLLMServer("tiny-r1", max_model_len=2048, threads=2) as srv:
    print("vllm up", round(time.time() - t0), "s", srv.command()[-6:], flush=True)
    base = srv.base_url
    tk = lambda s: requests.post(base + "/tokenize", json={"model": "tiny-r1", "prompt": s, "add_special_tokens": False}).json()
    print("think ids", tk("<think>")["tokens"], tk("</think>")["tokens"])
    ok = tk("ok")["tokens"]
    chat = {"model": "tiny-r1", "messages": [{"role": "user", "content": "hi"}]}
    d = requests.post(base + "/v1/chat/completions/derender", json={
        "model": "tiny-r1", "generate_response": {"request_id": "x", "choices": [
            {"index": 0, "token_ids": ok, "finish_reason": "length", "stop_reason": None}], "prompt_token_ids": [1]},
        "prompt_token_ids": [1], "chat_request": chat})
    print("derender unmarked", d.status_code, d.text[:300])
    with tempfile.TemporaryDirectory() as cap:
        proxy = ProxyProcess(base, cap, options={"polar_exact_history": True}).start()
        try:
            msgs = [{"role": "user", "content": "What is 2+2?"}]
            for turn in range(3):
                stream = turn != 1
                body = {"model": "tiny-r1", "messages": msgs, "max_tokens": 24, "stream": stream, "seed": 7 + turn,
                        "temperature": 1.0}
                r = requests.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "live-r1"},
                                  stream=stream, timeout=120)
                content, reasoning = "", ""
                if stream:
                    for line in r.iter_lines():
                        if line.startswith(b"data: ") and line != b"data: [DONE]":
                            for c in json.loads(line[6:]).get("choices") or ():
                                dl = c.get("delta") or {}
                                content += dl.get("content") or ""
                                reasoning += dl.get("reasoning") or dl.get("reasoning_content") or ""
                else:
                    m = r.json()["choices"][0]["message"]
                    content, reasoning = m.get("content") or "", m.get("reasoning") or m.get("reasoning_content") or ""
                print(f"turn {turn} stream={stream} status={r.status_code} content={content!r:.80} reasoning={reasoning!r:.80}")
                msgs += [{"role": "assistant", "content": content, **({"reasoning": reasoning} if reasoning else {})},
                         {"role": "user", "content": f"and {turn}?"}]
            time.sleep(1)
            import glob
            for f in glob.glob(cap + "/sessions/*.jsonl"):
                for line in open(f):
                    rec = json.loads(line)
                    print("record", rec.get("call_index"), rec.get("history"), rec.get("history_cause"),
                          len(rec.get("sampled_token_ids") or []), (rec.get("translation_notes") or [])[:3])
        finally:
            proxy.stop()
print("total", round(time.time() - t0), "s")
