"""benchmarks/bench_learning.py's parts that decide its verdict and its resume, on synthetic rows
(seconds; the experiment itself is the benchmark, not a test)."""

from __future__ import annotations

import json
import math

import pytest

from polar_analysis import passk
from polar_testing.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bl():
    return load_benchmark("bench_learning")


def _row(task: str, step: int, k: int, status: str = "ok", reward: float | None = 1.0, wall: float = 10.0) -> dict:
    return {"task_id": task, "step": step, "sample_index": k, "session_id": f"{task}.st{step}.s{k}", "status": status,
            "reward": reward, "wall_s": wall, "eval_s": 0.5}


def test_compare_rates_standard_errors_and_difference(bl):
    c = bl.compare((8, 32), (20, 32))
    assert c["pre"]["rate"] == 0.25 and c["post"]["rate"] == 0.625
    # the same standard error polar eval prints (pass@1's jackknife)
    assert c["pre"]["se"] == pytest.approx(passk.pass_at_k_stderr(32, 8, 1))
    assert c["post"]["se"] == pytest.approx(passk.pass_at_k_stderr(32, 20, 1))
    assert c["diff"] == pytest.approx(0.375)
    assert c["diff_se"] == pytest.approx(math.hypot(c["pre"]["se"], c["post"]["se"]))
    assert c["diff_over_se"] == pytest.approx(0.375 / c["diff_se"])
    assert c["diff_over_se"] > 3.2
    pool = 28 / 64
    assert c["z_pooled"] == pytest.approx(0.375 / math.sqrt(pool * (1 - pool) * (2 / 32)))
    # all-or-nothing sides: the per-side se is 0, the ratio undefined, the pooled z still defined
    d = bl.compare((0, 32), (32, 32))
    assert d["diff_se"] == 0 and d["diff_over_se"] is None and d["z_pooled"] > 7


def test_evaluation_table_splits_steps_strips_prefix_and_leaves_infra_out(bl):
    rows = [_row("eval-a", 0, k, reward=1.0 if k < 2 else 0.0) for k in range(8)]
    rows += [_row("eval-a", 4, k, reward=1.0 if k < 6 else 0.0) for k in range(8)]
    rows += [_row("eval-a", 4, 8, status="timeout", reward=1.0), _row("eval-a", 0, 8, status="ok", reward=None)]
    rows += [_row("eval-b", 0, k, reward=0.0) for k in range(4)] + [_row("eval-b", 4, k, reward=1.0) for k in range(4)]
    t = bl.evaluation_table(rows, 0, 4)
    assert set(t["tasks"]) == {"a", "b"}
    a = t["tasks"]["a"]
    assert (a["pre"]["passed"], a["pre"]["graded"], a["post"]["passed"], a["post"]["graded"]) == (2, 8, 6, 8)
    assert (a["infra_pre"], a["infra_post"]) == (1, 1)  # no verdict before, a timeout (even one that passed) after
    p = t["pooled"]
    assert (p["pre"]["passed"], p["pre"]["graded"], p["post"]["passed"], p["post"]["graded"]) == (2, 12, 10, 12)


def test_reward_curve_per_step(bl):
    rows = [_row("a", 0, k, reward=float(k % 2)) for k in range(4)] + [_row("a", 1, k, reward=1.0) for k in range(3)]
    rows.append(_row("a", 1, 3, status="timeout", reward=None))
    c = bl.reward_curve(rows)
    assert [x["step"] for x in c] == [0, 1]
    assert c[0]["mean"] == 0.5 and c[0]["se"] == pytest.approx(math.sqrt(1 / 3) / 2)
    assert c[1]["mean"] == 0.75 and c[1]["timeouts"] == 1


