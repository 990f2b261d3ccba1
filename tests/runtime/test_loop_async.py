"""Asynchronous rollouts in the real loop (``schedule.max_off_policy_steps = k``), with the fake
placement of tests/runtime/loop_fakes.py: the loop, its admission control, its state file and the
CLI are real; ages are read back from the fakes' per-call captures (the served policy_version).

- the bound holds, and is used: with room for k batches in flight the oldest trained group is
  exactly k behind; the first test FAILS when admission control is removed (checked by hand:
  ``adm.can_admit`` bypassed in asynchronous.py, the loop then trains a group 2 versions old at
  k = 1 and stops with "admission control failed");
- a GRPO group is never split; a straggler that cannot finish within the bound is dropped whole,
  counted, and none of its samples is trained;
- the age histogram of trained tokens and the idle fractions of trainer and vLLM are reported
  (MetricsLog rows in ``<out>/metrics.jsonl``, and the report);
- ``kill -9`` while the trainer steps, the same command resumes and finishes within the bound.

Times on the 2-core dev box (shared): ~5 s for the in-process tests (4 s of it TensorBoard's import),
~10 s for the kill test; 15-18 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_core.paths import REPO_ROOT
from polar_runtime.loop import config as c
from polar_runtime.loop.loop import run_loop
from polar_runtime.loop.state import STATE_FILE, LoopState

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from loop_fakes import FakePlacement  # noqa: E402

POLAR = str(Path(sys.executable).with_name("polar"))


def _cfg(k: int, iterations: int = 4, in_flight: int = 0, out: str = "runs/loop") -> c.LoopConfig:
    return c.parse_config(f'out = "{out}"\n[tasks]\nlimit = 3\n[rollout]\nsamples_per_group = 2\ngroups_per_step = 2\n'
                          f"iterations = {iterations}\n[schedule]\nmax_off_policy_steps = {k}\n"
                          f"groups_in_flight = {in_flight}\n[placement]\nkind = \"loop_fakes:FakePlacement\"\n")


def _run(cfg: c.LoopConfig, out: Path, metrics: bool = False, **timing: object) -> dict:
    p = FakePlacement(cfg, out)
    p.timing.update(timing)
    return run_loop(cfg, p, out, log=lambda _m: None, metrics=metrics)


def _trained_sessions(out: Path) -> dict[int, list[str]]:
    return {int(p.stem.split("-")[1]): [r["session_id"] for r in json.loads(p.read_text())]
            for p in sorted((out / "trajectories").glob("step-*.json"))}


# 0.3 s each
@pytest.mark.parametrize("k", [1, 2])
def test_admission_control_keeps_every_trained_token_within_k_and_uses_the_bound(k: int, tmp_path: Path) -> None:
    # room for 4 groups (2 batches) in flight; the trainer starts when rollouts are idle, so the
    # versions that sample each group follow from the schedule alone
    rep = _run(_cfg(k, in_flight=4), tmp_path, train_waits=True, calls=2)
    assert rep["finished"] and rep["policy_version"] == 4
    ages = [int(a) for a in rep["staleness_tokens"]]
    assert max(ages) == k  # within the bound, and the bound is used (rollouts ran ahead of the trainer)
    for s in rep["steps"][:-1]:
        assert max(s["group_ages"].values()) <= k


# 0.05 s
def test_k_0_is_the_synchronous_loop(tmp_path: Path) -> None:
    rep = _run(_cfg(0), tmp_path)
    assert set(rep["staleness_tokens"]) == {"0"} and "group_ages" not in rep["steps"][0]


# 0.2 s
def test_a_group_is_never_split_and_a_straggler_is_dropped_whole_and_counted(tmp_path: Path) -> None:
    rep = _run(_cfg(1, iterations=3, in_flight=3), tmp_path, straggler="beta.st0", straggler_s=30.0)
    assert rep["finished"]
    assert rep["dropped_groups"] == ["beta@b0"]  # moved to batch 1 within the bound, dropped when batch 2 was ready
    trained = _trained_sessions(tmp_path)
    everything = [sid for sids in trained.values() for sid in sids]
    assert len(everything) == len(set(everything))  # no sample trained twice
    assert not [sid for sid in everything if sid.startswith("beta.st0.")]  # none of the dropped group's samples
    groups: dict[str, list[int]] = {}
    for step, sids in trained.items():
        for sid in sids:
            groups.setdefault(sid.rsplit(".", 1)[0], []).append(step)
    for g, steps in groups.items():  # each group whole (both samples) in one batch
        assert len(steps) == 2 and len(set(steps)) == 1, (g, steps)
    assert max(int(a) for a in rep["staleness_tokens"]) <= 1
    assert sum(len(s.get("dropped") or []) for s in rep["steps"]) == 1


# 4 s (TensorBoard's import)
def test_age_histogram_and_idle_fractions_are_written_through_metrics_log(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    rep = _run(_cfg(1, in_flight=4), tmp_path, metrics=True, train_waits=True, calls=2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    trained = [r for r in rows if r.get("loop/trained_tokens")]
    assert len(trained) == 4
    for r in rows:
        assert 0.0 <= r["loop/trainer_idle_frac"] <= 1.0 and 0.0 <= r["loop/vllm_idle_frac"] <= 1.0
    hist: dict[str, int] = {}
    for r in trained:
        ages = {k.split("_")[1]: v for k, v in r.items() if k.startswith("loop/age_") and k.endswith("_tokens")}
        assert sum(ages.values()) == r["loop/trained_tokens"]
        for a, n in ages.items():
            hist[a] = hist.get(a, 0) + n
    assert hist == rep["staleness_tokens"]
    t = rep["timing"]
    assert t["wall_s"] > 0 and 0.0 <= t["trainer_idle_frac"] <= 1.0 and 0.0 <= t["vllm_idle_frac"] <= 1.0
    assert (tmp_path / "tensorboard").is_dir()


# 10 s (two `polar loop` processes)
def test_kill_9_while_training_then_the_same_command_resumes_within_the_bound(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg_path = tmp_path / "loop.toml"
    text = ('out = "{out}"\n[tasks]\nlimit = 3\n[rollout]\nsamples_per_group = 2\ngroups_per_step = 2\niterations = 4\n'
            "[schedule]\nmax_off_policy_steps = 1\ngroups_in_flight = 4\n[placement]\nkind = \"loop_fakes:FakePlacement\"\n")
    cfg_path.write_text(text.format(out=out))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "WANDB_MODE": "disabled", "POLAR_FAKE_TIMING": json.dumps({"train_waits": True, "calls": 2})}
    proc = subprocess.Popen([POLAR, "loop", str(cfg_path)], env={**env, "POLAR_FAKE_HANG": "train:2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT)
    deadline = time.monotonic() + 60
    while not (out / "hang.marker").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = LoopState.load(out)
    assert before is not None and before.next_step == 2 and before.schedule["groups"]  # batch 3 admitted, in the file
    finished_before = {p.stem for p in (out / "rollouts").glob("*.json")}
    executed_before = len((out / "executed.log").read_text().split())

    done = subprocess.run([POLAR, "loop", str(cfg_path)], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    state = json.loads((out / STATE_FILE).read_text())
    assert state["next_step"] == 5 and state["policy_version"] == 4 and state["resumes"] == 1
    final = json.loads((Path(state["checkpoint"]) / "state.json").read_text())
    assert final["adam"] == final["step"] == 4  # AdamW restored: one update per trained batch
    assert (out / "trained.log").read_text().split() == ["0", "1", "2", "2", "3"]  # the killed step, again
    rerun = (out / "executed.log").read_text().split()[executed_before:]
    assert not finished_before & set(rerun), "a finished sample ran again"
    report = json.loads((out / "loop-report.json").read_text())
    assert max(int(a) for a in report["staleness_tokens"]) <= 1
    for sids in _trained_sessions(out).values():
        assert len(sids) % 2 == 0


# 0.01 s
def test_asynchronous_mode_refuses_to_stop_vllm_while_training() -> None:
    with pytest.raises(c.ConfigError, match=r"<config>:\d+: trainer.server_during_train"):
        c.parse_config('[trainer]\nserver_during_train = "stop"\n[schedule]\nmax_off_policy_steps = 1\n')
    with pytest.raises(c.ConfigError, match="schedule.groups_in_flight must be >= 0"):
        c.parse_config("[schedule]\ngroups_in_flight = -1\n")
