"""The Polar content view: a captured call's tokens in mitmproxy, from the committed real flows.

tests/fixtures/demo-run/captures/flows.mitm holds the flows the proxy saved (``save_stream_file``)
during a small real run (the Pi harness, the 0.5B on vLLM, through the proxy in reverse mode);
``captures/flows-run/`` is that run's capture directory (its records). See the fixture's README.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mitmproxy import io
from mitmproxy.http import HTTPFlow

from polar_core.flowmeta import unpack_tokens
from polar_proxy import contentview as cv
from polar_core.paths import REPO_ROOT
from polar_core.schema import read_capture_lines

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "demo-run" / "captures"
RUN = FIXTURE / "flows-run"  # the capture directory of the run the flows were saved in
MITMDUMP = Path(sys.executable).with_name("mitmdump")


def _flows(path: Path) -> list[HTTPFlow]:
    with open(path, "rb") as fh:
        return [f for f in io.FlowReader(fh).stream() if isinstance(f, HTTPFlow)]


def _records() -> dict[str, dict]:
    out = {}
    for p in (RUN / "sessions").glob("*.jsonl"):
        for rec in read_capture_lines(p):  # delta records (schema 3) expanded
            out[rec["call_id"]] = rec
    return out


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    """A copy of the run's capture directory with its flows.mitm next to sessions/, as the demo saves it."""
    target = tmp_path / "captures"
    shutil.copytree(RUN, target, ignore=shutil.ignore_patterns(".polar-cache"))
    shutil.copy(FIXTURE / "flows.mitm", target / "flows.mitm")
    return target


def test_flows_carry_polar_annotations() -> None:
    """Each call's flow (saved by mitmproxy) and capture record (written by the proxy) are the same
    call: checked against what the flow itself holds -- the harness's request body as mitmproxy
    saw it, its timestamp, the order of the session's requests -- not only the copied annotations."""
    flows = _flows(FIXTURE / "flows.mitm")
    calls = [f for f in flows if cv.polar_meta(f)]
    records = _records()
    assert len(calls) == len(records) >= 3
    assert sorted(f.metadata["polar"]["call_id"] for f in calls) == sorted(records)  # each record once
    by_session: dict[str, list[tuple[float, int]]] = {}
    for f in calls:
        meta, rec = f.metadata["polar"], records[f.metadata["polar"]["call_id"]]
        assert meta["session"] == rec["session_id"] and meta["provider"] == rec["provider"] == "openai_chat"
        assert meta["prompt_tokens"] == len(rec["prompt_token_ids"])
        assert meta["sampled_tokens"] == len(rec["sampled_token_ids"])
        assert meta["finish_reason"] == rec["finish_reason"]
        assert unpack_tokens(meta) == {k: rec[k] for k in ("prompt_token_ids", "sampled_token_ids", "sampled_logprobs")}
        assert f.comment.startswith(f"polar openai_chat pi-chat session={rec['session_id']}#{rec['call_index']} ")
        assert f.response is not None and f.response.raw_content  # the answer as the harness got it (streamed)
        # the flow's own request: the body the harness sent, at the time the record says
        assert json.loads(f.request.content) == rec["native_request"]
        assert f.request.headers["user-agent"] == rec["user_agent"]
        assert abs(f.request.timestamp_start - rec["t_request_in"]) < 1.0
        by_session.setdefault(rec["session_id"], []).append((f.request.timestamp_start, rec["call_index"]))
    assert not [f for f in flows if f.request.path.startswith("/_polar/")]
    for sid, seen in by_session.items():  # call indexes follow the order the harness sent its requests
        order = [i for _, i in sorted(seen)]
        assert order == sorted(order) and len(set(order)) == len(order), sid


def _text_parts(content) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content or [] if p.get("type") == "text"]


