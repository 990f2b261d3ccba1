"""Multi-step Harbor tasks (``tasks/steps.py``, ``steprun.py``): the format read as Harbor 0.26
reads it, and a trial of steps in the local mode (bubblewrap), the oracle playing the sample:
each step's solution, workdir files and setup.sh, then its own tests; ``min_reward`` stops the
rest; the reward is Harbor's trial reward, every step's recorded. The live-environment variant
(a process a step leaves, seen by the next) is in sandbox/test_steps_live.py."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from polar_trial.tasks import load_tasks
from polar_trial.tasks.steps import StepResult, TaskStep, min_reward_failure, stop_after, trial_reward


def _step(d: Path, name: str, instruction: str, solve: str | None = None, test: str | None = None,
          files: dict[str, str] | None = None) -> None:
    s = d / "steps" / name
    s.mkdir(parents=True)
    (s / "instruction.md").write_text(instruction)
    if solve is not None:
        (s / "solution").mkdir()
        (s / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    if test is not None:
        (s / "tests").mkdir()
        (s / "tests" / "test.sh").write_text("#!/bin/bash\n" + textwrap.dedent(test))
    for rel, text in (files or {}).items():
        (s / "workdir").mkdir(exist_ok=True)
        (s / "workdir" / rel).write_text(text)


def make_task(root: Path, toml: str, shared_test: str | None = "echo 0 > /logs/verifier/reward.txt\n") -> Path:
    d = root / "multi"
    (d / "environment").mkdir(parents=True)
    (d / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    (d / "task.toml").write_text('version = "1.0"\n' + toml + '\n[verifier]\ntimeout_sec = 30\n[agent]\ntimeout_sec = 30\n')
    if shared_test is not None:
        (d / "tests").mkdir()
        (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + shared_test)
        (d / "tests" / "helper.sh").write_text("grep -q one /app/a.txt\n")
    return d


# --- Harbor's rules (trial/multi_step.py, trial/trial.py) ---------------------------------------

def test_min_reward_and_the_trial_reward_follow_harbor():
    assert min_reward_failure(0.5, 0.6) == "reward=0.5 below min_reward 0.6"
    assert min_reward_failure(0.6, 0.6) is None and min_reward_failure(None, None) is None
    assert min_reward_failure(None, 0.0) == "reward=-inf below min_reward 0"  # no verdict: -inf
    assert min_reward_failure(1.0, {"reward": 1.0}) is None
    r = [StepResult("a", 1.0, "pass"), StepResult("b", None, "error"), StepResult("c", 0.0, "fail")]
    assert trial_reward(r, "mean") == 0.5  # steps without a verdict are not in the denominator
    assert trial_reward(r, "final") == 0.0 and trial_reward(r[:2], "final") is None
    assert trial_reward([], "mean") is None and trial_reward([StepResult("a", None, "error")], "mean") is None
    step = TaskStep("a", "x", Path("/nonexistent"))
    assert stop_after(step, StepResult("a", None, "error", agent_status="timeout"))  # failed with no verdict
    assert not stop_after(step, StepResult("a", 0.0, "fail", agent_status="timeout"))  # a verdict: go on
    assert math.isinf(-math.inf)


def test_steps_load_with_their_instructions_and_refusals_name_the_key(tmp_path):
    d = make_task(tmp_path, 'multi_step_reward_strategy = "final"\n[[steps]]\nname = "one"\nmin_reward = 1\n'
                            '[[steps]]\nname = "two"\n[steps.verifier]\ntimeout_sec = 7\nenv = { K = "v" }\n')
    _step(d, "one", "First do this.\n")
    _step(d, "two", "Then that.\n")
    (t,) = load_tasks(d)
    assert [s.name for s in t.steps] == ["one", "two"] and t.instruction == "First do this."
    assert t.reward_strategy == "final" and t.steps[0].min_reward == 1.0 and t.steps[1].verifier_timeout == 7.0
    assert t.steps[1].verifier_env == {"K": "v"}
    for toml, why in [
        ('[[steps]]\nname = "one"\nhealthcheck = { command = "true" }\n', "healthcheck is not supported"),
        ('[[steps]]\nname = "one"\nartifacts = ["x"]\n', "artifacts is not supported"),
        ('[[steps]]\nname = "one"\n[steps.verifier]\nenvironment_mode = "separate"\n', "environment_mode is not supported"),
        ('[[steps]]\nname = "one"\nmin_reward = { accuracy = 0.5 }\n', "min_reward names ['accuracy']"),
        ('[[steps]]\nname = "one"\n[[steps]]\nname = "ONE"\n', "must be unique"),
        ('[[steps]]\nname = "../x"\n', "one portable directory name"),
        ('[[steps]]\nname = "three"\n', "steps/three/instruction.md"),
        ('multi_step_reward_strategy = "max"\n[[steps]]\nname = "one"\n', "multi_step_reward_strategy"),
        ('[[steps]]\nname = "one"\n[verifier]\nenvironment_mode = "separate"\n', "a separate environment per step"),
    ]:
        bad = make_task(tmp_path / f"b{abs(hash(toml))}", toml)
        if "[verifier]" in toml:  # make_task's own [verifier] table would be a second one
            (bad / "task.toml").write_text('version = "1.0"\n' + toml)
        _step(bad, "one", "x\n")
        with pytest.raises(ValueError, match=None) as err:
            load_tasks(bad)
        assert why in str(err.value), (toml, err.value)


def test_a_step_with_no_test_of_its_own_and_no_shared_one_is_refused(tmp_path):
    d = make_task(tmp_path, '[[steps]]\nname = "one"\n', shared_test=None)
    _step(d, "one", "x\n")
    with pytest.raises(ValueError, match="neither steps/one/tests/test.sh nor tests/test.sh"):
        load_tasks(d)


# --- a trial of steps, the oracle playing it (bubblewrap) ---------------------------------------

def test_a_trial_of_steps_carries_its_work_over_and_min_reward_stops_it(tmp_path):
    """Step one's oracle writes a.txt (its own test, which also sources the shared tests/ dir);
    step two's workdir file and setup.sh are there before its oracle, which fails its test
    (min_reward 1 stops step three). Harbor's trial reward: the mean of the verified steps, 0.5."""
    from polar_runtime import rollout as r
    from polar_runtime.harnesses import Endpoint, get_preset
    from polar_trial.sandbox import SandboxUnavailable, get_sandbox

    try:
        get_sandbox("bubblewrap")
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    d = make_task(tmp_path, '[[steps]]\nname = "one"\n[[steps]]\nname = "two"\nmin_reward = 1.0\n'
                            '[[steps]]\nname = "three"\n')
    _step(d, "one", "Write a.txt.\n", solve="echo one > a.txt\n",
          test="bash /tests/helper.sh && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")
    _step(d, "two", "Extend it.\n", solve="cat given.txt set-up.txt >> a.txt; false\n",
          test="grep -q given a.txt && grep -q prepared a.txt && echo 0.0 > /logs/verifier/reward.txt\n",
          files={"given.txt": "given\n", "setup.sh": "echo prepared > set-up.txt\n"})
    _step(d, "three", "Never reached.\n", solve="touch three-ran\n")
    tasks = load_tasks(d)
    cfg = r.RolloutConfig(tasks=tasks, preset=get_preset("oracle"), endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "cap", model="-", samples=1, timeout=60, settle_s=0.0,
                          sandbox="bubblewrap", work_root=tmp_path / "work")
    (row,) = r.run_rollout(cfg).iter_rows(named=True)
    steps = json.loads(row["step_rewards"])
    assert [(s["name"], s["reward"], s["status"]) for s in steps] == [
        ("one", 1.0, "pass"), ("two", 0.0, "fail"), ("three", None, "not run")], (steps, row["sandbox_notes"])
    assert "reward=0.0 below min_reward 1" in steps[1]["stopped"]
    assert row["reward"] == 0.5 and row["turns"] == 2, row
    work = Path(row["workdir"])
    assert (work / "a.txt").read_text() == "one\ngiven\nprepared\n" and not (work / "three-ran").exists()
    assert (Path(row["verifier_dir"]) / "one" / "verifier" / "reward.txt").read_text().strip() == "1"
