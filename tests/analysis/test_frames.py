"""Loading captures into Polars: the Parquet cache, torn/invalid lines, flows, sessions, tokens."""

from __future__ import annotations

import json

import orjson
import polars as pl
import pytest

from polar_analysis import frames
from polar_core.schema import CallRecord
from polar_analysis.synthetic import SyntheticSession, write_capture


def rec(sid: str, i: int, **kw) -> CallRecord:
    base = dict(
        call_id=f"{sid}-{i}",
        session_id=sid,
        call_index=i,
        provider="openai_chat",
        harness="pi",
        prompt_token_ids=list(range(100 + i)),
        sampled_token_ids=[7, 8, 9],
        sampled_logprobs=[-0.5, -0.25, -0.125],
        finish_reason="stop",
        normalized_request={"messages": [{"role": "user", "content": "hi"}]},
        output_tool_calls=[{"id": "c", "name": "bash", "arguments": "{}"}],
        t_request_in=100.0 + i,
        t_response_out=101.5 + i,
    )
    base.update(kw)
    return CallRecord(**base)


def append(path, *records, raw: bytes = b""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:
        for r in records:
            fh.write(orjson.dumps(r.to_dict()) + b"\n")
        fh.write(raw)


def test_types_json_columns_and_derived(tmp_path):
    append(tmp_path / "sessions" / "a.jsonl", rec("a", 0), rec("a", 1, status="error", sampled_token_ids=[], sampled_logprobs=[]))
    df = frames.calls(tmp_path).collect()
    assert df.schema["prompt_token_ids"] == pl.List(pl.Int32)
    assert df.schema["sampled_logprobs"] == pl.List(pl.Float64)
    assert df["sampled_token_ids"].to_list() == [[7, 8, 9], []]
    assert df["sampled_logprobs"][0].to_list() == [-0.5, -0.25, -0.125]
    assert json.loads(df["normalized_request"][0]) == {"messages": [{"role": "user", "content": "hi"}]}
    assert json.loads(df["output_tool_calls"][0])[0]["name"] == "bash"
    assert df["n_prompt_ids"].to_list() == [100, 101] and df["latency_s"].to_list() == [1.5, 1.5]
    assert df["source_line"].to_list() == [1, 2] and df["reward"].is_null().all()


def test_torn_invalid_and_recovered_lines_are_counted(tmp_path):
    f = tmp_path / "sessions" / "s.jsonl"
    append(f, rec("s", 0), raw=b'{"schema_version": 1, "call_id": "torn')  # crash mid-write
    rep = frames.ScanReport()
    assert frames.calls(tmp_path, report=rep).select(pl.len()).collect().item() == 1
    assert rep.totals()["torn_tail"] == 1 and rep.converted == 1
    # the proxy restarts and appends: the torn bytes are glued to the next record's line
    append(f, rec("s", 1), raw=b"not json at all\n")
    append(f, rec("s", 2, prompt_token_ids=[1, "x"]), rec("s", 3))
    rep = frames.ScanReport()
    df = frames.calls(tmp_path, report=rep).collect()
    assert df["call_id"].to_list() == ["s-0", "s-1", "s-3"]
    t = rep.totals()
    assert (t["records"], t["recovered"], t["invalid"], t["torn_tail"]) == (3, 1, 3, 0)
    assert rep.appended == 1
    assert any("prompt_token_ids" in e for e in rep.files[0].errors)


def test_cache_is_incremental_and_rewritten_files_reconvert(tmp_path):
    f = tmp_path / "sessions" / "s.jsonl"
    append(f, rec("s", 0))
    frames.calls(tmp_path).collect()
    rep = frames.ScanReport()
    frames.calls(tmp_path, report=rep).collect()
    assert rep.cached == 1
    append(f, rec("s", 1))
    rep = frames.ScanReport()
    assert frames.calls(tmp_path, report=rep).collect()["call_id"].to_list() == ["s-0", "s-1"]
    assert rep.appended == 1
    assert len(list((tmp_path / ".polar-cache").glob("s.*.parquet"))) == 2
    f.write_bytes(orjson.dumps(rec("s", 9).to_dict()) + b"\n")  # rewritten (not appended)
    rep = frames.ScanReport()
    assert frames.calls(tmp_path, report=rep).collect()["call_id"].to_list() == ["s-9"]
    assert rep.converted == 1 and len(list((tmp_path / ".polar-cache").glob("s.*.parquet"))) == 1


def test_unwritable_capture_dir_caches_under_polar_home(tmp_path, monkeypatch):
    cap = tmp_path / "ro"
    append(cap / "sessions" / "s.jsonl", rec("s", 0))
    (cap / ".polar-cache").write_text("not a directory")  # the local cache cannot be created
    monkeypatch.setenv("POLAR_HOME", str(tmp_path / "home"))
    assert frames.calls(cap).select(pl.len()).collect().item() == 1
    assert len(list((tmp_path / "home" / "capture-cache").rglob("*.parquet"))) == 1


def test_older_schema_and_unknown_fields(tmp_path):
    old = {"schema_version": 0, "call_id": "x", "session_id": "s", "prompt_token_ids": [1, 2], "future_field": {"a": 1}}
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "s.jsonl").write_bytes(orjson.dumps(old) + b"\n" + orjson.dumps({"record_type": "session_end", "session_id": "s"}) + b"\n")
    rep = frames.ScanReport()
    df = frames.calls(tmp_path, report=rep).collect()
    assert df.height == 1 and df["status"][0] == "ok" and df["sampled_token_ids"][0].to_list() == []
    assert json.loads(df["extra_json"][0]) == {"future_field": {"a": 1}}
    assert rep.totals()["other_records"] == 1


