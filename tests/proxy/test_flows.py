"""What a saved flow of a model call holds (issue 17): the answer as the harness received it (a
streamed one too), self-contained metadata (token ids, logprobs, record fields, the record's
location), the URL the harness called; control-API traffic left out; the Polar view on request and
response working from the flow file alone; browsing a flow file starts no proxy machinery."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mitmproxy import io
from mitmproxy.http import HTTPFlow

from polar_core.control import ProxyControl
from polar_core.flowmeta import unpack_tokens
from polar_core.paths import REPO_ROOT
from polar_core.schema import read_capture_lines
from polar_proxy import contentview as cv
from polar_proxy import flows as pflows

MITMDUMP = Path(sys.executable).with_name("mitmdump")


def _read(path: Path) -> list[HTTPFlow]:
    with open(path, "rb") as fh:
        return [f for f in io.FlowReader(fh).stream() if isinstance(f, HTTPFlow)]


def _records(capture: Path) -> dict[str, dict]:
    out = {}
    for p in (capture / "sessions").glob("*.jsonl"):
        for rec in read_capture_lines(p):  # delta records (schema 3) expanded
            out[rec["call_id"]] = rec
    return out


def _text(lines) -> str:
    return "\n".join("".join(t for _, t in line) for line in lines)


CALLS = [  # (name, path, body, headers): what a mix of harnesses sends
    ("chat-stream-tool", "/v1/chat/completions",
     {"model": "gpt-x", "stream": True, "messages": [{"role": "user", "content": "make a file #scenario:tool"}],
      "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]},
     {"x-polar-session": "flows-a", "user-agent": "OpenAI/JS 4.0"}),
    ("chat-stream-burst", "/v1/chat/completions",
     {"model": "gpt-x", "stream": True, "messages": [{"role": "user", "content": "hi #scenario:text #send:burst"}]},
     {"x-polar-session": "flows-a"}),
    ("anthropic-stream", "/v1/messages",
     {"model": "claude-x", "max_tokens": 64, "stream": True,
      "messages": [{"role": "user", "content": "think #scenario:reasoning"}]},
     {"x-polar-session": "flows-b", "anthropic-version": "2023-06-01", "x-api-key": "flows-b"}),
    ("responses", "/v1/responses",
     {"model": "gpt-x", "input": "hello #scenario:text"}, {"x-polar-session": "flows-c"}),
    ("chat-error", "/v1/chat/completions",
     {"model": "gpt-x", "messages": [{"role": "user", "content": "boom #fault:500"}]}, {"x-polar-session": "flows-c"}),
]


def _run(helpers, proxy) -> dict[str, bytes]:
    """The calls above plus the runner's control traffic; the body each call received."""
    ctl = ProxyControl(proxy.url)
    keys = ctl.register_sessions([{"session_id": "flows-a", "task_id": "t1", "group_id": "g1", "sample_index": 0,
                                   "harness": "pi-chat"}])["keys"]
    ctl.status()
    got = {}
    for name, path, body, headers in CALLS:
        if headers.get("x-polar-session") in keys:  # a registered session's calls carry its issued key
            headers = {**headers, "authorization": f"Bearer {keys[headers['x-polar-session']]}"}
        ans = helpers.request(proxy.url + path, body, headers=headers)
        assert ans.status in (200, 500), (name, ans.status, ans.body[:300])
        got[name] = ans.body
    ctl.status()
    time.sleep(0.2)
    return got


@pytest.fixture(scope="module")
def saved(helpers, upstream, proxy_factory, tmp_path_factory):
    """A reverse-mode proxy saving flows (as the demo does), driven by the calls above."""
    flows_file = tmp_path_factory.mktemp("flows") / "flows.mitm"
    proxy = proxy_factory(upstream.url, options={"save_stream_file": str(flows_file)})
    got = _run(helpers, proxy)
    proxy.stop()  # flush the flow file
    return proxy, flows_file, got


def test_flow_file_holds_model_calls_not_control_traffic(saved) -> None:
    proxy, path, got = saved
    flows = _read(path)
    assert not [f for f in flows if "/_polar/" in f.request.path]
    calls = [f for f in flows if cv.polar_meta(f)]
    assert len(calls) == len(CALLS) == len(flows)


