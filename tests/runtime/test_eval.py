"""pass@k and its standard errors against brute force; how rollout rows are scored; `polar eval --rollouts`.

The estimator is checked against the definition itself: over every k-subset of the n samples, the
share that holds a pass. The jackknife standard error is checked against a literal leave-one-out
over the sample list. All in-process, well under a second.
"""

from __future__ import annotations

import itertools
import json
import math

import polars as pl
import pytest
from typer.testing import CliRunner

from polar_analysis import passk
from polar_runtime import evaluation as ev
from polar_runtime import rollout as r
from polar_runtime.cli import app


def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


def brute_jackknife(outcomes: list[bool], k: int) -> float:
    n = len(outcomes)
    loo = [brute_pass_at_k(outcomes[:i] + outcomes[i + 1:], k) for i in range(n)]
    mean = sum(loo) / n
    return math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in loo))


CASES = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]


@pytest.mark.parametrize("n,c,k", CASES)
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n, c, k):
    # the order of passes does not matter for the estimator; put them in the middle to be sure
    outcomes = [False] * ((n - c) // 2) + [True] * c + [False] * (n - c - (n - c) // 2)
    assert passk.pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12)
    se = passk.pass_at_k_stderr(n, c, k)
    if k > n - 1:
        assert se is None
    else:
        assert se == pytest.approx(brute_jackknife(outcomes, k), abs=1e-12)


def test_pass_at_1_stderr_is_the_standard_error_of_a_mean():
    for n, c in [(8, 3), (4, 1), (10, 5)]:
        p = c / n
        assert passk.pass_at_k_stderr(n, c, 1) == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))


def test_unbiased_not_the_plug_in_estimator():
    # 1 pass of 4, k = 2: 3 of the 6 pairs hold it (0.5); 1 - (3/4)^2 = 0.4375 would be biased low
    assert passk.pass_at_k(4, 1, 2) == 0.5
    with pytest.raises(ValueError):
        passk.pass_at_k(3, 1, 4)


def test_default_ks():
    assert passk.default_ks(1) == [1]
    assert passk.default_ks(8) == [1, 2, 4, 8]
    assert passk.default_ks(6) == [1, 2, 4, 6]


def test_overall_mean_over_tasks_and_both_standard_errors():
    s = passk.summarize({"a": [True, False, False, False], "b": [True, True, False, True], "c": [True, None]}, [1, 2, 4])
    o1 = s["overall"]["1"]
    a, b, c = 0.25, 0.75, 1.0  # c: one graded sample (the None is left out of n)
    assert o1["value"] == pytest.approx((a + b + c) / 3) and o1["tasks"] == 3
    # c's stderr at k=1 needs 2 graded samples: the sampling-noise stderr is unknown, the task one is not
    assert o1["stderr"] is None
    assert o1["stderr_tasks"] == pytest.approx(math.sqrt(sum((v - o1["value"]) ** 2 for v in (a, b, c)) / 2 / 3))
    o2 = s["overall"]["2"]  # only a and b have 2 graded samples
    sea, seb = passk.pass_at_k_stderr(4, 1, 2), passk.pass_at_k_stderr(4, 3, 2)
    assert o2["tasks"] == 2 and o2["stderr"] == pytest.approx(math.sqrt(sea**2 + seb**2) / 2)
    assert s["overall"]["4"]["tasks"] == 2 and s["tasks"][2]["pass_at"]["4"] is None
    # infrastructure failures as failures: c has n = 2, c = 1
    f = passk.summarize({"c": [True, None]}, [1], infra_as_fail=True)
    assert f["tasks"][0]["graded"] == 2 and f["overall"]["1"]["value"] == 0.5


def row(task: str, i: int, status: str = "ok", reward: float | None = 1.0, step: int = 0) -> dict:
    return {**dict.fromkeys(r.ROLLOUT_SCHEMA), "task_id": task, "sample_index": i, "status": status, "reward": reward,
            "step": step, "session_id": r.session_id_for(task, step, i), "group_id": r.group_id_for(task, step),
            "calls": 1, "wall_s": 1.0}


ROWS = [row("t", 0), row("t", 1, reward=0.0), row("t", 2, "timeout", 1.0), row("t", 3, "failed", None),
        row("u", 0, reward=0.9), row("u", 1, reward=None), row("u", 2, reward=1.0), row("u", 3, "timeout", 0.0)]


def test_score_rows_counts_infrastructure_failures_apart():
    res = ev.score_rows(ROWS, ks=[1, 2])
    t, u = res["tasks"]
    assert (t["graded"], t["passed"], t["infra_failures"]) == (2, 1, 2)
    assert (u["graded"], u["passed"], u["infra_failures"]) == (2, 1, 2)  # 0.9 < threshold 1: a fail
    assert t["infra"] == {"timeout": 1, "crashed": 1, "no_verdict": 0}
    assert u["infra"] == {"timeout": 1, "crashed": 0, "no_verdict": 1}
    assert res["infra_failures"] == {"timeout": 2, "crashed": 1, "no_verdict": 1, "total": 4, "timeout_but_passed": 1}
    assert res["overall"]["1"]["value"] == 0.5 and res["overall_infra_as_fail"]["1"]["value"] == 0.25
    assert u["mean_reward"] == pytest.approx((0.9 + 1.0 + 0.0) / 3)  # every reward given, infra or not
    lenient = ev.score_rows(ROWS, ks=[1], threshold=0.5)
    assert lenient["tasks"][1]["passed"] == 2
    strict = ev.score_rows(ROWS, ks=[1], infra="fail")
    assert strict["tasks"][0]["graded"] == 4 and strict["overall"]["1"]["value"] == 0.25
    with pytest.raises(ValueError):
        ev.score_rows(ROWS, infra="ignore")


