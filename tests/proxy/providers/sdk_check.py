"""Runs inside the sdk-check venv (openai, anthropic, google-genai; never the main venv, whose
mitmproxy pins h11 below what the SDKs need). Serves canned answers made by our translators from
a one-shot loopback HTTP server and lets each vendor SDK parse them, whole and streamed.

    python sdk_check.py CASES.json   ->   JSON list of what each SDK reconstructed, on stdout

A case: {"id", "sdk": openai_chat|openai_responses|anthropic|google, "stream": bool,
"status": int, "content_type": str, "body": str}. Nothing from Polar is imported here.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CASES: dict[str, dict] = {}
MODEL = "asked-model"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the answer ends when the connection closes, like a stream

    def do_POST(self) -> None:  # noqa: N802 (http.server naming)
        m = re.match(r"^/case/(\d+)/", self.path)
        case = CASES.get(m.group(1)) if m else None
        length = int(self.headers.get("Content-Length") or 0)
        request = self.rfile.read(length)
        if case is None:
            self.send_error(404)
            return
        case["seen_path"] = self.path[len(m.group(0)) - 1:]
        case["seen_body"] = json.loads(request or b"null")
        self.send_response(case["status"])
        self.send_header("Content-Type", case["content_type"])
        self.end_headers()
        body = case["body"].encode()
        for i in range(0, len(body), 61):  # odd-sized writes: events and UTF-8 split across reads
            self.wfile.write(body[i:i + 61])
            self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


def tools_of(pairs):
    return [[i, n, a] for i, n, a in pairs]


def run_openai_chat(base: str, case: dict) -> dict:
    import openai

    client = openai.OpenAI(api_key="sk-test", base_url=base + "v1", max_retries=0, timeout=20)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    if not case["stream"]:
        r = client.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        return {"model": r.model, "text": msg.content or "",
                "reasoning": (msg.model_extra or {}).get("reasoning") or "",
                "tools": tools_of((t.id, t.function.name, json.loads(t.function.arguments))
                                  for t in msg.tool_calls or []),
                "finish": r.choices[0].finish_reason, "usage": r.usage.completion_tokens}
    reasoning, usage = "", None
    try:
        with client.chat.completions.stream(**kwargs, stream_options={"include_usage": True}) as s:
            for event in s:
                if event.type == "chunk" and event.chunk.choices:
                    delta = event.chunk.choices[0].delta
                    reasoning += (delta.model_extra or {}).get("reasoning") or ""
                elif event.type == "chunk" and event.chunk.usage:
                    usage = event.chunk.usage.completion_tokens
            final = s.get_final_completion()
    except openai.LengthFinishReasonError as exc:  # the helper's verdict on finish=length
        final = exc.completion
    msg = final.choices[0].message
    return {"model": final.model, "text": msg.content or "", "reasoning": reasoning,
            "tools": tools_of((t.id, t.function.name, json.loads(t.function.arguments))
                              for t in msg.tool_calls or []),
            "finish": final.choices[0].finish_reason,
            "usage": final.usage.completion_tokens if final.usage else usage}


def run_openai_responses(base: str, case: dict) -> dict:
    import openai

    client = openai.OpenAI(api_key="sk-test", base_url=base + "v1", max_retries=0, timeout=20)
    if case["stream"]:
        with client.responses.stream(model=MODEL, input="hi") as s:
            for event in s:
                if event.type == "response.failed":  # the helper yields it; a client gives up
                    err = event.response.error
                    raise RuntimeError(f"response.failed [{err.code}]: {err.message}")
            r = s.get_final_response()
    else:
        r = client.responses.create(model=MODEL, input="hi")
    reasoning = "".join(s.text for item in r.output if item.type == "reasoning"
                        for s in item.summary)
    tools = [(i.call_id, i.name, json.loads(i.arguments)) for i in r.output
             if i.type == "function_call"]
    return {"model": r.model, "text": r.output_text, "reasoning": reasoning,
            "tools": tools_of(tools), "finish": r.status, "usage": r.usage.output_tokens}


def run_anthropic(base: str, case: dict) -> dict:
    import anthropic

    client = anthropic.Anthropic(api_key="sk-ant-test", base_url=base.rstrip("/"), max_retries=0,
                                 timeout=20)
    kwargs = dict(model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "hi"}])
    if case["stream"]:
        with client.messages.stream(**kwargs) as s:
            for _ in s:
                pass
            m = s.get_final_message()
    else:
        m = client.messages.create(**kwargs)
    text = "".join(b.text for b in m.content if b.type == "text")
    reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
    tools = [(b.id, b.name, b.input) for b in m.content if b.type == "tool_use"]
    return {"model": m.model, "text": text, "reasoning": reasoning, "tools": tools_of(tools),
            "finish": m.stop_reason, "usage": m.usage.output_tokens}


def run_google(base: str, case: dict) -> dict:
    from google import genai
    from google.genai import types

    client = genai.Client(api_key="test-key", http_options=types.HttpOptions(
        base_url=base, timeout=20000, retry_options=types.HttpRetryOptions(attempts=1)))
    if case["stream"]:
        responses = list(client.models.generate_content_stream(model=MODEL, contents="hi"))
    else:
        responses = [client.models.generate_content(model=MODEL, contents="hi")]
    text, reasoning, tools, finish, usage = "", "", [], None, None
    for r in responses:
        cand = r.candidates[0]
        for part in (cand.content.parts if cand.content and cand.content.parts else []):
            if part.function_call:
                fc = part.function_call
                tools.append((fc.id, fc.name, fc.args))
            elif part.thought:
                reasoning += part.text or ""
            else:
                text += part.text or ""
        if cand.finish_reason:
            finish = cand.finish_reason.value if hasattr(cand.finish_reason, "value") else str(cand.finish_reason)
        if r.usage_metadata and r.usage_metadata.candidates_token_count is not None:
            usage = r.usage_metadata.candidates_token_count
    return {"model": responses[-1].model_version, "text": text, "reasoning": reasoning,
            "tools": tools_of(tools), "finish": finish, "usage": usage}


RUNNERS = {"openai_chat": run_openai_chat, "openai_responses": run_openai_responses,
           "anthropic": run_anthropic, "google": run_google}


def describe_error(exc: BaseException) -> dict:
    info = {"class": type(exc).__name__, "message": str(exc)}
    for attr in ("status_code", "code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, (int, str)):
            info[attr] = value
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        info["body"] = body
    return info


def main() -> None:
    cases = json.loads(open(sys.argv[1]).read())
    for case in cases:
        CASES[str(case["id"])] = case
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    results = []
    try:
        for case in cases:
            base = f"http://127.0.0.1:{server.server_address[1]}/case/{case['id']}/"
            out = {"id": case["id"]}
            try:
                out.update(RUNNERS[case["sdk"]](base, case), ok=True)
            except Exception as exc:  # the test decides whether an error was expected
                out.update(ok=False, error=describe_error(exc),
                           trace=traceback.format_exc(limit=3))
            out["seen_path"] = case.get("seen_path")
            results.append(out)
    finally:
        server.shutdown()
        server.server_close()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