def test_view_renders_every_token_with_its_loss_mask_style(capture: Path) -> None:
    flows = [f for f in _flows(capture / "flows.mitm") if cv.polar_meta(f)]
    flow = next(f for f in flows if f.metadata["polar"]["call_index"] == 0
                and f.metadata["polar"]["finish_reason"] == "tool_calls")
    rec = _records()[flow.metadata["polar"]["call_id"]]
    view = cv.PolarTokensView()
    assert view.render_priority(flow.request.content, flow=flow, http_message=flow.request) > 1
    assert view.render_priority(b"{}", flow=flow, http_message=flow.response) == 0
    found, source = cv.find_record(rec["session_id"], rec["call_id"], [capture])
    assert found == rec and source == capture / "sessions" / f"{rec['session_id']}.jsonl"
    tok = cv.tokenizer_for(rec["served_model"])
    assert tok is not None, "the 0.5B tokenizer is built by setup"
    lines = list(cv.render_call(flow.metadata["polar"], None, None, tok))  # from the flow alone
    pieces = [p for line in lines for p in line]
    assert sum(1 for style, _ in pieces if style == cv.PROMPT_STYLE) == len(rec["prompt_token_ids"])
    n_sampled = len(rec["sampled_token_ids"])
    # every sampled token twice: in the token stream and in the logprob table
    assert sum(1 for style, _ in pieces if style == cv.SAMPLED_STYLE) == 2 * n_sampled
    table = [line for line in lines if len(line) == 2 and line[1][0] == cv.SAMPLED_STYLE and line[0][0] == ""]
    assert len(table) == n_sampled
    for k, line in enumerate(table):
        pos, tid, lp = line[0][1].split()[:3]
        assert int(pos) == len(rec["prompt_token_ids"]) + k and int(tid) == rec["sampled_token_ids"][k]
        assert float(lp) == pytest.approx(rec["sampled_logprobs"][k], abs=5e-5)
    text = "".join(t for _, t in pieces)
    assert "<|im_start|>" in text and f"boundary at {len(rec['prompt_token_ids'])}" in text

    # What the view shows, against the flows themselves: the prompt tokens spell every message of
    # this flow's request, and the sampled tokens spell the tool call the harness re-sent in its
    # next request (both read from flows.mitm, not from the capture record).
    prompt_text = "".join(t for line in lines for style, t in line if style == cv.PROMPT_STYLE)
    sampled_text = "".join(t for line in lines if line not in table for style, t in line if style == cv.SAMPLED_STYLE)
    shown = lambda t: t.replace("\r", "\\r").replace("\t", "\\t").replace("\n", cv.NEWLINE)  # noqa: E731
    for m in json.loads(flow.request.content)["messages"]:
        for part in _text_parts(m.get("content")):
            assert shown(part.strip()) in prompt_text, (m["role"], part[:80])
    nxt = next(f for f in flows if f.metadata["polar"]["session"] == rec["session_id"]
               and f.metadata["polar"]["call_index"] == 1)
    [resent] = [m for m in json.loads(nxt.request.content)["messages"] if m["role"] == "assistant"]
    for call in resent["tool_calls"]:
        assert shown(f'"name": "{call["function"]["name"]}"') in sampled_text
        for value in json.loads(call["function"]["arguments"]).values():
            assert shown(json.dumps(value)) in sampled_text, value


def test_view_without_capture_renders_from_the_flow_and_says_where_it_looked(tmp_path: Path) -> None:
    flow = next(f for f in _flows(FIXTURE / "flows.mitm") if cv.polar_meta(f))
    rec, source = cv.find_record(flow.metadata["polar"]["session"], flow.metadata["polar"]["call_id"], [tmp_path])
    assert rec is None and source is None
    lines = list(cv.render_call(flow.metadata["polar"], None, None, None))
    text = "\n".join("".join(t for _, t in line) for line in lines)
    assert "capture record  not here" in text and "tokens from     the flow (metadata)" in text
    assert f"--- sampled: {flow.metadata['polar']['sampled_tokens']} ids" in text


