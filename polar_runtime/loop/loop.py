"""The RL loop: rollout -> trajectories -> GRPO step -> push, resumable after ``kill -9``.

One step, synchronous (``schedule.max_off_policy_steps = 0``, the default):

1. ``rollout``: the step's groups (``groups_per_step`` tasks, cycling through the task list;
   ``samples_per_group`` samples each) under the served policy version v;
2. the last step (``step == iterations``) only rolls out (and evaluates): the policy after the last
   update, measured; with ``rollout.final_rollout = false`` it only evaluates (a transfer run whose
   measure is another task set: the training tasks' rollout was 1/7 of a shell seed's samples);
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
from .groups import LoopError, groups_for, groups_with_variance, reward_summary, sample_versions_of
from .measures import IdleMeter, metrics_row, token_ages
from .placement import Placement
from .state import LoopState

REPORT_FILE = "loop-report.json"
#: the note of the last step's record: it measures the policy after the last update and trains nothing
FINAL_ROLLOUT_NOTE = "final rollout"
FINAL_EVALUATION_NOTE = "final evaluation (no rollout)"  # rollout.final_rollout = false

#: keys whose change makes a run directory another run (resuming it would mix two experiments)
IDENTITY_KEYS = (("model", "name"), ("harness", "name"), ("tasks", "source"), ("tasks", "ids"), ("tasks", "limit"),
                 ("rollout", "samples_per_group"), ("rollout", "groups_per_step"), ("trainer", "lr"),
                 ("trainer", "lora_rank"), ("sampling", "temperature"), ("sampling", "seed"), ("eval", "tasks"), ("eval", "ids"))


#: identity keys added later: a state written before them holds their default
_LATER_DEFAULTS: dict[tuple[str, str], Any] = {("eval", "tasks"): "", ("eval", "ids"): []}


def _identity(cfg: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": (cfg.get(s) or {}).get(k, _LATER_DEFAULTS.get((s, k))) for s, k in IDENTITY_KEYS}


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


class Run:
    """What every phase of a run shares: configuration, placement, progress file, measures."""

    def __init__(self, cfg: LoopConfig, placement: Placement, out: Path, state: LoopState,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.placement, self.out, self.state, self.log = cfg, placement, out, state, log
        self.meter = IdleMeter(state.timing)
        self.metrics: Any = None
        self.dropped_total = len((state.schedule or {}).get("dropped", []))

    def save(self) -> None:
        self.state.timing = self.meter.snapshot()
        self.state.save(self.out)

    def finish(self, rec: dict[str, Any], step: int, t_step: float) -> None:
        """Record step ``step`` finished (atomically) and write its metrics row."""
        rec["wall_s"] = round(time.monotonic() - t_step, 3)
        counters = getattr(self.placement, "counters", None)
        if counters is not None:  # cumulative (Ray: groups retried after a node loss, dropped, nodes lost)
            rec["placement"] = counters()
        self.state.steps.append(rec)
        self.state.next_step = step + 1
        self.save()
        if self.metrics is not None:
            self.metrics.write(metrics_row(rec, self.state.timing, self.dropped_total))

    def learn(self, step: int, rows: list[dict[str, Any]], rec: dict[str, Any], t_step: float,
              versions: dict[str, dict[int, int]] | None = None) -> None:
        """Variance check, trajectories, one GRPO step, push; every exit records the step finished.
        ``versions``: sampled tokens by policy version per session, from the captures."""
        cfg, placement, state = self.cfg, self.placement, self.state
        v = state.policy_version
        rec["groups_with_variance"] = groups_with_variance(rows)
        if not rec["groups_with_variance"]:
            rec["note"] = "every GRPO group has zero reward variance (its samples scored alike): update skipped, no push"
            self.log(f"step {step}: {rec['note']}; the policy stays v{v}")
            return self.finish(rec, step, t_step)
        traj, stats = placement.trajectories(step, rows)
        rec["trajectories"] = stats
        if traj is None:
            rec["note"] = "no sampled tokens captured: nothing to train on"
            return self.finish(rec, step, t_step)
        self.meter.train(True)
        t_train = time.time()
        try:
            res = placement.train(step, traj)
        finally:
            self.meter.train(False)
        # wall-clock window of the step (Unix seconds, as the captures' t_request_in): which calls
        # vLLM served while the trainer stepped can be read back from the captures
        rec["train"] = {"updated": res.updated, "policy_version": res.policy_version, "checkpoint": res.checkpoint,
                        "metrics": res.metrics, "note": res.note, "peak_rss_gib": getattr(res, "peak_rss_gib", None),
                        "timings": getattr(res, "timings", None) or {}, "t_start": round(t_train, 3),
                        "t_end": round(time.time(), 3)}
        if not res.updated or not res.checkpoint:
            rec["note"] = res.note or "the trainer made no update"
            return self.finish(rec, step, t_step)
        # staleness: versions between the policy trained (v, the trainer's weights before this step)
        # and the one that sampled each trained token (from the captures when the placement has them)
        if versions:
            rec["staleness_tokens"] = token_ages(v, versions)
        else:
            rec["staleness_tokens"] = {"0": int(stats.get("sampled_tokens") or 0)}
        state.pending = {"step": step, "checkpoint": res.checkpoint, "policy_version": res.policy_version, "record": rec}
        self.save()
        self.meter.push(True)
        try:
            rec["push"] = placement.push(res.checkpoint, res.policy_version)
        finally:
            self.meter.push(False)
        state.policy_version, state.checkpoint, state.pending = res.policy_version, res.checkpoint, None
        self.finish(rec, step, t_step)
        prune_checkpoints(Path(res.checkpoint).parent, cfg.trainer.keep_checkpoints, {res.checkpoint})

    def sync_step(self, step: int, ids: list[str], evaluations: list[dict[str, Any]]) -> None:
        """One synchronous step: roll out under the served version, then learn (or, last, only measure)."""
        cfg, placement, state = self.cfg, self.placement, self.state
        groups = groups_for(step, ids, cfg.rollout.groups_per_step)
        v = state.policy_version
        t_step = time.monotonic()
        last = step == cfg.rollout.iterations
        if last and not cfg.rollout.final_rollout:
            rows, groups = [], []  # the evaluation below is the whole measure of the last policy
        else:
            self.meter.rollout_started()
            try:
                rows = placement.rollout(step, groups, v)
            finally:
                self.meter.rollout_ended()
        versions = _versions(placement, rows)
        rec: dict[str, Any] = {"step": step, "policy_version": v, "groups": groups, "rewards": reward_summary(rows),
                               "sample_versions": sample_versions_of(rows, versions, v),
                               "train": None, "push": None, "note": None}
        if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.rollout.iterations):
            ev = placement.evaluate(step, v)
            if ev is not None:
                evaluations.append(ev)
                rec["evaluation"] = ev
        if last:  # the last rollout measures the policy after the last update
            rec["note"] = FINAL_ROLLOUT_NOTE if cfg.rollout.final_rollout else FINAL_EVALUATION_NOTE
            return self.finish(rec, step, t_step)
        self.learn(step, rows, rec, t_step, versions)


def _versions(placement: Placement, rows: list[dict[str, Any]]) -> dict[str, dict[int, int]] | None:
    """Sampled tokens by served policy version per session, from the captures (None: the placement
    cannot tell, an older one; then every token counts as sampled by the version served at the step)."""
    fn = getattr(placement, "sample_versions", None)
    return fn(rows) if fn is not None else None


def run_loop(cfg: LoopConfig, placement: Placement, out: Path, log: Callable[[str], None] = print,
             metrics: bool = True) -> dict[str, Any]:
    """Run (or resume) the loop in ``out``; returns the report (also ``<out>/loop-report.json``).
    ``metrics``: one row per finished step through MetricsLog (``<out>/metrics.jsonl``, TensorBoard)."""
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

    run = Run(cfg, placement, out, state, log)
    if metrics:
        from polar_training.metrics_log import MetricsLog

        run.metrics = MetricsLog(out, config=cfg.to_dict())
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
            run.save()
        ids = placement.task_ids()
        if not ids:
            raise LoopError("no tasks")
        if cfg.schedule.max_off_policy_steps > 0 and state.next_step < cfg.rollout.iterations:
            from .asynchronous import run_async

            run_async(run, ids)
        for step in range(state.next_step, cfg.rollout.iterations + 1):
            run.sync_step(step, ids, evaluations)
    finally:
        run.save()
        placement.close()
        if run.metrics is not None:
            run.metrics.close()
    describe = getattr(placement, "report", None)
    report = build_report(cfg, state, out, time.monotonic() - t0, describe() if describe is not None else None)
    return report


def staleness_histogram(steps: list[dict[str, Any]]) -> dict[str, int]:
    hist: Counter[str] = Counter()
    for s in steps:
        for age, n in (s.get("staleness_tokens") or {}).items():
            hist[age] += int(n)
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def build_report(cfg: LoopConfig, state: LoopState, out: Path, wall_s: float,
                 placement: dict[str, Any] | None = None) -> dict[str, Any]:
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
        "dropped_groups": list((state.schedule or {}).get("dropped", [])),
        "timing": state.timing,
        "reward_before": first,
        "reward_after": last,
        "steps": steps,
        "wall_s_this_run": round(wall_s, 3),
    }
    if placement is not None:  # what the placement itself reports (Ray: nodes, start-up, retries, drops)
        report["placement"] = placement
    tmp = out / f".{REPORT_FILE}.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str))
    tmp.replace(out / REPORT_FILE)
    return report
