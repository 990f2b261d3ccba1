"""`polar eval` with a real harness (Pi) against real vLLM (tiny-qwen), greedy, 2 samples: one short run.

tiny-qwen has random weights, so what it answers says nothing; what is checked is the path: every
call the harness made reached vLLM at temperature 0 (the capture records the sampling vLLM
applied), each sample is either graded or counted as an infrastructure failure, and eval.json's
figures are the estimator applied to rollouts.parquet. Answers are capped at 16 tokens to keep it
to seconds once vLLM is up (the server is the session's shared one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from polar_analysis import passk
from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines
from polar_runtime import evaluation as ev
from polar_runtime import harnesses as h

pytestmark = [pytest.mark.vllm, pytest.mark.harness, pytest.mark.slow]


def test_polar_eval_pi_on_tiny_qwen_greedy(vllm_tiny, tmp_path):
    preset = h.get_preset("pi-chat")
    if not preset.installed():
        pytest.fail("pi-chat is not installed: run `polar harness install pi` (setup does)")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "greet", "instruction": "Say hello. Do not use any tools.",
                                 "evaluator": "grep -qi hello \"$POLAR_HARNESS_STDOUT\""}) + "\n")
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "polar_runtime.cli", "eval", "--tasks", str(tasks), "--harness", "pi-chat",
           "--samples", "2", "--concurrency", "2", "--greedy", "--max-tokens", "16", "--timeout", "120",
           "--upstream", vllm_tiny.base_url, "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / ev.RESULT_FILE).read_text())
    df = pl.read_parquet(out / "rollouts.parquet")
    assert df.height == 2
    records = [rec for p in (out / SESSIONS_SUBDIR).glob("*.jsonl") for rec in read_capture_lines(p)
               if rec.get("record_type", "call") == "call" and rec.get("status") == "ok"]
    assert records, "no call captured"
    assert all((rec.get("sampling") or {}).get("temperature") == 0.0 for rec in records), \
        [rec.get("sampling") for rec in records]
    outcomes = [ev.outcome(row)[0] for row in df.to_dicts()]
    task = res["tasks"][0]
    assert task["graded"] + task["infra_failures"] == 2 == task["samples"]
    graded = [o for o in outcomes if o is not None]
    if graded:
        assert task["pass_at"]["1"] == pytest.approx(passk.pass_at_k(len(graded), sum(graded), 1))
