"""Rewards attachment and the `polar calls | inspect | align | drift | trajectories | flows` commands."""

from __future__ import annotations

import os
import shutil

import polars as pl
import pytest
import typer
from typer.testing import CliRunner

from polar_analysis import commands, rewards
from polar_analysis.synthetic import SyntheticSession, write_capture
from polar_core.paths import REPO_ROOT

REAL = REPO_ROOT / "tests" / "fixtures" / "demo-run" / "captures" / "sessions"  # Pi + the 0.5B on real vLLM


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    a = typer.Typer()
    commands.register(a)
    return a


@pytest.fixture()
def cap(tmp_path, renderer, pi_chat):
    """Two sessions of one GRPO group; the second has an upstream error and a retokenized merge."""
    recs = []
    for k in range(2):
        s = SyntheticSession(renderer, f"s{k}", system=pi_chat["messages"][0]["content"], tools=pi_chat["tools"], task_id="t", group_id="g", sample_index=k)
        s.user("Create hi.txt")
        raw = '{"name":"write","arguments":{"content":"hi","path":"hi.txt"}}' if k else None
        s.generate(tool_calls=[("write", {"path": "hi.txt", "content": "hi"}, raw)] if raw else [("write", {"path": "hi.txt", "content": "hi"})])
        s.tool("ok", s.messages[-1]["tool_calls"][0]["id"])
        if k:
            s.generate(status="error")
        s.generate(content="Done.")
        recs += s.records
    write_capture(tmp_path / "cap", recs)
    return tmp_path / "cap"


def test_rewards_files_in_every_format(tmp_path):
    (tmp_path / "r.jsonl").write_text('{"session_id": "a", "reward": 1}\n{"session_id": "b", "reward": 0.5, "status": "crashed"}\n{"session_id": "a", "reward": 0.0}\n')
    (tmp_path / "r.csv").write_text("session_id,reward,status\na,1.0,passed\nb,,timed_out\n")
    pl.DataFrame({"session_id": ["a"], "reward": [2], "task_id": ["t"]}).write_parquet(tmp_path / "r.parquet")
    j = rewards.load_rewards(tmp_path / "r.jsonl").collect().sort("session_id")
    assert j.rows() == [("a", 0.0, "ok", None, None), ("b", 0.5, "failed", None, None)]  # last row per session wins
    c = rewards.load_rewards(tmp_path / "r.csv").collect()
    assert c["status"].to_list() == ["ok", "timeout"] and c["reward"].to_list() == [1.0, None]
    p = rewards.load_rewards(tmp_path / "r.parquet").collect()
    assert p.row(0) == ("a", 2.0, "ok", "t", None)
    (tmp_path / "unjudged.jsonl").write_text('{"session_id": "u", "reward": null, "status": "ok"}\n')
    assert rewards.load_rewards(tmp_path / "unjudged.jsonl").collect()["status"].to_list() == ["failed"]
    (tmp_path / "bad.csv").write_text("sid,score\na,1\n")
    with pytest.raises(ValueError, match="session_id"):
        rewards.load_rewards(tmp_path / "bad.csv")


def test_rewards_table_is_a_snapshot_when_the_rollout_replaces_the_file(tmp_path):
    """A running rollout replaces rollouts.parquet (os.replace) after every sample while the loop
    reads it: the table read before the replace must be the old file's rows, not an error from the
    old footer applied to the new file's pages (the asynchronous loop failed this way in CI)."""
    path = tmp_path / rewards.ROLLOUTS_FILE
    pl.DataFrame({"session_id": ["a", "b"], "reward": [1.0, 0.0], "status": ["ok", "ok"]}).write_parquet(path)
    table = rewards.load_rewards(path)
    n = 5000
    pl.DataFrame({"session_id": [f"s{i}" for i in range(n)], "reward": [0.5] * n, "status": ["ok"] * n,
                  "task_id": ["t"] * n}).write_parquet(tmp_path / "next.tmp")
    os.replace(tmp_path / "next.tmp", path)
    assert table.collect().select("session_id", "reward").rows() == [("a", 1.0), ("b", 0.0)]
    assert rewards.load_rewards(path).collect().height == n


