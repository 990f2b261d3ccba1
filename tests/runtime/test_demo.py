"""``polar demo``: Ctrl-C stops what it started, and a reduced run, killed once and resumed, completes
end to end.

The reduced run serves tiny-qwen (2 layers, the real Qwen2.5 tokenizer and template) on the real
vLLM, runs the real Pi harness through the real proxy on one built-in task, trains one GRPO step,
pushes the weights in place, runs again, executes the notebooks and writes the report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from polar_core import processes
from polar_runtime import harnesses as h
from polar_runtime.loop import phases
from polar_runtime import rollout as r
from polar_core.paths import REPO_ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_stop_children_signals_each_process_group_but_the_excluded() -> None:
    keep = subprocess.Popen(["sleep", "60"], start_new_session=True)
    older = set(processes.child_pids(os.getpid()))  # `keep`, and any server another test left running
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        assert set(processes.stop_children(exclude=older)) == {p.pid for p in procs}
        for p in procs:
            assert p.wait(5) == -signal.SIGTERM
        assert keep.poll() is None
    finally:
        for p in [keep, *procs]:
            p.kill()
            p.wait()


def test_ctrl_c_stops_the_running_harness_and_keeps_no_result(tmp_path: Path, ctrl_c: None) -> None:
    """SIGINT during a rollout: the harness (its own process group) is killed at once, the
    interrupted sample leaves no result (a re-run redoes it), KeyboardInterrupt reaches the caller."""
    marker = tmp_path / "started"
    preset = h.get_preset("generic", f"touch {marker}; sleep 60; echo late > late.txt")
    task = r.Task(id="slow", instruction="wait", evaluator="test -f late.txt")
    endpoint = h.Endpoint(mode="base_url", base_url="http://127.0.0.1:9")
    cfg = r.RolloutConfig(tasks=[task], preset=preset, endpoint=endpoint, capture_dir=tmp_path / "cap",
                          model="m", samples=2, concurrency=2, timeout=120, sandbox="host")  # the marker is outside

    def interrupt() -> None:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)

    # the test session's own servers (its private dockerd, vLLM) are children too: only new ones count
    before = set(processes.child_pids(os.getpid()))
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with processes.interruptible() as stop:
            phases.run_rollouts(cfg, None, stop, "test")
    assert time.monotonic() - t0 < 30
    assert not list((tmp_path / "cap").rglob("late.txt"))
    assert r.ResultStore(tmp_path / "cap").rows() == []
    time.sleep(0.5)
    assert [p for p in processes.child_pids(os.getpid()) if p not in before and _alive(p)] == []


def run_demo(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `polar demo`; past ``timeout`` it gets SIGTERM (its handler stops vLLM, the proxy and the
    harnesses, each in a process group of its own) before SIGKILL, so a slow run leaks no server."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"polar demo ran past {timeout:.0f} s and was stopped:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


#: Sample 0 of step 0 passes, every other sample fails: step 0 has a group with reward variance (one
#: GRPO update, one push), step 1 has none (its update is skipped, no push), step 2 is the final
#: rollout. tiny-qwen's random weights cannot solve a real task, so the verdict comes from the session.
VARIANCE_ONCE = {"id": "echo", "instruction": "Say hello.",
                 "evaluator": 'case "$POLAR_SESSION" in *.st0.s0) exit 0;; esac; exit 1'}


@pytest.mark.vllm
@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~5 min on a quiet machine; a killed run, then its resume to the end
def test_reduced_demo_killed_after_its_push_resumes_to_the_end(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    """`polar demo` as a newcomer runs it: the installed script, a *relative* --out and --tasks, from a
    directory that is not the repository root (the harness runs in its own cwd: every path it is
    given must be absolute). It is killed with `kill -9` once its update is pushed (step 1's rollout
    running), then the same command resumes it: the finished step is kept, the pushed checkpoint is
    served under its version, nothing is trained twice, and the run ends as a fresh one does (report,
    notebooks, scripts/check_demo.py). One run for both: each alone cost a vLLM start and a training
    step (~2 min in CI). A fresh run's train/push phases are checked by CI's README demo."""
    from polar_runtime.loop.placement import ChildRecord

    pi = h.get_preset("pi-chat")
    if not pi.installed():
        pytest.fail("Pi is not installed: run `polar harness install pi` (setup does)")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    (cwd / "tasks.jsonl").write_text(json.dumps(VARIANCE_ONCE) + "\n")
    out = cwd / "run"
    polar = Path(sys.executable).with_name("polar")
    cmd = [str(polar), "demo", "--model", "tiny-qwen", "--tasks", "tasks.jsonl", "--samples", "2", "--iterations", "2",
           "--max-tokens", "16", "--timeout", "300", "--max-model-len", "8192", "--server-during-train", "keep",
           "--out", "run"]
    t0 = time.monotonic()
    first = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 1200
        state: dict = {}
        while time.monotonic() < deadline and first.poll() is None:
            path = out / "loop-state.json"
            state = json.loads(path.read_text()) if path.is_file() else {}
            if state.get("next_step", 0) >= 1:
                break
            time.sleep(0.5)
        assert first.poll() is None and state.get("policy_version") == 1, f"not killed after the push: {state}"
        first.kill()  # kill -9: nothing of the demo's clean-up runs
        first.wait()
        assert not (out / "report.json").exists()

        proc = run_demo(cmd, cwd, timeout=1500)
    finally:
        if first.poll() is None:
            first.kill()
        ChildRecord(out).stop_leftovers(print)  # what a failed resume left running
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = proc.stdout
    assert "resuming" in text and "replacing" not in text
    for needle in ("polar demo: report", "calls captured:", "reward before/after:", "phase times", "where things are"):
        assert needle in text

    report = json.loads((out / "report.json").read_text())
    print(f"reduced demo: {wall:.0f} s; phases " + ", ".join(f"{p['name']} {p['seconds']:.0f}s" for p in report["phases"]))
    assert report["config"]["out"] == str(out)  # resolved against the cwd, once
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    for s in report["steps"]:
        assert s["rewards"]["samples"] == 2 and s["rewards"]["calls"] > 0
        assert s["trajectories"]["coverage"] == 1.0
        assert s["trajectories"]["sampled_tokens"] == s["trajectories"]["covered_tokens"] > 0
    assert [s["rewards"]["solved"] for s in report["steps"]] == [1, 0, 0]
    trained, skipped = report["training"]
    assert trained["groups_with_variance"] == ["echo.st0"] and not trained["skipped"]
    assert trained["push"] is not None, trained["note"]
    assert trained["push"]["policy_version"] == 1 and trained["push"]["method"] == "reload_weights"
    assert skipped["skipped"] and skipped["push"] is None and skipped["groups_with_variance"] == []
    assert "zero reward variance" in skipped["note"] and report["skipped_steps"] == 1
    assert [s["policy_version"] for s in report["steps"]] == [0, 1, 1]
    assert trained["peak_rss_gib"] > 0
    assert any(n.startswith("probe max |dlogp|") for n in trained["push"]["notes"])
    assert Path(trained["checkpoint"]).is_dir()

    from polar_analysis import frames

    calls = frames.calls(out / "captures", rewards=None).collect()
    # step 0 ran on policy v0, steps 1 and 2 on the pushed v1: the proxy recorded which weights served each call
    versions = dict(calls.select(pl.col("session_id").str.extract(r"\.st(\d)\.").alias("step"), "policy_version")
                    .unique().iter_rows())
    assert versions == {"0": 0, "1": 1, "2": 1}
    # the demo's sampling is enforced and seeded per call (a rerun samples the same tokens)
    sent = [json.loads(r) if isinstance(r, str) else r for r in calls["normalized_request"].to_list()]
    assert all(r["temperature"] == 1.0 and r["top_p"] == 1.0 and r["top_k"] == -1 and "seed" in r for r in sent)
    # the 16-token cap holds in exact-history mode too (generate gets the call's limit)
    assert calls["n_sampled_ids"].max() <= 16 and set(calls["history"].drop_nulls()) <= {"exact", "rendered"}
    assert report["captures"]["calls"] == calls.height >= 6
    assert (out / "captures" / "flows.mitm").stat().st_size > 0
    assert len(list((out / "trajectories").glob("step-*.parquet"))) == 3
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["n_sampled_tokens"] == report["steps"][0]["trajectories"]["sampled_tokens"]
    assert not list(out.rglob("work/run")), "a relative path was resolved inside a harness's work dir"

    import nbformat

    executed = sorted((out / "notebooks").glob("*.ipynb"))
    assert [p.name for p in executed] == [p.name for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))]
    for p in executed:
        nb = nbformat.read(p, as_version=4)
        assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"], p
    phases_run = {ph["name"] for ph in report["phases"]}
    assert phases_run >= {"setup", "serve", "proxy", "rollout 1", "trajectories 1", "rollout 2", "trajectories 2",
                          "notebooks"}
    assert not phases_run & {"rollout 0", "train 0", "push 0", "train 1"}  # step 0 kept, not trained again

    # the demo is the loop: its state says finished, its metrics went through the one writer, and
    # `--print-config` printed the configuration that ran
    state = json.loads((out / "loop-state.json").read_text())
    assert state["next_step"] == 3 and state["policy_version"] == 1 and state["pending"] is None
    loop_rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in loop_rows if "loop/policy_version" in row] == [0, 1, 2]
    assert report["loop"]["staleness_tokens"] == {"0": report["steps"][0]["trajectories"]["sampled_tokens"]}
    printed = subprocess.run([*cmd, "--print-config"], cwd=cwd, capture_output=True, text=True, check=True).stdout
    from polar_runtime.loop.config import parse_config

    assert parse_config(printed).to_dict() == report["config"]
    assert report["loop"]["resumes"] == 1 and report["loop"]["policy_version"] == 1
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import check_demo

    assert check_demo.check(out) == []


@pytest.mark.vllm
@pytest.mark.harness
@pytest.mark.slow
def test_demo_stops_at_the_first_step_that_captured_nothing(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    """Every sample killed by a 1 s timeout: the demo stops after rollout 0 with exit 1, naming the
    harness, the first sample's error and its stderr log; it trains nothing and runs no more steps."""
    (tmp_path / "tasks.jsonl").write_text(json.dumps(VARIANCE_ONCE) + "\n")
    polar = Path(sys.executable).with_name("polar")
    cmd = [str(polar), "demo", "--model", "tiny-qwen", "--tasks", "tasks.jsonl", "--samples", "2", "--timeout", "1",
           "--max-model-len", "4096", "--out", "run", "--no-notebooks"]
    proc = run_demo(cmd, tmp_path, timeout=600)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = " ".join(proc.stdout.split())
    assert "polar demo failed: rollout step 0 produced nothing to learn from: pi-chat: all 2 samples failed or timed out" in text
    assert "killed after 1 s" in text
    assert str(tmp_path / "run" / "captures" / "work" / "echo.st0.s0" / "logs" / "pi-chat.stderr") in proc.stdout.replace("\n", "")
    assert "train 0" not in text and "rollout 1" not in text and "Traceback" not in proc.stdout + proc.stderr