def test_old_flows_without_ids_render_from_the_record(capture: Path) -> None:
    """Flows saved before the metadata held ids: the record is where the tokens come from."""
    flow = next(f for f in _flows(capture / "flows.mitm") if cv.polar_meta(f))
    meta = {k: v for k, v in flow.metadata["polar"].items() if k != "tokens"}
    rec, source = cv.find_record(meta["session"], meta["call_id"], [capture])
    text = "\n".join("".join(t for _, t in line) for line in cv.render_call(meta, rec, source, None))
    assert f"tokens from     {source}" in text and f"--- prompt: {len(rec['prompt_token_ids'])} ids" in text
    text = "\n".join("".join(t for _, t in line) for line in cv.render_call(meta, None, None, None))
    assert "not in the flow and no capture record found" in text


@pytest.mark.slow
def test_mitmdump_flow_detail_shows_the_view(capture: Path, tmp_path: Path) -> None:
    """``mitmdump -nr flows.mitm --flow-detail 4 -s addon/polar.py``: no capture dir given, the
    view finds sessions/ next to the flow file and prints every call's tokens."""
    empty = tmp_path / "proxy-writes-here"
    proc = subprocess.run(
        [str(MITMDUMP), "-nr", str(capture / "flows.mitm"), "--flow-detail", "4", "-s", str(REPO_ROOT / "addon" / "polar.py"),
         "--set", f"confdir={tmp_path / 'mitm'}", "--set", f"polar_capture_dir={empty}"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    records = _records()
    for rec in records.values():
        assert f"session         {rec['session_id']} #{rec['call_index']}" in out
        assert f"--- prompt: {len(rec['prompt_token_ids'])} ids, loss_mask 0 ---" in out
        assert f"--- sampled: {len(rec['sampled_token_ids'])} ids, loss_mask 1" in out
    # (a flow that ended in an error, the harness gone mid-stream, is printed twice: response and error)
    assert out.count("capture record  " + str(capture / "sessions")) >= len(records)
    assert out.count("tokens from     the flow (metadata)") == out.count("capture record  ")
    assert "capture record  not here" not in out
    assert "content missing" not in out
    assert not any(empty.rglob("*.jsonl")), "reading flows must not capture anything"


def test_polar_flows_reads_the_saved_flows_into_the_capture_frame(capture: Path, tmp_path: Path) -> None:
    """`polar flows FILE --capture DIR`: the flows saved by the proxy become the same calls frame as
    the capture directory (token ids joined by call id, never re-derived)."""
    import polars as pl
    from typer.testing import CliRunner

    from polar_analysis import frames
    from polar_runtime.cli import app

    out = tmp_path / "flows.parquet"
    res = CliRunner().invoke(app, ["flows", str(capture / "flows.mitm"), "--capture", str(capture), "-o", str(out)])
    assert res.exit_code == 0, res.output
    from_flows = pl.read_parquet(out).sort("call_id")
    from_capture = frames.calls(capture, rewards=None).collect().sort("call_id")
    assert from_flows["call_id"].to_list() == from_capture["call_id"].to_list()
    for col in ("session_id", "call_index", "provider", "finish_reason", "prompt_token_ids", "sampled_token_ids",
                "sampled_logprobs", "policy_version", "status"):
        assert from_flows[col].to_list() == from_capture[col].to_list(), col
    alone = tmp_path / "alone.parquet"  # the flows file alone holds the same ids
    res = CliRunner().invoke(app, ["flows", str(capture / "flows.mitm"), "-o", str(alone)])
    assert res.exit_code == 0, res.output
    from_alone = pl.read_parquet(alone).sort("call_id")
    for col in ("call_id", "prompt_token_ids", "sampled_token_ids", "sampled_logprobs", "finish_reason"):
        assert from_alone[col].to_list() == from_capture[col].to_list(), col