def test_saved_answer_is_what_the_harness_received(saved) -> None:
    proxy, path, got = saved
    by_path = {}
    for f in _read(path):
        assert f.response is not None and f.response.raw_content, f.request.path
        by_path.setdefault(f.request.path, []).append(f)
    stream, burst = by_path["/v1/chat/completions"][:2]
    assert stream.response.headers["content-type"] == "text/event-stream"
    assert stream.response.content == got["chat-stream-tool"]  # relayed, token by token
    assert stream.metadata["polar"]["response_body"] == {"kept": len(got["chat-stream-tool"]),
                                                         "sent": len(got["chat-stream-tool"])}
    assert burst.response.content == got["chat-stream-burst"]  # answered at once
    n = len(got["chat-stream-burst"])
    assert burst.metadata["polar"]["response_body"] == {"kept": n, "sent": n}
    anth = by_path["/v1/messages"][0]
    assert anth.response.content == got["anthropic-stream"] and b"event: message_stop" in anth.response.content
    assert by_path["/v1/responses"][0].response.content == got["responses"]


def test_metadata_is_self_contained(saved) -> None:
    proxy, path, got = saved
    records = _records(proxy.capture_dir)
    calls = [f for f in _read(path) if cv.polar_meta(f)]
    assert {f.metadata["polar"]["call_id"] for f in calls} == set(records)
    for f in calls:
        meta = f.metadata["polar"]
        rec = records[meta["call_id"]]
        tokens = unpack_tokens(meta)
        assert tokens is not None
        for k in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs"):
            assert tokens[k] == rec[k], k
        for k in ("session_id", "call_index", "provider", "harness", "task_id", "group_id", "sample_index",
                  "status", "finish_reason", "served_model", "output_text", "output_reasoning",
                  "output_tool_calls", "policy_version", "http_status", "error_kind"):
            assert meta["session" if k == "session_id" else k] == rec[k], k
        assert meta["sampling"] == rec["sampling"] and meta["sampling"]
        assert meta["capture_file"] == f"sessions/{rec['session_id']}.jsonl"
        assert Path(meta["capture_dir"]) == proxy.capture_dir.resolve()
        assert (Path(meta["capture_dir"]) / meta["capture_file"]).is_file()
    assert any(f.metadata["polar"]["max_tokens_sent"] == 64 for f in calls)  # the Anthropic call's
    tool = next(f for f in calls if f.metadata["polar"]["output_tool_calls"])
    assert tool.metadata["polar"]["task_id"] == "t1" and tool.metadata["polar"]["harness"] == "pi-chat"


def test_request_shows_what_the_harness_called(saved) -> None:
    proxy, path, got = saved
    for f in _read(path):
        assert (f.request.host, f.request.port) == ("127.0.0.1", proxy.port), f.request.pretty_url
        assert f.request.pretty_url == f.metadata["polar"]["native_url"]
        meta = f.metadata["polar"]
        assert f.comment == pflows.comment(meta)
        assert f.comment.startswith(f"polar {meta['provider']} {meta['harness'] or '-'} "
                                    f"session={meta['session']}#{meta['call_index']} ")
    paths = sorted(f.request.path for f in _read(path))
    assert paths == sorted(c[1] for c in CALLS)
    failed = [f for f in _read(path) if f.metadata["polar"]["status"] != "ok"]
    assert len(failed) == 1 and failed[0].marked and "error=" in failed[0].comment