def test_trajectories_command_with_rollouts_and_strict(cap, app, tmp_path):
    pl.DataFrame({"task_id": ["t", "t"], "sample_index": [0, 1], "session_id": ["s0", "s1"], "group_id": ["g", "g"],
                  "status": ["ok", "timeout"], "reward": [1.0, None]}).write_parquet(cap / "rollouts.parquet")
    out = tmp_path / "traj.parquet"
    res = CliRunner().invoke(app, ["trajectories", str(cap), "--mode", "prefix-merge", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "coverage" in res.output and "100.0000%" in res.output
    df = pl.read_parquet(out).sort("session_id")
    assert df["n_calls"].to_list() == [2, 2] and df["reward"].to_list() == [1.0, None]
    assert df["status"].to_list() == ["ok", "timeout"] and df["group_id"].to_list() == ["g", "g"]
    assert df["merge_kind"].to_list() == [["exact"], ["retokenized"]]
    run = pytest.importorskip("polar_training.run")  # the trainer reads what we write
    assert run.load_trajectories([str(out)]).height == 2
    res = CliRunner().invoke(app, ["trajectories", str(cap), "--strict", "-o", str(out)])
    assert res.exit_code == 0 and pl.read_parquet(out).height == 3
    (tmp_path / "rw.csv").write_text("session_id,reward\ns0,0.25\n")
    res = CliRunner().invoke(app, ["trajectories", str(cap), "--mode", "per-request", "--rewards", str(tmp_path / "rw.csv"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    df = pl.read_parquet(out)
    assert df.height == 4 and sorted(df["reward"].to_list(), key=str) == [0.25, 0.25, None, None]
    assert "--rewards" in CliRunner().invoke(app, ["trajectories", "--help"]).output


def test_calls_inspect_drift_align_commands(cap, app, tmp_path):
    r = CliRunner()
    res = r.invoke(app, ["calls", str(cap), "--out", str(tmp_path / "calls.parquet")])
    assert res.exit_code == 0 and "wrote 5 calls" in res.output
    assert pl.read_parquet(tmp_path / "calls.parquet")["status"].to_list().count("error") == 1
    res = r.invoke(app, ["inspect", str(cap)])
    assert res.exit_code == 0, res.output
    for expected in ("2 sessions", "5 calls", "upstream_5xx", "exact-merge rate", "50.00%", "rewards: none"):
        assert expected in res.output
    res = r.invoke(app, ["drift", str(cap), "--out", str(tmp_path / "drift.parquet")])
    assert res.exit_code == 0 and "tool_args_reserialized" in res.output
    d = pl.read_parquet(tmp_path / "drift.parquet")
    # the failed call is compared too (its prompt was sent), then the retry after it
    assert sorted(d["cause"].to_list()) == ["new_conversation", "new_conversation", "none", "tool_args_reserialized", "tool_args_reserialized"]
    # align on a real vLLM capture (the synthetic one is rendered by the very renderer align uses):
    # every call's re-rendering is vLLM's own prompt ids (tiny-qwen has the 0.5B's tokenizer and template)
    real = tmp_path / "real"
    (real / "sessions").mkdir(parents=True)
    shutil.copy(REAL / "hello-file.st0.s1.jsonl", real / "sessions")
    n_calls = len((REAL / "hello-file.st0.s1.jsonl").read_text().splitlines())
    res = r.invoke(app, ["align", str(real), "--model", "tiny-qwen", "-o", str(tmp_path / "align.parquet")])
    assert res.exit_code == 0, res.output
    aligned = pl.read_parquet(tmp_path / "align.parquet")
    assert aligned.height == n_calls > 2 and aligned["status"].to_list() == ["exact"] * n_calls
    # the calls Parquet is a valid source too
    res = r.invoke(app, ["drift", str(tmp_path / "calls.parquet")])
    assert res.exit_code == 0 and "tool_args_reserialized" in res.output
    assert r.invoke(app, ["inspect", str(tmp_path / "missing")]).exit_code == 2


def test_flows_command(cap, app, tmp_path):
    from mitmproxy import io
    from mitmproxy.test import tflow, tutils

    from polar_analysis import frames

    first = frames.calls(cap).filter(pl.col("session_id") == "s0").collect().row(0, named=True)
    req = tutils.treq(method=b"POST", path=b"/v1/chat/completions", content=first["native_request"].encode())
    flow = tflow.tflow(req=req, resp=True)
    flow.metadata["polar"] = {"session": "s0", "provider": "openai_chat", "call_index": 0, "call_id": first["call_id"], "status": "ok"}
    path = tmp_path / "f.mitm"
    with open(path, "wb") as fh:
        io.FlowWriter(fh).add(flow)
    out = tmp_path / "flows.parquet"
    res = CliRunner().invoke(app, ["flows", str(path), "--capture", str(cap), "-o", str(out)])
    assert res.exit_code == 0, res.output
    df = pl.read_parquet(out)
    assert df["sampled_token_ids"][0].to_list() == first["sampled_token_ids"] and len(first["sampled_token_ids"]) > 5
    assert df["session_id"].to_list() == ["s0"] and "s0" in res.output
