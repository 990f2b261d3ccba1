"""The verifier's verdict when test.sh dies without a reward, on a scripted sandbox (no phase runs;
seconds): killed at a memory limit clamped to this host is the machine's failure (no verdict),
killed at the task's own limit or by another signal is the sample's (0), a plain missing reward
stays an infrastructure error."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_trial.sandbox.base import SandboxResult
from polar_trial.tasks import load_tasks
from polar_trial.verifier import verify


class ScriptedSandbox:
    """Answers every run with one result; writes nothing (test.sh never runs)."""

    builds_images = False

    def __init__(self, result: SandboxResult):
        self.result = result

    def inside(self, spec, path):
        return spec.inside(path)

    def run(self, spec, argv, **_):
        return self.result


def _task(tmp_path: Path, memory: str = "2G"):
    d = tmp_path / "ds" / "t"
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "task.toml").write_text(f'[environment]\nmemory = "{memory}"\n')
    (d / "instruction.md").write_text("t\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/usr/bin/env bash\ntrue\n")
    [task] = load_tasks(d)
    return task


OOM = "memory limit hit: the OOM killer ended 1 process(es)"


@pytest.mark.parametrize("rc,notes,clamp,want", [
    (137, [OOM], True, (None, "error", "clamped to this host")),
    (137, [OOM], False, (0.0, "fail", "task's memory limit")),
    (137, [], False, (0.0, "fail", "killed by signal 9")),
    (-15, [], False, (0.0, "fail", "killed by signal 15")),
    (0, [], False, (None, "error", "wrote no")),
    (1, [OOM], True, (None, "error", "wrote no")),
])
def test_a_verdict_without_a_reward(tmp_path, rc, notes, clamp, want):
    task = _task(tmp_path)
    if clamp:
        task.clamped["memory_mb"] = task.memory_mb * 64
    sample = tmp_path / "sample"
    work = tmp_path / "work"
    work.mkdir()
    ev = verify(task, sandbox=ScriptedSandbox(SandboxResult(rc, False, list(notes))), sample_dir=sample,
                workdir_host=work, agent_logs=sample / "logs")
    assert (ev.reward, ev.status) == want[:2], ev.output
    assert want[2] in ev.output, ev.output
