"""benchmarks/bench_transfer.py's parts that decide its verdict (issue 41), on synthetic rows and a
synthetic run directory (seconds; the experiment itself is the benchmark, not a test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest

from polar_testing.benchmarks import BENCHMARKS, load_benchmark

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "demo-run-exact" / "captures" / "sessions"
KINDS = {"create-poem": "same-operation", "rename-notes": "same-operation", "csv-price": "new-operation",
         "find-word": "new-operation"}


@pytest.fixture(scope="module")
def bt():
    return load_benchmark("bench_transfer")


def _rows(task: str, step: int, passed: int, n: int, prefix: str = "eval-", infra: int = 0) -> list[dict]:
    out = []
    for k in range(n + infra):
        status = "timeout" if k >= n else "ok"
        out.append({"task_id": prefix + task, "step": step, "sample_index": k, "session_id": f"{prefix}{task}.st{step}.s{k}",
                    "group_id": f"{prefix}{task}.st{step}", "status": status, "reward": 1.0 if k < passed else 0.0,
                    "wall_s": 20.0, "eval_s": 0.5, "calls": 2})
    return out


COUNTS = {"create-poem": ((10, 32), (20, 32)), "rename-notes": ((8, 32), (12, 32)),
          "csv-price": ((6, 32), (14, 32)), "find-word": ((12, 32), (13, 32))}


def _eval_rows() -> list[dict]:
    rows = []
    for t, ((c0, n0), (c1, n1)) in COUNTS.items():
        rows += _rows(t, 0, c0, n0, infra=1) + _rows(t, 4, c1, n1)
    return rows


def _se(c: int, n: int) -> float:
    p = c / n
    return math.sqrt(p * (1 - p) / (n - 1))


def test_pooled_difference_and_its_se_per_kind(bt) -> None:
    ev = bt.transfer_table(_eval_rows(), 0, 4, KINDS)
    new = ev["by_kind"]["new-operation"]
    assert new["tasks"] == ["csv-price", "find-word"]
    p = new["pooled"]
    # counts pooled over the kind's tasks: 18/64 -> 27/64; infrastructure failures left out of n
    assert (p["pre"]["passed"], p["pre"]["graded"], p["post"]["passed"], p["post"]["graded"]) == (18, 64, 27, 64)
    assert p["diff"] == pytest.approx(9 / 64)
    assert p["diff_se"] == pytest.approx(math.sqrt(_se(18, 64) ** 2 + _se(27, 64) ** 2))
    assert p["diff_over_se"] == pytest.approx((9 / 64) / p["diff_se"])
    assert p["mde_2se"] == pytest.approx(2 * math.sqrt(2 * (18 / 64) * (46 / 64) / 63))
    same = ev["by_kind"]["same-operation"]["pooled"]
    assert (same["pre"]["passed"], same["post"]["passed"]) == (18, 32)
    assert same["diff_se"] == pytest.approx(math.sqrt(_se(18, 64) ** 2 + _se(32, 64) ** 2))
    # over every eval task, and per task with its kind and infra count
    assert ev["pooled"]["pre"]["passed"] == 36 and ev["pooled"]["pre"]["graded"] == 128
    assert ev["pooled"]["diff"] == pytest.approx((59 - 36) / 128)
    t = ev["tasks"]["create-poem"]
    assert t["kind"] == "same-operation" and t["infra_pre"] == 1 and t["infra_post"] == 0
    assert t["diff_se"] == pytest.approx(math.sqrt(_se(10, 32) ** 2 + _se(20, 32) ** 2))


def test_timeout_conventions_count_only_the_timeouts_differently(bt) -> None:
    def row(step: int, status: str, reward: float | None) -> dict:
        return {"task_id": "eval-rename-notes", "step": step, "status": status, "reward": reward}

    # base: 2 pass, 3 fail, 2 timeouts (one whose verifier passes), 1 crash
    pre = [row(0, "ok", 1.0)] * 2 + [row(0, "ok", 0.0)] * 3 + [row(0, "timeout", 1.0), row(0, "timeout", 0.0),
                                                                row(0, "error", 1.0)]
    # trained: 4 pass, 1 fail, 3 timeouts (two whose verifier passes), 1 without a verdict
    post = [row(1, "ok", 1.0)] * 4 + [row(1, "ok", 0.0)] + [row(1, "timeout", 1.0)] * 2 + [row(1, "timeout", 0.0),
                                                                                          row(1, "ok", None)]
    tc = bt.timeout_conventions(pre + post, 0, 1)
    counts = {c: (v["pre"]["passed"], v["pre"]["graded"], v["post"]["passed"], v["post"]["graded"]) for c, v in tc.items()}
    assert counts == {"graded": (2, 5, 4, 5), "timeout_fails": (2, 7, 4, 8), "verifier_as_is": (3, 7, 6, 8)}
    assert tc["verifier_as_is"]["diff"] == pytest.approx(6 / 8 - 3 / 7)
    # the graded convention is every table's: the same counts as transfer_table's pooled row
    ev = bt.transfer_table(pre + post, 0, 1, KINDS)
    assert (ev["pooled"]["pre"]["graded"], ev["pooled"]["post"]["passed"]) == (5, 4)


def test_resolvable_difference(bt) -> None:
    assert bt.resolvable(0.4, 32) == pytest.approx(2 * math.sqrt(2 * 0.24 / 31))  # ~0.25, benchmarks/history/transfer.md
    assert bt.resolvable(None, 32) is None and bt.resolvable(0.5, 1) is None
    assert bt.resolvable(0.0, 32) is None and bt.resolvable(1.0, 32) is None  # se 0 at the edges: no figure


def test_base_rates_and_the_band(bt) -> None:
    rows = _rows("a", 0, 1, 4, prefix="") + _rows("b", 0, 4, 4, prefix="") + _rows("c", 0, 0, 4, prefix="", infra=2)
    br = bt.base_rates(rows)
    assert br["a"]["rate"] == 0.25 and br["a"]["in_band"] and not br["b"]["in_band"] and not br["c"]["in_band"]
    assert br["c"]["infra"] == 2 and br["c"]["graded"] == 4


def test_behaviour_from_real_captures(bt) -> None:
    per = bt.session_records(FIXTURE, {"hello-file.st0.s1", "make-dir.st0.s0", "make-dir.st0.s2"})
    assert per["hello-file.st0.s1"]["calls"] == 34 and per["hello-file.st0.s1"]["tools"] == {"read": 2, "write": 32}
    assert per["make-dir.st0.s0"] == {"calls": 1, "tool_calls": 0, "tools": {}, "sampled_tokens": 40, "answer_tokens": 40}
    rows = [{"session_id": "make-dir.st0.s0", "status": "ok", "reward": 0.0},
            {"session_id": "make-dir.st0.s2", "status": "ok", "reward": 1.0},
            {"session_id": "hello-file.st0.s1", "status": "timeout", "reward": None}]
    b = bt.behaviour(rows, per)
    assert b["tool_call_rate"] == pytest.approx(2 / 3) and b["timeouts"] == 1
    assert b["calls_per_sample"] == pytest.approx((1 + 3 + 34) / 3)
    assert b["tool_calls_per_sample"] == pytest.approx((0 + 2 + 34) / 3)
    assert b["answer_tokens_mean"] == pytest.approx((40 + 40 + 38) / 3)
    assert b["passed_with_tool_call"] == 1 and b["passed_without_tool_call"] == 0


def _fake_run(run: Path) -> None:
    (run / "eval").mkdir(parents=True)
    (run / "captures" / "sessions").mkdir(parents=True)
    pl.DataFrame(_eval_rows()).write_parquet(run / "eval" / "rollouts.parquet")
    train = [r for s in range(5) for r in _rows("create-greeting", s, min(s + 2, 8), 8, prefix="")]
    pl.DataFrame(train).write_parquet(run / "captures" / "rollouts.parquet")
    steps = [{"step": s, "policy_version": s, "groups_with_variance": ["g"], "note": None, "wall_s": 300.0,
              "train": {"updated": True, "policy_version": s + 1, "metrics": {"loss": 0.1}, "t_start": 10.0, "t_end": 130.0},
              "push": {"reload_s": 4.0}, "evaluation": {"policy_version": s} if s == 0 else None} for s in range(4)] + \
        [{"step": 4, "policy_version": 4, "note": "final rollout", "evaluation": {"policy_version": 4}}]
    (run / "loop-state.json").write_text(json.dumps({"steps": steps, "next_step": 5}))
    (run / "loop-report.json").write_text(json.dumps({"finished": True}))
    (run / "bench-loop-0.log").write_text("serve done in 51.2 s (ready)\nrollout 0 done in 300.0 s\neval 0 done in 600.0 s\n"
                                          "train 0 done in 120.0 s\npush v1 done in 4.0 s\neval 4 done in 540.0 s\n")


def test_the_result_has_learning_json_keys_and_the_task_sets(bt, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    a = bt.parse(["--family", "shell", "--eval-task", "create-poem", "--eval-task", "rename-notes",
                  "--eval-task", "csv-price", "--eval-task", "find-word"])
    fam = bt.manifest("shell")
    train, evals = bt.pick(fam["train"], a.train_task, "train"), bt.pick(fam["eval"], a.eval_task, "eval")
    settings = {k: getattr(a, k) for k in bt.SETTINGS}
    res = bt.analyse(run, a, settings, train, evals)
    res["demo_exit"] = 0
    learning = json.loads((BENCHMARKS / "results" / "learning_qwen2.5-coder-0.5b-instruct_pi-chat_seed0.json").read_text())
    assert set(learning) <= set(res)
    assert {"train_tasks", "eval_tasks", "behaviour", "family"} <= set(res)
    assert [t["id"] for t in res["eval_tasks"]] == ["create-poem", "rename-notes", "csv-price", "find-word"]
    assert {t["kind"] for t in res["eval_tasks"]} == {"same-operation", "new-operation"}
    assert len(res["train_tasks"]) == 9 and res["finished"]
    assert res["evaluation"]["by_kind"]["new-operation"]["pooled"]["post"]["passed"] == 27
    assert res["evaluation"]["policy_versions"] == {"base": 0, "trained": 4}
    # the fake run's eval timeouts (reward 0) are failures under timeout_fails: n grows, passes do not
    tc = res["evaluation"]["timeout_conventions"]
    assert tc["timeout_fails"]["pre"]["graded"] == 132 and tc["timeout_fails"]["pre"]["passed"] == 36
    assert res["per_iteration"][0] == {"iteration": 0, "rollout": 300.0, "trajectories": None, "eval": 600.0,
                                       "train": 120.0, "push": 4.0}
    assert res["phases"]["push v1"] == 4.0 and res["training"][0]["train_s"] == 120.0 and len(res["training"]) == 4
    # 4 x (33 + 32) eval + 40 training samples over 300 + 600 + 540 s of rollout and eval phases
    assert res["throughput"]["samples_per_hour"] == pytest.approx(round(300 / 1440 * 3600, 1))
    assert [c["mean"] for c in res["reward_curve"]] == [2 / 8, 3 / 8, 4 / 8, 5 / 8, 6 / 8]
    assert res["behaviour"]["trained"]["all"]["samples"] == 128
    json.dumps(res, default=str)
    bt.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_loop_toml_parses_and_evaluates_the_other_set(bt) -> None:
    from polar_runtime.loop.config import parse_config

    a = bt.parse(["--family", "shell", "--seed", "1"])
    fam = bt.manifest("shell")
    cfg = parse_config(bt.loop_toml(a, fam, Path("/tmp/r"), fam["train"], fam["eval"]))
    assert cfg.eval.tasks == "benchmarks/tasks/transfer/eval" and cfg.tasks.source == "benchmarks/tasks/transfer/train"
    assert cfg.eval.every == cfg.rollout.iterations == 4 and cfg.eval.samples == 32 and cfg.sampling.seed == 1
    b = bt.parse(["--family", "trivia", "--base-rates", "--base-samples", "3"])
    cfg = parse_config(bt.loop_toml(b, bt.manifest("trivia"), Path("/tmp/r"), [], []))
    assert (cfg.rollout.iterations, cfg.eval.every, cfg.eval.samples, cfg.rollout.samples_per_group) == (0, 1, 3, 3)
    est = bt.estimate(9, 6, 8, 32, 4, 0, samples_per_hour=100.0, train_s=900.0, start_s=0.0)
    assert est["rollout_samples"] == 5 * 9 * 8 and est["eval_samples"] == 384
    assert est["hours"] == pytest.approx((360 + 384) / 100 + 4 * 900 / 3600, abs=0.01)
    assert cfg.rollout.final_rollout  # base rates: step 0 is the last step and its rollout is the train side
    assert bt.parse(["--base-rates", "--no-final-rollout"]) and parse_config(bt.loop_toml(
        bt.parse(["--base-rates", "--no-final-rollout"]), fam, Path("/tmp/r"), [], [])).rollout.final_rollout


def test_no_final_rollout_reaches_the_loop_the_estimate_and_old_run_directories(bt, tmp_path: Path) -> None:
    from polar_runtime.loop.config import parse_config

    fam = bt.manifest("shell")
    a = bt.parse(["--family", "shell", "--iterations", "1", "--no-final-rollout"])
    assert parse_config(bt.loop_toml(a, fam, Path("/tmp/r"), fam["train"], fam["eval"])).rollout.final_rollout is False
    assert parse_config(bt.loop_toml(bt.parse(["--iterations", "1"]), fam, Path("/tmp/r"), fam["train"],
                                     fam["eval"])).rollout.final_rollout is True
    est = bt.estimate(9, 6, 8, 32, 1, 0, samples_per_hour=100.0, train_s=0.0, start_s=0.0, final_rollout=False)
    assert est["rollout_samples"] == 72 and est["hours"] == pytest.approx((72 + 384) / 100, abs=0.01)
    # a run directory from before the option holds no final_rollout: it reads as the default (True)
    settings = {k: getattr(bt.parse(["--iterations", "1"]), k) for k in bt.SETTINGS}
    run = tmp_path / "old"
    run.mkdir()
    (run / "bench-settings.json").write_text(json.dumps({k: v for k, v in settings.items() if k != "final_rollout"}))
    assert bt.prepare(run, settings) == "resume"
    with pytest.raises(SystemExit, match="final_rollout"):
        bt.prepare(run, settings | {"final_rollout": False})
