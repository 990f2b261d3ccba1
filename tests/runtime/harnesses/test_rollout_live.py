"""`polar rollout` end to end (the real CLI, a real vLLM, the real proxy, real harnesses).

Three tasks x 2 samples with Pi: one ordinary task (judged on the harness's answer), one that times out (a 3 s budget) and whose
evaluator cannot even start, one whose evaluator crashes. The rollout must survive all of it, give
each sample its status and reward, keep the captures under the rollout's ids, and a second
invocation must resume (nothing runs again). Then Claude Code (--bare) on the same model, to show a
second harness through the same command. Each harness must solve "greet" at least once: the
sampling is seeded (``--seed``: per-call seeds derived from it and the session ids, which a rerun
repeats), so the verdict is reproducible, not luck.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from polar_runtime import harnesses as h

from .conftest import check_token_fields, read_calls, require_installed

pytestmark = [pytest.mark.vllm, pytest.mark.harness, pytest.mark.slow]

TASKS = [
    {"id": "greet", "instruction": "Reply with one short sentence that says hello. Do not use any tools.",
     "evaluator": "grep -qi hello \"$POLAR_HARNESS_STDOUT\""},
    {"id": "slow-broken", "instruction": "Say hi.", "timeout": 3, "evaluator": "no-such-evaluator-polar"},
    # 120 s: a seeded sample that keeps calling tools ends there, not at the run's 240 s (CI time)
    {"id": "crash-eval", "instruction": "Say hi.", "timeout": 120,
     "evaluator": "python3 -c 'raise SystemExit(\"evaluator crashed\")'"},
]
POLAR = [sys.executable, "-m", "polar_runtime.cli"]
SEED = "7"  # base of the per-call sampling seeds (plain sampling at temperature 1, the rollout default)


def polar_rollout(capture_dir: Path, tasks: Path, upstream: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*POLAR, "rollout", "--tasks", str(tasks), "--upstream", upstream, "--capture-dir", str(capture_dir),
           "--max-tokens", "32", "--timeout", "240", "--seed", SEED, *extra]  # a later --max-tokens wins
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def test_rollout_pi_survives_timeouts_and_broken_evaluators_then_resumes(vllm_qwen05, tmp_path):
    require_installed(h.get_preset("pi-chat"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    cap = tmp_path / "captures"
    run = polar_rollout(cap, tasks, vllm_qwen05.base_url, "--harness", "pi-chat", "--samples", "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    df = pl.read_parquet(cap / "rollouts.parquet")
    assert df.height == 6 and df["group_id"].n_unique() == 3
    by = {t: df.filter(pl.col("task_id") == t).sort("sample_index") for t in ("greet", "slow-broken", "crash-eval")}

    hello = by["greet"]
    assert hello["status"].to_list() == ["ok", "ok"]
    assert set(hello["reward"].to_list()) <= {0.0, 1.0} and hello["evaluator_status"].is_in(["pass", "fail"]).all()
    assert "pass" in hello["evaluator_status"].to_list(), hello.select("evaluator_status", "evaluator_output").rows()
    slow = by["slow-broken"]
    assert slow["status"].to_list() == ["timeout", "timeout"] and slow["wall_s"].max() < 30
    assert slow["reward"].null_count() == 2 and slow["evaluator_status"].to_list() == ["error", "error"]
    # Each sample that ended is graded 0 by the crashing evaluator. A seeded sample may instead keep
    # calling tools until its 120 s limit (it ran to 240 s once in CI with the sandbox's /app in Pi's prompt):
    # the runner's handling of that is what slow-broken checks, so here at least one must end.
    crash = by["crash-eval"].filter(pl.col("status") == "ok")
    assert crash.height >= 1 and set(by["crash-eval"]["status"]) <= {"ok", "timeout"}, by["crash-eval"].rows()
    assert crash["reward"].to_list() == [0.0] * crash.height
    assert all("evaluator crashed" in out for out in crash["evaluator_output"])

    for row in df.filter(pl.col("status") == "ok").iter_rows(named=True):
        calls = [c for c in read_calls(cap, row["session_id"]) if c["status"] == "ok"]
        check_token_fields(calls, row["session_id"])
        assert {(c["task_id"], c["group_id"], c["sample_index"]) for c in calls} == {
            (row["task_id"], row["group_id"], row["sample_index"])}
        assert row["calls"] == len(calls) and row["sampled_tokens"] == sum(len(c["sampled_token_ids"]) for c in calls)
    assert "greet.st0.s1" in run.stdout and "per task" in run.stdout

    # Resume: every sample is finished, so nothing runs and nothing changes.
    sessions_before = {p.name: p.stat().st_size for p in (cap / "sessions").glob("*.jsonl")}
    again = polar_rollout(cap, tasks, vllm_qwen05.base_url, "--harness", "pi-chat", "--samples", "2")
    assert again.returncode == 0, again.stdout[-3000:]
    assert "resuming: 6 samples already finished" in again.stdout
    assert pl.read_parquet(cap / "rollouts.parquet").equals(df)
    assert {p.name: p.stat().st_size for p in (cap / "sessions").glob("*.jsonl")} == sessions_before


def test_rollout_second_harness_claude_code(vllm_qwen05, tmp_path):
    """A short answer: Claude Code treats a max_tokens stop as an error after three "continue"
    retries, so the task must fit the proxy's max_tokens cap."""
    require_installed(h.get_preset("claude-code"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASKS[0]) + "\n")
    cap = tmp_path / "captures"
    run = polar_rollout(cap, tasks, vllm_qwen05.base_url, "--harness", "claude-code", "--samples", "2",
                        "--max-tokens", "64")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    df = pl.read_parquet(cap / "rollouts.parquet")
    assert df["status"].to_list() == ["ok", "ok"] and set(df["harness"]) == {"claude-code"}
    assert df["evaluator_status"].is_in(["pass", "fail"]).all()
    assert "pass" in df["evaluator_status"].to_list(), df.select("evaluator_status", "evaluator_output").rows()
    for row in df.iter_rows(named=True):
        check_token_fields([c for c in read_calls(cap, row["session_id"]) if c["status"] == "ok"], row["session_id"])