def test_time_split_and_call_times(bl, tmp_path):
    sess = tmp_path / "sessions"
    sess.mkdir()
    recs = [{"record_type": "call", "status": "ok", "session_id": "a.st0.s0", "completion_tokens": 10,
             "t_upstream_sent": 100.0, "t_upstream_first_byte": 101.0, "t_upstream_end": 103.0},
            {"record_type": "call", "status": "ok", "session_id": "a.st0.s0", "completion_tokens": 6,
             "t_upstream_sent": 110.0, "t_upstream_first_byte": 110.5, "t_upstream_end": 112.0},
            {"record_type": "call", "status": "error", "session_id": "a.st0.s0", "completion_tokens": 50}]
    (sess / "a.st0.s0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    calls = bl.call_times(sess)
    assert calls["a.st0.s0"] == {"calls": 2, "upstream_s": 5.0, "decode_s": 3.5, "tokens": 16}
    rows = [_row("a", 0, 0, wall=12.0), _row("a", 0, 1, status="timeout", wall=60.0)]
    s = bl.time_split(rows, calls)
    assert (s["vllm_s"], s["harness_overhead_s"], s["timeout_s"], s["timeouts"]) == (5.0, 7.0, 60.0, 1)
    assert s["sampled_tokens"] == 16 and s["vllm_decode_tok_s"] == pytest.approx(16 / 3.5, abs=0.05)


def test_phase_times_sum_a_phase_run_again_after_a_resume(bl, tmp_path):
    (tmp_path / "bench-demo-0.log").write_text("rollout 0 done in 30.5 s (mean reward 0.2)\ntrain 0 done in 12.0 s\n"
                                               "  rollout 1 done in 40.0 s\n")
    (tmp_path / "bench-demo-1.log").write_text("rollout 0 done in 1.5 s\ntrain 0 done in 11.0 s (peak RSS 2.0 GiB)\n")
    ph = bl.phase_times(sorted(tmp_path.glob("bench-demo-*.log")))
    assert ph == {"rollout 0": 32.0, "train 0": 23.0, "rollout 1": 40.0}
    it = bl.per_iteration(ph, 1)
    assert it[0]["rollout"] == 32.0 and it[0]["push"] is None and it[1]["rollout"] == 40.0


def test_resume_keeps_samples_drops_trainer_state_and_refuses_other_settings(bl, tmp_path):
    run = tmp_path / "run"
    settings = {"seed": 0, "lr": 2e-5}
    assert bl.prepare_resume(run, settings) == "new"
    (run / "captures" / "rollouts").mkdir(parents=True)
    (run / "captures" / "rollouts" / "a.st0.s0.json").write_text("{}")
    (run / "train" / "checkpoint-000004").mkdir(parents=True)
    (run / "loop-state.json").write_text("{}")  # the demo's loop: its progress points at that checkpoint
    # cut: the finished samples stay, a checkpoint the demo would resume from and train on again goes
    assert bl.prepare_resume(run, settings) == "resume"
    assert (run / "captures" / "rollouts" / "a.st0.s0.json").exists()
    assert not (run / "train").exists() and not (run / "loop-state.json").exists()
    (run / "report.json").write_text("{}")
    assert bl.prepare_resume(run, settings) == "done"
    with pytest.raises(SystemExit, match="other settings"):
        bl.prepare_resume(run, {"seed": 1, "lr": 2e-5})


def test_demo_argv_evaluates_before_the_first_and_after_the_last_update(bl, tmp_path):
    a = bl.argparse.Namespace(harness="pi-chat", model="m", tasks="t.jsonl", samples=8, iterations=3, eval_samples=32,
                              seed=1, max_tokens=32, timeout=60.0, concurrency=4, lr=2e-5, lora_rank=0,
                              max_model_len=4096, kl_coef=None, task=["x"])
    argv = bl.demo_argv(a, tmp_path)
    opt = {argv[i]: argv[i + 1] for i in range(2, len(argv) - 1) if argv[i].startswith("--")}
    # --eval-every N with --iterations N: the demo evaluates at step 0 (the base policy) and step N
    assert opt["--eval-every"] == opt["--iterations"] == "3" and opt["--eval-samples"] == "32"
    assert "--keep" in argv and opt["--task"] == "x" and opt["--seed"] == "1"
