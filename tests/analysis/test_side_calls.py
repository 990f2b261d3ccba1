"""Harness side calls (OpenCode's title call, Gemini CLI / Qwen Code's next-speaker check) are named,
left out of every training sequence by both builders and counted as auxiliary, and certify's
capture check passes such a run (and fails it when the builders train the side call)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from polar_core.compaction import side_call_of

# OpenCode 1.18.33's title call on ``small_model``: the title agent's system prompt, its request,
# then the conversation's first user turn
TITLE_SYSTEM = "You are a title generator. You output ONLY a thread title. Nothing else.\n\n<task>\nGenerate a brief title"
TITLE_CALL = [{"role": "system", "content": TITLE_SYSTEM},
              {"role": "user", "content": "Generate a title for this conversation:\n"},
              {"role": "user", "content": "Fix the failing test in parser.py"}]
NEXT_SPEAKER = ("Analyze *only* the content and structure of your immediately preceding response (your last turn "
                "in the conversation history). Based *strictly* on that response, determine who should logically "
                "speak next: the 'user' or the 'model' (you).")


def test_opencode_title_and_next_speaker_are_recognized():
    assert side_call_of(TITLE_CALL) == "opencode title"
    assert side_call_of(TITLE_CALL[:1] + TITLE_CALL[2:]) == "opencode title"  # the system prompt alone
    assert side_call_of(TITLE_CALL[1:]) == "opencode title"  # the user request alone
    history = [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "Fix the test."},
               {"role": "assistant", "content": "Done."}]
    assert side_call_of(history) is None
    assert side_call_of([*history, {"role": "user", "content": NEXT_SPEAKER}]) == "gemini-cli/qwen-code next-speaker check"


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """One OpenCode-like session: a title call beside the agent's five turns (real Qwen2.5 ids)."""
    from polar_analysis.alignment import ChatTemplateRenderer
    from polar_analysis.synthetic import SyntheticSession, write_capture
    from polar_runtime import models

    renderer = ChatTemplateRenderer(models.ensure_model(models.TINY_QWEN))
    tools = [{"type": "function", "function": {"name": "bash", "description": "run",
                                               "parameters": {"type": "object", "properties": {}}}}]
    s = SyntheticSession(renderer, "s1", system="You are opencode.", tools=tools, harness="opencode").user(
        "Fix the failing test in parser.py")
    title = s.generate(content="Parser test fix", messages=TITLE_CALL, tools=None, echo=False)
    for cmd in ("cat parser.py", "sed -i s/a/b/ parser.py", "pytest", "git diff"):  # five agent turns
        s.generate(content="", tool_calls=[("bash", {"cmd": cmd})])
        s.tool("ok", s.messages[-1]["tool_calls"][0]["id"])
    s.generate(content="Fixed.")
    out = tmp_path_factory.mktemp("side") / "captures"
    write_capture(out, s.records)
    return out, title.call_id, [r.call_id for r in s.records]


@pytest.mark.parametrize("mode", ["per-request", "prefix-merge"])
def test_builders_leave_the_side_call_out_and_count_it(capture, mode):
    from polar_analysis import frames, trajectories
    from polar_analysis.trajectories.common import capture_coverage

    out, title_id, _ = capture
    df, stats = trajectories.build(frames.calls(out, rewards=None), mode)
    trained = {c for ids in df["call_ids"].to_list() for c in ids}
    assert title_id not in trained and len(trained) == 5
    assert dict(stats.auxiliary) == {"opencode title": 1} and stats.auxiliary_sampled_tokens > 0
    assert stats.usable_calls == 5 and stats.coverage == 1.0  # not counted as lost tokens
    assert stats.auxiliary_summary == "1 auxiliary calls (opencode title: 1) left out"
    cov = capture_coverage(out, df)  # the independent count from the raw lines agrees
    assert cov["coverage"].to_list() == [1.0]


def _write_flows(captures: Path, call_ids: list[str]) -> None:
    """A model-API flow per call, labelled as the proxy labels it (what certify compares with)."""
    from mitmproxy import io
    from mitmproxy.test import tflow

    with open(captures / "flows.mitm", "wb") as fh:
        w = io.FlowWriter(fh)
        for i, cid in enumerate(call_ids):
            f = tflow.tflow(resp=True)
            f.request.path = "/v1/chat/completions"
            f.metadata["polar"] = {"session": "s1", "call_id": cid, "call_index": i}
            w.add(f)


def test_certify_capture_passes_with_the_side_call_left_out_and_fails_when_trained(capture, monkeypatch):
    from polar_analysis import frames, trajectories
    from polar_analysis.trajectories import common
    from polar_runtime.certify import checks as C

    out, title_id, ids = capture
    _write_flows(out, ids)
    df, _ = trajectories.build(frames.calls(out, rewards=None), "prefix-merge")
    res = C.check_capture(C.Evidence.load(out, None, trajectories=df))
    assert res.state == "PASS", res
    assert "1 auxiliary" in res.measured
    # the exclusion removed: the builder trains the title call, and the check names it
    monkeypatch.setattr(common, "_side_call_candidates", lambda lf: set())
    df, stats = trajectories.build(frames.calls(out, rewards=None), "prefix-merge")
    assert title_id in {c for ids in df["call_ids"].to_list() for c in ids} and not stats.auxiliary
    res = C.check_capture(C.Evidence.load(out, None, trajectories=df))
    assert res.state == "FAIL"
    assert any("auxiliary call (opencode title) is in a training sequence" in f for f in res.details), res


def test_trajectories_command_and_loop_line_name_the_side_calls(capture, tmp_path):
    """`polar trajectories` passes (coverage from the raw lines too) and says what it left out; the
    loop's trajectories line says it as well."""
    import typer
    from typer.testing import CliRunner

    from polar_analysis import commands
    from polar_runtime.loop.phases import trajectories_detail

    app = typer.Typer()
    commands.register(app)
    out, _, _ = capture
    res = CliRunner().invoke(app, ["trajectories", str(out), "-o", str(tmp_path / "t.parquet")])
    assert res.exit_code == 0, res.output
    assert "1 auxiliary calls (opencode title: 1) left out" in res.output
    assert "coverage from the raw capture lines: 100.0000%" in res.output
    stats = {"sequences": 1, "usable_calls": 5, "coverage": 1.0, "merge_rate": 1.0, "auxiliary": {"opencode title": 1}}
    assert trajectories_detail(stats).endswith("; 1 auxiliary calls (opencode title: 1) left out")
