"""The RL loop: rollout -> trajectories -> GRPO step -> push, resumable after ``kill -9``.

One step, synchronous (``schedule.max_off_policy_steps = 0``, the default):

1. ``rollout``: the step's groups (``groups_per_step`` tasks, cycling through the task list;
   ``samples_per_group`` samples each) under the served policy version v;
2. the last step (``step == iterations``) only rolls out (and evaluates): the policy after the last
   update, measured;
3. a step with no group whose rewards differ is skipped: every advantage would be 0;
4. ``trajectories``, ``train`` (one GRPO iteration, a full checkpoint of v+1), then ``pending`` is
   recorded: the step's training is durable;
5. ``push`` (v+1 served), then the step is recorded finished (``state.py``: atomic, fsynced).

Resume (the same command on the same ``out``): the placement serves the recorded checkpoint under
its version, the trainer resumes from it (weights, AdamW moments, RNG: ``trainer_state.pt``); a
pending step is finished by that start (no retraining); the next step's samples that finished
before the kill are reused (the rollout runner's result store), the ones in flight run again under
a fresh session (``.r<n>``). Each step's groups are a function of the step alone, so nothing else
needs restoring. Checkpoints older than the last ``trainer.keep_checkpoints`` are removed.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from .config import LoopConfig
from .placement import Placement
from .state import LoopState

REPORT_FILE = "loop-report.json"

#: keys whose change makes a run directory another run (resuming it would mix two experiments)
IDENTITY_KEYS = (("model", "name"), ("harness", "name"), ("tasks", "source"), ("tasks", "ids"), ("tasks", "limit"),
                 ("rollout", "samples_per_group"), ("rollout", "groups_per_step"), ("trainer", "lr"),
                 ("trainer", "lora_rank"), ("sampling", "temperature"), ("sampling", "seed"))


class LoopError(RuntimeError):
    """The loop cannot go on; the message says why and what to do."""


def groups_for(step: int, task_ids: list[str], groups_per_step: int) -> list[str]:
    """The step's groups: every task, or ``groups_per_step`` of them, cycling (a function of the step alone)."""
    n = len(task_ids)
    if groups_per_step <= 0 or groups_per_step >= n:
        return list(task_ids)
    return [task_ids[(step * groups_per_step + i) % n] for i in range(groups_per_step)]