def test_view_works_from_the_flow_file_alone(saved, tmp_path, monkeypatch) -> None:
    """No capture directory anywhere: request and response views render every token."""
    proxy, path, got = saved
    monkeypatch.setenv("POLAR_HOME", str(tmp_path / "home"))
    lone = tmp_path / "elsewhere" / "flows.mitm"
    lone.parent.mkdir()
    shutil.copy(path, lone)
    view = cv.PolarTokensView()
    records = _records(proxy.capture_dir)
    for f in _read(lone):
        meta = dict(f.metadata["polar"], capture_dir=str(tmp_path / "moved"))
        f.metadata["polar"] = meta
        rec = records[meta["call_id"]]
        desc, lines = view(f.request.content, flow=f, http_message=f.request)
        text = _text(lines)
        assert "content missing" not in text and "not in the flow" not in text
        assert f"--- prompt: {len(rec['prompt_token_ids'])} ids" in text
        assert f"--- sampled: {len(rec['sampled_token_ids'])} ids" in text
        assert "tokens from     the flow (metadata)" in text and "capture record  not here" in text
        desc, lines = view(f.response.content, flow=f, http_message=f.response)
        lines = list(lines)
        text = _text(lines)
        assert desc.startswith(f"Polar answer: {len(rec['sampled_token_ids'])} sampled ids")
        assert f"finish_reason={rec['finish_reason']}" in text
        for tc in rec["output_tool_calls"]:
            assert tc["name"] in text
        table = [line for line in lines if len(line) == 2 and line[0][0] == "" and line[0][1][:6].strip().isdigit()]
        assert len(table) == len(rec["sampled_token_ids"])
        import math
        for line, lp in zip(table, rec["sampled_logprobs"]):
            low = math.exp(lp) < cv.LOW_P
            assert line[0][1].rstrip().endswith(cv.LOW_MARK) == low
            assert (line[1][0] == cv.LOW_STYLE) == low


def test_view_links_the_capture_record_when_it_is_there(saved) -> None:
    proxy, path, got = saved
    f = next(f for f in _read(path) if f.metadata["polar"]["sampled_tokens"])
    meta = f.metadata["polar"]
    rec, source = cv.find_record(meta["session"], meta["call_id"], cv.capture_dirs(meta))
    assert source == proxy.capture_dir.resolve() / meta["capture_file"]
    text = _text(cv.render_call(meta, rec, source, None))
    assert f"capture record  {source}" in text


def test_control_flows_kept_when_asked(helpers, upstream, proxy_factory, tmp_path) -> None:
    flows_file = tmp_path / "flows.mitm"
    proxy = proxy_factory(upstream.url, options={"save_stream_file": str(flows_file), "polar_save_control": True,
                                                 "polar_flow_body_limit": "100"})
    ProxyControl(proxy.url).status()
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi #scenario:words:60"}]}
    ans = helpers.request(proxy.url + "/v1/chat/completions", body, headers={"x-polar-session": "flows-cut"})
    assert ans.status == 200 and len(ans.body) > 100
    time.sleep(0.2)
    proxy.stop()
    flows = _read(flows_file)
    control = [f.metadata["polar"]["control"] for f in flows if "/_polar/" in f.request.path]
    assert control and set(control) == {"status"}  # the readiness probe and ours
    call = next(f for f in flows if cv.polar_meta(f))
    assert call.response.content == ans.body[:100]
    assert call.metadata["polar"]["response_body"] == {"kept": 100, "sent": len(ans.body)}
    assert f"body_cut=100/{len(ans.body)}B" in call.comment


def test_an_answer_that_came_at_once_is_cut_in_the_saved_flow_too(helpers, upstream, proxy_factory, tmp_path) -> None:
    """A stream that had wholly arrived is answered in one piece; a body set in the request hook is
    saved whole, so one longer than ``polar_flow_body_limit`` goes out through the relay, whose
    stream keeps the limit. The harness still gets every byte."""
    flows_file = tmp_path / "flows.mitm"
    proxy = proxy_factory(upstream.url, options={"save_stream_file": str(flows_file), "polar_flow_body_limit": "100"})
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi #scenario:words:60 #send:burst"}]}
    ans = helpers.request(proxy.url + "/v1/chat/completions", body, headers={"x-polar-session": "flows-once"})
    assert ans.status == 200 and len(ans.body) > 100 and ans.body.endswith(b"data: [DONE]\n\n")
    assert proxy.control.status()["streamed_at_once"] == 1
    text = helpers.parsers["openai_chat"](ans.body, True).text
    assert len(text.split()) == 60
    proxy.stop()
    call = next(f for f in _read(flows_file) if cv.polar_meta(f))
    assert call.response.content == ans.body[:100]
    assert call.metadata["polar"]["response_body"] == {"kept": 100, "sent": len(ans.body)}
    assert f"body_cut=100/{len(ans.body)}B" in call.comment


