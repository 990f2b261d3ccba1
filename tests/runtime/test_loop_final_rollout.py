"""``rollout.final_rollout = false``: after the last update the loop evaluates and rolls out nothing
(a transfer run measures another task set; the train tasks' last rollout was 1/7 of a shell seed's
samples). The fake placement of loop_fakes.py logs every sample it runs. ~1 s."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from polar_runtime.loop import config as c
from polar_runtime.loop.loop import run_loop

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from loop_fakes import FakePlacement  # noqa: E402


def _run(tmp_path: Path, final: bool, k: int) -> tuple[dict, list[str]]:
    out = tmp_path / f"run-{final}-{k}"
    cfg = c.parse_config(f'out = "{out}"\n[tasks]\nlimit = 2\n[rollout]\nsamples_per_group = 4\niterations = 2\n'
                         f"final_rollout = {str(final).lower()}\n[schedule]\nmax_off_policy_steps = {k}\n"
                         '[eval]\nevery = 2\n[placement]\nkind = "loop_fakes:FakePlacement"\n')
    report = run_loop(cfg, FakePlacement(cfg, out), out, log=lambda _m: None, metrics=False)
    return report, (out / "executed.log").read_text().split()


@pytest.mark.parametrize("k", [0, 1])
def test_without_the_final_rollout_the_last_step_only_evaluates(tmp_path: Path, k: int) -> None:
    with_final, ran_with = _run(tmp_path, True, k)
    without, ran_without = _run(tmp_path, False, k)
    assert any(".st2." in s for s in ran_with)  # the default rolls the train tasks out after the last update
    assert not any(".st2." in s for s in ran_without)
    assert sorted(ran_without) == sorted(s for s in ran_with if ".st2." not in s)  # steps 0-1: the same samples
    last = without["steps"][-1]
    assert last["step"] == 2 and last["rewards"]["samples"] == 0 and last["groups"] == []
    assert last["note"] == "final evaluation (no rollout)" and last["evaluation"]["policy_version"] == 2
    evaluated = lambda r: [s["step"] for s in r["steps"] if s.get("evaluation")]  # noqa: E731
    # synchronous: base and last; asynchronous mode evaluates at its last (synchronous) step only
    assert evaluated(without) == ([0, 2] if k == 0 else [2]) == evaluated(with_final)
    assert without["reward_after"] is None  # the train reward after the last update was not measured


def test_no_final_rollout_needs_an_evaluation() -> None:
    with pytest.raises(c.ConfigError, match="rollout.final_rollout = false leaves the last step only its evaluation"):
        c.parse_config("[rollout]\nfinal_rollout = false\n")
    assert c.parse_config("[rollout]\nfinal_rollout = false\n[eval]\nevery = 1\n").rollout.final_rollout is False


def test_the_demo_report_skips_a_last_step_that_sampled_nothing(tmp_path: Path) -> None:
    """The demo builds trajectories for steps the loop did not (the final rollout); a final evaluation
    sampled no training task, so there is nothing to build and no training entry to report."""
    import polars as pl
    from rich.console import Console

    from polar_runtime.demo import step_entries
    from polar_runtime.loop.loop import FINAL_EVALUATION_NOTE
    from polar_runtime.loop.phases import Timeline
    from polar_runtime.loop.state import LoopState

    (tmp_path / "captures").mkdir()
    pl.DataFrame({"step": [0, 0], "session_id": ["a.st0.s0", "a.st0.s1"], "task_id": ["a", "a"], "reward": [0.0, 1.0],
                  "status": ["ok", "ok"], "calls": [1, 1]}).write_parquet(tmp_path / "captures" / "rollouts.parquet")
    trained = {"step": 0, "policy_version": 0, "trajectories": {"sequences": 2, "drift": {}, "file": "t.parquet"},
               "train": {"policy_version": 1}, "groups_with_variance": ["a.st0"], "push": {"method": "x"}}
    last = {"step": 1, "policy_version": 1, "note": FINAL_EVALUATION_NOTE, "evaluation": {"step": 1}}
    state = LoopState(config={}, steps=[trained, last])
    steps, training = step_entries(tmp_path, state, tmp_path, Timeline(Console(quiet=True)))
    assert [s["step"] for s in steps] == [0] and [t["iteration"] for t in training] == [0]
    assert steps[0]["rewards"]["samples"] == 2
