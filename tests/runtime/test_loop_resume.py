"""``polar loop`` resumes after ``kill -9`` in each phase (a rollout, a training step, a push) and ends
exactly where an uninterrupted run ends: same weights, same AdamW step count, same RNG state, same
rewards per step, no finished sample run twice, no finished training step trained twice.

The expensive parts are fakes behind the placement interface (tests/runtime/loop_fakes.py): the
loop, its state file, the CLI and the kills are real. ~15 s in all (each run is a `polar` process)."""

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
from polar_runtime.loop.loop import groups_for, prune_checkpoints
from polar_runtime.loop.state import STATE_FILE, LoopState

HERE = Path(__file__).parent
POLAR = str(Path(sys.executable).with_name("polar"))
CONFIG = """\
out = "{out}"
[tasks]
limit = 2
[rollout]
samples_per_group = 4
iterations = 3
[placement]
kind = "loop_fakes:FakePlacement"
"""


def _env(hang: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("POLAR_FAKE_HANG", None)
    if hang:
        env["POLAR_FAKE_HANG"] = hang
    return env


def _write_config(tmp: Path, out: Path) -> Path:
    p = tmp / f"{out.name}.toml"
    p.write_text(CONFIG.format(out=out))
    return p


def _run(cfg: Path, hang: str | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([POLAR, "loop", str(cfg)], env=_env(hang), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)


def _outcome(out: Path) -> dict:
    state = json.loads((out / STATE_FILE).read_text())
    final = json.loads((Path(state["checkpoint"]) / "state.json").read_text())
    return {"final": final, "version": state["policy_version"], "next": state["next_step"],
            "rewards": [(s["step"], s["policy_version"], s["rewards"]["mean_reward"]) for s in state["steps"]]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ref")
    out = tmp / "ref"
    proc = _run(_write_config(tmp, out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    o = _outcome(out)
    o["executed"] = sorted((out / "executed.log").read_text().split())
    o["trained"] = (out / "trained.log").read_text().split()
    assert len(o["trained"]) >= 2, "the fake should train at least twice for these tests to mean anything"
    return o


def test_an_uninterrupted_run_finishes_every_step(reference: dict) -> None:
    assert reference["next"] == 4 and [r[0] for r in reference["rewards"]] == [0, 1, 2, 3]
    assert reference["version"] == len(reference["trained"]) == reference["final"]["adam"]
    assert len(reference["executed"]) == len(set(reference["executed"])) == 4 * 2 * 4


@pytest.mark.parametrize("hang", ["rollout:1:3", "rollout:0:0", "train:1", "push:1", "push:0", "train:2"])
def test_kill_9_in_a_phase_then_the_same_command_resumes_to_the_same_end(hang: str, tmp_path: Path,
                                                                          reference: dict) -> None:
    out = tmp_path / "run"
    cfg = _write_config(tmp_path, out)
    proc = subprocess.Popen([POLAR, "loop", str(cfg)], env=_env(hang), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=REPO_ROOT)
    marker = out / "hang.marker"
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None, f"the run ended before reaching {hang}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = LoopState.load(out)
    assert before is not None and before.next_step <= int(hang.split(":")[1])

    done = _run(cfg)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stdout
    got = _outcome(out)
    assert got["final"] == reference["final"]  # weights, AdamW step count and RNG state
    assert (got["version"], got["next"], got["rewards"]) == (reference["version"], reference["next"], reference["rewards"])
    executed = (out / "executed.log").read_text().split()
    assert len(executed) == len(set(executed)), "a finished sample ran again"
    assert sorted(executed) == reference["executed"]
    trained = (out / "trained.log").read_text().split()
    phase = hang.split(":")[0]
    # a kill during training loses that step's work (it runs again); after it (the push), nothing
    assert trained == (reference["trained"] + [] if phase != "train" else sorted(reference["trained"] + [hang.split(":")[1]], key=int))
    state = json.loads((out / STATE_FILE).read_text())
    assert state["resumes"] == 1 and state["pending"] is None


def test_a_finished_run_run_again_changes_nothing(tmp_path: Path, reference: dict) -> None:
    out = tmp_path / "again"
    cfg = _write_config(tmp_path, out)
    assert _run(cfg).returncode == 0
    first = _outcome(out)
    proc = _run(cfg)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _outcome(out) == first == {k: reference[k] for k in first}


def test_resuming_under_another_configuration_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "x"
    cfg = _write_config(tmp_path, out)
    assert _run(cfg).returncode == 0
    cfg.write_text(cfg.read_text().replace("samples_per_group = 4", "samples_per_group = 2"))
    proc = _run(cfg)
    assert proc.returncode == 1 and "rollout.samples_per_group: 4 -> 2" in proc.stdout
    proc = subprocess.run([POLAR, "loop", str(cfg), "--fresh"], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_groups_cycle_through_the_tasks_as_a_function_of_the_step() -> None:
    ids = ["a", "b", "c"]
    assert groups_for(0, ids, 0) == ids and groups_for(5, ids, 3) == ids
    assert [groups_for(s, ids, 2) for s in range(3)] == [["a", "b"], ["c", "a"], ["b", "c"]]


def test_prune_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    for n in (1, 2, 3, 10):
        (tmp_path / f"step-{n}").mkdir()
    assert prune_checkpoints(tmp_path, 2, {str(tmp_path / "step-1")}) == ["step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-10", "step-3"]