def test_demo_prefix_is_stripped_and_tasks_renamed():
    res = ev.score_rows([row("eval-t", 0)], strip_prefix=ev.DEMO_PREFIX)
    assert [t["task_id"] for t in res["tasks"]] == ["t"]
    assert [t.id for t in ev.demo_tasks([r.Task("t", "do it")])] == ["eval-t"]


def test_eval_command_scores_a_rollouts_file(tmp_path):
    rollouts = tmp_path / "rollouts.parquet"
    pl.DataFrame([{k: v for k, v in x.items() if k in r.ROLLOUT_SCHEMA} for x in ROWS],
                 schema=r.ROLLOUT_SCHEMA).write_parquet(rollouts)
    res = CliRunner().invoke(app, ["eval", "--rollouts", str(rollouts), "--k", "1,2"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / ev.RESULT_FILE).read_text())
    assert out["overall"]["1"]["value"] == 0.5 and out["ks"] == [1, 2] and out["step"] == 0
    assert "mean over tasks" in res.output and "infrastructure failures: 4" in res.output
    frame = pl.read_parquet(tmp_path / ev.TASKS_FILE)
    assert frame["task_id"].to_list() == ["t", "u"] and frame["pass@1"].to_list() == [0.5, 0.5]

    # two rollout steps are two policies: refuse to pool them unless one is picked
    two = pl.concat([pl.read_parquet(rollouts), pl.read_parquet(rollouts).with_columns(step=pl.lit(1, pl.Int64))])
    two.write_parquet(rollouts)
    res = CliRunner().invoke(app, ["eval", "--rollouts", str(rollouts)], env={"COLUMNS": "200"})
    assert res.exit_code != 0 and "--step" in res.output
    res = CliRunner().invoke(app, ["eval", "--rollouts", str(rollouts), "--step", "1", "--k", "1"])
    assert res.exit_code == 0, res.output
    bad = CliRunner().invoke(app, ["eval", "--rollouts", str(rollouts), "--step", "1", "--k", "0"])
    assert bad.exit_code != 0


def test_a_rerun_under_other_settings_is_refused(tmp_path):
    ev._check_settings(tmp_path, {"sampling": "temperature=1"})
    ev._check_settings(tmp_path, {"sampling": "temperature=1"})  # same settings: resumes
    with pytest.raises(Exception, match="other settings"):
        ev._check_settings(tmp_path, {"sampling": "temperature=0"})


def test_demo_eval_step_goes_under_eval_ids_and_into_the_report(tmp_path, monkeypatch):
    """The demo's --eval-every glue, without servers: the rollout it asks for and what it reports."""
    import io
    from pathlib import Path

    from rich.console import Console

    from polar_runtime import demo
    from polar_runtime import harnesses as h
    from polar_runtime.loop import phases

    seen = {}

    def fake_rollouts(rcfg, control, stop, label):
        seen.update(ids=[t.id for t in rcfg.tasks], dir=rcfg.capture_dir, samples=rcfg.samples, step=rcfg.step,
                    label=label)
        rows = [row(f"eval-{t}", i, reward=float(i == 0), step=rcfg.step) for t in ("hello-file", "make-dir")
                for i in range(rcfg.samples)]
        return pl.DataFrame([{k: v for k, v in x.items() if k in r.ROLLOUT_SCHEMA} for x in rows], schema=r.ROLLOUT_SCHEMA)

    monkeypatch.setattr(phases, "run_rollouts", fake_rollouts)
    cfg = demo.demo_config(out=tmp_path / "demo", eval_every=1, eval_samples=3)
    out = Path(cfg.out)
    tasks = [r.Task("hello-file", "x"), r.Task("make-dir", "y")]
    endpoint = h.Endpoint(mode="base_url", base_url="http://127.0.0.1:9", proxy_url="http://127.0.0.1:9", ca_cert=None)
    tl = phases.Timeline(Console(file=io.StringIO()))
    entry = phases.run_eval(cfg, out, tl, tasks, endpoint, None, None, "m", step=1, policy=1)
    assert seen == {"ids": ["eval-hello-file", "eval-make-dir"], "dir": out / "eval", "samples": 3, "step": 1,
                    "label": "eval 1"}
    assert (out / "eval" / "sessions").resolve() == (out / "captures" / "sessions").resolve()
    assert [t.id for t in tasks] == ["hello-file", "make-dir"]  # the training tasks keep their ids
    assert entry["step"] == 1 and entry["policy_version"] == 1 and entry["ks"] == [1, 2, 3]
    assert [t["task_id"] for t in entry["tasks"]] == ["hello-file", "make-dir"]
    assert entry["overall"]["1"]["value"] == pytest.approx(1 / 3) and entry["overall"]["3"]["value"] == 1.0
    assert tl.phases[-1].name == "eval 1" and "pass@1 0.333" in tl.phases[-1].detail
    buf = io.StringIO()
    ev.print_evaluations([entry], Console(file=buf, width=200))
    assert "v1" in buf.getvalue() and "0.333 ±" in buf.getvalue()


def test_eval_timeout_is_one_limit_for_every_task():
    # task.toml's [agent] timeout_sec (600 on the built-in tasks) would otherwise override --timeout
    tasks = [r.Task("a", "x", timeout=600.0), r.Task("b", "y"), r.Task("c", "z", timeout=100.0)]
    assert [ev._capped(t, 300.0).timeout for t in tasks] == [300.0, 300.0, 100.0]
    assert tasks[0].timeout == 600.0  # the loaded tasks are not changed
