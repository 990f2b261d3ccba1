"""`polar eval` end to end through the proxy, on the scripted vLLM-format upstream (no model: seconds).

The generic harness (curl) sends one chat call per sample; the evaluators are chosen so that the
figures are known in advance: one task always passes, one passes on sample 0 only (1 of 3:
pass@1 = 1/3, pass@2 = 1 - C(2,2)/C(3,2) = 2/3), one has an evaluator that cannot run (no verdict:
infrastructure failures, out of n). ``--greedy`` must reach the upstream as temperature 0 on
every call, whatever the harness asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from polar_testing.scripted_upstream import Script, ServerThread

pytestmark = pytest.mark.slow

BODY = json.dumps({"model": "gpt-4o-mini", "stream": True, "temperature": 0.9,
                   "messages": [{"role": "user", "content": "Say hi."}]})
CURL = ("curl -sSf -N {base_url}/v1/chat/completions -H 'authorization: Bearer {api_key}' "
        "-H 'content-type: application/json' -d @body.json")
TASKS = [
    {"id": "always", "instruction": "Say hi.", "files": {"body.json": BODY}, "evaluator": "true"},
    {"id": "first-only", "instruction": "Say hi.", "files": {"body.json": BODY},
     "evaluator": "case \"$POLAR_SESSION\" in *.s0) exit 0;; *) exit 1;; esac"},
    {"id": "no-verdict", "instruction": "Say hi.", "files": {"body.json": BODY}, "evaluator": "no-such-evaluator-polar"},
]


def test_polar_eval_through_the_proxy_greedy(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "polar_runtime.cli", "eval", "--tasks", str(tasks), "--harness", "generic",
           "--command", CURL, "--samples", "3", "--concurrency", "3", "--greedy", "--timeout", "60",
           "--out", str(out)]
    with ServerThread(served_model="scripted-model", script=Script(["text"])) as up:
        run = subprocess.run([*cmd, "--upstream", up.url], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "COLUMNS": "200"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        url = up.url
        # chat calls, or token-in generate calls under exact history: the temperature vLLM was asked for
        sent = [b.get("temperature") for b in up.upstream.requests if "messages" in b]
        sent += [(b.get("sampling_params") or {}).get("temperature") for b in up.upstream.generate_requests]
    assert len(sent) == 9 and set(sent) == {0.0}, sent
    res = json.loads((out / "eval.json").read_text())
    by = {t["task_id"]: t for t in res["tasks"]}
    assert res["ks"] == [1, 2, 3] and res["greedy"] is True and res["temperature"] == 0.0
    assert (by["always"]["graded"], by["always"]["passed"], by["always"]["pass_at"]["1"]) == (3, 3, 1.0)
    first = by["first-only"]
    assert (first["graded"], first["passed"]) == (3, 1)
    assert first["pass_at"]["1"] == pytest.approx(1 / 3) and first["pass_at"]["2"] == pytest.approx(2 / 3)
    assert first["pass_at"]["3"] == 1.0 and first["stderr"]["3"] is None
    assert by["no-verdict"]["graded"] == 0 and by["no-verdict"]["infra"]["no_verdict"] == 3
    assert res["overall"]["1"]["tasks"] == 2 and res["overall"]["1"]["value"] == pytest.approx((1 + 1 / 3) / 2)
    assert res["infra_failures"]["total"] == 3
    df = pl.read_parquet(out / "rollouts.parquet")
    assert df.height == 9 and (df["calls"] == 1).all()
    assert "mean over tasks" in run.stdout

    # the same directory at another temperature: refused, nothing mixed
    sampled = [a for a in cmd if a != "--greedy"] + ["--temperature", "0.7", "--upstream", url]
    again = subprocess.run(sampled, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert again.returncode != 0 and "other settings" in again.stdout + again.stderr, again.stdout + again.stderr
