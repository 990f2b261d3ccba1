"""A multi-step task's trial (``tasks/steps.py`` has the format and Harbor's rules): what the
rollout does around each step's agent turn.

Before a step (``begin_step``): its ``steps/<name>/workdir/`` files are copied into the work dir
(``hostfs.copy_tree``: never through a link an earlier step left there), the oracle's
``/solution`` is refilled with that step's solution (in place: a live trial's bind of the dir
stays valid), and the step's ``setup.sh`` runs where the agent will (``run_setup``).

After it (``verify_step``): the step's tests run in the same environment (the live trial's
verifier view on a container backend), their verdict is that step's reward, kept under
``<sample>/steps/<name>/verifier``; ``min_reward`` (or a failed agent with no verdict) stops the
steps after it. ``finish`` sets the sample's reward as Harbor's trial reports it and records every
step's (``step_rewards``, JSON, in rollouts.parquet).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polar_trial.tasks.steps import StepResult, TaskStep, step_task, stop_after, trial_reward


def begin_step(task: Any, step: TaskStep, workdir: Path, solution: Path | None) -> list[str]:
    from polar_trial.sandbox.hostfs import clear_dir, copy_tree

    notes = []
    files = step.workdir_files
    if files is not None:
        copy_tree(files, workdir)
        notes.append(f"step {step.name}: steps/{step.name}/workdir copied into the work dir")
    if solution is not None:
        clear_dir(solution)
        st = step_task(task, step)
        if st.has_solution:
            own = step.dir / "solution"
            copy_tree(own if (own / "solve.sh").is_file() else task.root / "solution", solution)
    return notes


def run_setup(step: TaskStep, box: Any, spec: Any, workdir: Path, logs: Path) -> str | None:
    """Run ``setup.sh`` (copied into the work dir from the step's ``workdir/``) where the agent
    runs, as Harbor does before the step's agent; the error that stops the step, or None."""
    if step.workdir_files is None or not (step.workdir_files / "setup.sh").is_file():
        return None
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"setup-{step.name}.log"
    with open(log, "wb") as out:
        res = box.run(spec, ["bash", f"{spec.workdir.rstrip('/')}/setup.sh"], stdout=out, stderr=out)
    if res.timed_out or res.returncode != 0:
        tail = log.read_text(errors="replace")[-400:]
        return f"step {step.name}: setup.sh " + ("timed out" if res.timed_out else f"exited {res.returncode}") + f": {tail}"
    return None


def verify_step(task: Any, step: TaskStep, agent_status: str, *, sandbox: Any, sample_dir: Path, workdir: Path,
                logs: Path, image: str | None, timeout: float, facts: dict[str, str]) -> tuple[StepResult, list[str]]:
    from polar_trial.verifier import verify

    where = sample_dir / "steps" / step.name
    where.mkdir(parents=True, exist_ok=True)
    ev = verify(step_task(task, step), sandbox=sandbox, sample_dir=where, workdir_host=workdir, agent_logs=logs,
                image=image, timeout=step.verifier_timeout or task.verifier_timeout or timeout,
                facts={**facts, "step": step.name})
    res = StepResult(step.name, ev.reward, ev.status, agent_status)
    res.stopped = stop_after(step, res) or ""
    notes = [f"step {step.name}: verifier: {n}" for n in ev.notes]
    notes.append(f"step {step.name}: reward {ev.reward} ({ev.status})" + (f"; {res.stopped}: later steps not run"
                                                                          if res.stopped else ""))
    return res, notes


def finish(row: dict[str, Any], task: Any, results: list[StepResult], sample_dir: Path) -> None:
    """The sample's reward: the trial's, as Harbor computes it from its steps' rewards."""
    ran = {r.name for r in results}
    rows = [r.as_dict() for r in results] + [StepResult(s.name, None, "not run").as_dict()
                                             for s in task.steps if s.name not in ran]
    reward = trial_reward(results, task.reward_strategy)
    last = results[-1] if results else None
    row.update(reward=reward, step_rewards=json.dumps(rows),
               evaluator_status=("none" if reward is None else "pass" if reward >= 1.0 else "fail") if last else "none",
               evaluator_output=f"{len(results)} of {len(task.steps)} step(s) verified; trial reward "
                                f"({task.reward_strategy} of the steps'): {reward}",
               verifier_dir=str(sample_dir / "steps"))