def test_sessions_tokens_and_rollout_rewards(tmp_path):
    append(tmp_path / "sessions" / "a.jsonl", rec("a", 0, task_id="t1", group_id="g"), rec("a", 1, finish_reason="length"))
    append(tmp_path / "sessions" / "b.jsonl", rec("b", 0, task_id="t1", group_id="g", status="error"))
    pl.DataFrame(
        {"task_id": ["t1", "t1"], "sample_index": [0, 1], "session_id": ["a", "b"], "group_id": ["g", "g"], "status": ["completed", "TIMEOUT"], "reward": [1.0, 0.0]}
    ).write_parquet(tmp_path / "rollouts.parquet")
    lf = frames.calls(tmp_path)
    s = frames.sessions(lf).sort("session_id").collect()
    assert s["n_calls"].to_list() == [2, 1] and s["n_error"].to_list() == [0, 1] and s["n_length"].to_list() == [1, 0]
    assert s["sampled_ids"].to_list() == [6, 3] and s["reward"].to_list() == [1.0, 0.0]
    assert s["rollout_status"].to_list() == ["ok", "timeout"] and s["duration_s"].to_list() == [2.5, 1.5]
    tk = frames.tokens(lf.filter(pl.col("session_id") == "a")).collect()
    assert tk.height == 6 and tk["position"].to_list() == [0, 1, 2, 0, 1, 2]
    assert tk["logprob"].to_list()[:3] == [-0.5, -0.25, -0.125]
    assert frames.tokens(lf, which="prompt").select(pl.len()).collect().item() == 100 + 101 + 100


def test_flow_files_rebuild_calls_and_join_token_ids(tmp_path, renderer, pi_chat):
    from mitmproxy import io
    from mitmproxy.test import tflow, tutils

    s = SyntheticSession(renderer, "flowsess", system=pi_chat["messages"][0]["content"], tools=pi_chat["tools"]).user("hi")
    r = s.generate(content="Hello.")
    write_capture(tmp_path / "cap", [r])
    body = {"model": "my-model", "messages": s.records[0].normalized_request["messages"], "tools": pi_chat["tools"], "stream": True}
    req = tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=json.dumps(body).encode(),
                      headers=((b"content-type", b"application/json"), (b"user-agent", b"OpenAI/JS 5.20.0")))
    flow = tflow.tflow(req=req, resp=tutils.tresp(status_code=200, content=b"data: [DONE]\n\n"))
    # what the proxy's addon puts into a model call's flow
    flow.metadata["polar"] = {"session": "flowsess", "provider": "openai_chat", "call_index": 0, "call_id": r.call_id,
                              "prompt_tokens": len(r.prompt_token_ids), "sampled_tokens": len(r.sampled_token_ids),
                              "finish_reason": "stop", "status": "ok", "error_kind": None, "upstream": "http://u", "policy_version": 3}
    side = tflow.tflow(resp=True)
    side.metadata["polar"] = {"side_call": "/v1/models"}
    path = tmp_path / "flows.mitm"
    with open(path, "wb") as fh:
        w = io.FlowWriter(fh)
        w.add(flow)
        w.add(side)
    st = frames.FileStats(path=str(path))
    from polar_proxy.providers import chat_request_of

    df = frames.flows_calls(path, stats=st, translate=chat_request_of)
    assert (st.records, st.other_records) == (1, 1)
    row = df.row(0, named=True)
    assert row["session_id"] == "flowsess" and row["call_id"] == r.call_id and row["policy_version"] == 3
    assert row["native_path"] == "/v1/chat/completions" and row["completion_tokens"] == len(r.sampled_token_ids)
    assert json.loads(row["native_request"])["model"] == "my-model"
    normalized = json.loads(row["normalized_request"])  # rebuilt by the proxy's own translator
    assert [m["role"] for m in normalized["messages"]] == ["system", "user"]
    assert row["prompt_token_ids"] == []  # ids are not in a flow ...
    full = frames.fill_from_capture(df, frames.calls(tmp_path / "cap"))
    assert full["prompt_token_ids"][0].to_list() == r.prompt_token_ids  # ... they come from the capture
    assert full["sampled_logprobs"][0].to_list() == r.sampled_logprobs
    lf = frames.load(path)
    assert lf.select("n_prompt_ids").collect().item() == 0