def groups_with_variance(rows: list[dict[str, Any]]) -> list[str]:
    """Groups whose rewards differ among the samples that take part (ok, a reward, calls captured)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.get("reward") is not None and r.get("status") == "ok" and (r.get("calls") or 0) > 0:
            by.setdefault(r["group_id"], []).append(float(r["reward"]))
    return sorted(g for g, v in by.items() if len(v) > 1 and max(v) > min(v))


def reward_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [r.get("reward") for r in rows if r.get("reward") is not None]
    return {"samples": len(rows), "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "solved": sum(1 for v in rewards if v > 0),
            "statuses": dict(Counter(str(r.get("status")) for r in rows)),
            "calls": sum(int(r.get("calls") or 0) for r in rows)}


def _identity(cfg: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": (cfg.get(s) or {}).get(k) for s, k in IDENTITY_KEYS}


def prune_checkpoints(train_dir: Path, keep: int, protect: set[str]) -> list[str]:
    """Remove full checkpoints (``step-N``) but the newest ``keep`` and the protected ones."""
    if not train_dir.is_dir():
        return []
    def num(p: Path) -> int:
        try:
            return int(p.name.split("-", 1)[1])
        except (IndexError, ValueError):
            return -1
    ckpts = sorted((p for p in train_dir.glob("step-*") if p.is_dir() and num(p) >= 0), key=num)
    removed = []
    for p in ckpts[:-keep] if keep > 0 else ckpts:
        if str(p) in protect or str(p.resolve()) in protect:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    return removed


def run_loop(cfg: LoopConfig, placement: Placement, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) the loop in ``out``; returns the report (also ``<out>/loop-report.json``)."""
    if cfg.schedule.max_off_policy_steps != 0:
        raise LoopError("schedule.max_off_policy_steps > 0 (asynchronous rollouts) is not built yet; use 0 (synchronous)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    state = LoopState.load(out)
    if state is None:
        state = LoopState(config=cfg.to_dict())
        state.save(out)
    else:
        was, now = _identity(state.config), _identity(cfg.to_dict())
        changed = {k: (was[k], now[k]) for k in now if was.get(k) != now[k]}
        if changed:
            what = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise LoopError(f"{out} holds a run of another configuration ({what}): use another `out`, or --fresh")
        state.resumes += 1
        log(f"resuming {out}: step {state.next_step}, policy v{state.policy_version}"
            + (f" (step {state.pending['step']} trained, its push finished by serving its checkpoint)" if state.pending else ""))
        state.config = cfg.to_dict()
        state.save(out)

    serve_from, version = state.checkpoint, state.policy_version
    if state.pending:
        serve_from, version = state.pending["checkpoint"], int(state.pending["policy_version"])
    evaluations: list[dict[str, Any]] = []
    try:
        placement.start(serve_from, version)
        if state.pending:
            rec = dict(state.pending["record"])
            rec["push"] = {"method": "resume", "policy_version": version, "notes": ["served from the checkpoint on resume"]}
            state.steps.append(rec)
            state.next_step, state.policy_version, state.checkpoint = int(state.pending["step"]) + 1, version, serve_from
            state.pending = None
            state.save(out)
        ids = placement.task_ids()
        if not ids:
            raise LoopError("no tasks")
        iterations = cfg.rollout.iterations
        for step in range(state.next_step, iterations + 1):
            groups = groups_for(step, ids, cfg.rollout.groups_per_step)
            v = state.policy_version
            t_step = time.monotonic()
            rows = placement.rollout(step, groups, v)
            rec: dict[str, Any] = {"step": step, "policy_version": v, "groups": groups, "rewards": reward_summary(rows),
                                   "sample_versions": dict(Counter(str(r.get("policy_version", v)) for r in rows)),
                                   "train": None, "push": None, "note": None}
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == iterations):
                ev = placement.evaluate(step, v)
                if ev is not None:
                    evaluations.append(ev)
                    rec["evaluation"] = ev
            if step == iterations:  # the last rollout measures the policy after the last update
                rec["note"] = "final rollout"
                _finish(state, out, rec, step, t_step)
                break
            rec["groups_with_variance"] = groups_with_variance(rows)
            if not rec["groups_with_variance"]:
                rec["note"] = "every group's samples scored alike: update skipped, no push"
                log(f"step {step}: {rec['note']}; the policy stays v{v}")
                _finish(state, out, rec, step, t_step)
                continue
            traj, stats = placement.trajectories(step, rows)
            rec["trajectories"] = stats
            if traj is None:
                rec["note"] = "no sampled tokens captured: nothing to train on"
                _finish(state, out, rec, step, t_step)
                continue
            res = placement.train(step, traj)
            rec["train"] = {"updated": res.updated, "policy_version": res.policy_version, "checkpoint": res.checkpoint,
                            "metrics": res.metrics, "note": res.note}
            if not res.updated or not res.checkpoint:
                rec["note"] = res.note or "the trainer made no update"
                _finish(state, out, rec, step, t_step)
                continue
            # staleness: versions between the policy trained (v, the trainer's weights before this
            # step) and the one that sampled each trained token; synchronous: all 0
            tokens = int(stats.get("sampled_tokens") or 0)
            rec["staleness_tokens"] = {str(res.policy_version - 1 - v): tokens}
            state.pending = {"step": step, "checkpoint": res.checkpoint, "policy_version": res.policy_version, "record": rec}
            state.save(out)
            rec["push"] = placement.push(res.checkpoint, res.policy_version)
            state.policy_version, state.checkpoint, state.pending = res.policy_version, res.checkpoint, None
            _finish(state, out, rec, step, t_step)
            prune_checkpoints(Path(res.checkpoint).parent, cfg.trainer.keep_checkpoints, {res.checkpoint})
    finally:
        placement.close()
    report = build_report(cfg, state, out, time.monotonic() - t0)
    return report


def _finish(state: LoopState, out: Path, rec: dict[str, Any], step: int, t_step: float) -> None:
    rec["wall_s"] = round(time.monotonic() - t_step, 3)
    state.steps.append(rec)
    state.next_step = step + 1
    state.save(out)


def staleness_histogram(steps: list[dict[str, Any]]) -> dict[str, int]:
    hist: Counter[str] = Counter()
    for s in steps:
        for age, n in (s.get("staleness_tokens") or {}).items():
            hist[age] += int(n)
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def build_report(cfg: LoopConfig, state: LoopState, out: Path, wall_s: float) -> dict[str, Any]:
    steps = sorted(state.steps, key=lambda s: s["step"])
    first = steps[0]["rewards"]["mean_reward"] if steps else None
    last = steps[-1]["rewards"]["mean_reward"] if len(steps) > 1 else None
    report = {
        "out": str(out),
        "finished": state.next_step > cfg.rollout.iterations,
        "policy_version": state.policy_version,
        "checkpoint": state.checkpoint,
        "resumes": state.resumes,
        "max_off_policy_steps": cfg.schedule.max_off_policy_steps,
        "staleness_tokens": staleness_histogram(steps),
        "reward_before": first,
        "reward_after": last,
        "steps": steps,
        "wall_s_this_run": round(wall_s, 3),
    }
    tmp = out / f".{REPORT_FILE}.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / REPORT_FILE)
    return report