def test_user_save_filter_is_kept_with_the_control_clause() -> None:
    assert pflows.save_filter(None, False) == pflows.NOT_CONTROL
    assert pflows.save_filter("~u chat", False) == f"(~u chat) & {pflows.NOT_CONTROL}"
    assert pflows.save_filter("~u chat", True) == "~u chat"
    assert pflows.save_filter(None, True) is None


@pytest.mark.slow
def test_browsing_starts_no_proxy_machinery(saved, tmp_path) -> None:
    """``mitmdump -nr FILE -s addon/polar.py`` (what ``mitmweb -nr`` does, headless): no capture
    directory, no relay, no upstream warning; the views still render."""
    proxy, path, got = saved
    home = tmp_path / "home"
    env = {**os.environ, "POLAR_HOME": str(home)}
    proc = subprocess.run(
        [str(MITMDUMP), "-nr", str(path), "--flow-detail", "4", "-s", str(REPO_ROOT / "addon" / "polar.py"),
         "--set", f"confdir={tmp_path / 'mitm'}"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "polar_upstream" not in out and "relay=" not in out
    assert not home.exists() or not any(home.rglob("*")), "browsing must not create a capture directory"
    assert out.count("--- sampled: ") == len(CALLS)


def test_polar_flows_reads_the_ids_from_the_flow_file_alone(saved) -> None:
    """``polar flows FILE`` without ``--capture``: the calls frame has every call's ids and logprobs."""
    from polar_analysis import frames

    proxy, path, got = saved
    records = _records(proxy.capture_dir)
    df = frames.flows_calls(path)
    assert sorted(df["call_id"].to_list()) == sorted(records)
    for row in df.iter_rows(named=True):
        rec = records[row["call_id"]]
        for k in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs", "output_text", "finish_reason",
                  "served_model", "task_id"):
            assert row[k] == rec[k], k


def test_exact_history_flows_keep_the_answer_and_the_spliced_ids(helpers, upstream, proxy_factory, tmp_path) -> None:
    """polar_exact_history (the demo's mode): the second turn's prompt is spliced from the sampled
    ids; its flow keeps what the harness received and the ids the record has, and says how."""
    flows_file = tmp_path / "flows.mitm"
    proxy = proxy_factory(upstream.url, options={"save_stream_file": str(flows_file), "polar_exact_history": True})
    # reasoning + text: the harness re-sends the text alone, so the template's ids are not the sampled ones
    messages = [{"role": "user", "content": "answer please #scenario:reasoning"}]
    got = []
    for _ in range(2):
        body = {"model": "m", "stream": True, "messages": messages}
        ans = helpers.request(proxy.url + "/v1/chat/completions", body, headers={"x-polar-session": "flows-exact"})
        assert ans.status == 200
        got.append(ans.body)
        text = "".join(e[1]["choices"][0]["delta"].get("content") or "" for e in helpers.sse_events(ans.body)
                       if isinstance(e[1], dict) and e[1].get("choices"))
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": "again #scenario:reasoning"}]
    time.sleep(0.2)
    proxy.stop()
    records = sorted(_records(proxy.capture_dir).values(), key=lambda r: r["call_index"])
    flows = sorted(_read(flows_file), key=lambda f: f.metadata["polar"]["call_index"])
    assert [f.response.content for f in flows] == got
    for f, rec in zip(flows, records):
        meta = f.metadata["polar"]
        assert unpack_tokens(meta)["prompt_token_ids"] == rec["prompt_token_ids"]
        assert (meta["history"], meta["history_cause"]) == (rec["history"], rec["history_cause"])
    assert records[1]["history"] == "exact"
    # and the ids that reached generate were the exact prompt, as the upstream works it out
    checks = upstream.upstream.check_prompts("flows-exact")[-2:]
    assert [c["received"] for c in checks] == [r["prompt_token_ids"] for r in records]
    assert checks[1]["received"] != checks[1]["rendered"]
