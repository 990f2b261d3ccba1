"""The run page's data: one dict, small whatever the run's size (per-step series and one row per
sample), written as ``data/run.js``. What each series comes from:

* rewards, pass rates, per task: ``captures/rollouts.parquet`` (one row per sample; solved =
  reward > 0, as the demo's report counts it);
* staleness, idle fractions, phase times: the loop's records (``loop-state.json``'s steps and
  timing, ``metrics.jsonl``'s ``loop/*`` rows) and the demo's ``report.json`` phases when present;
* drift causes: the capture records through :func:`polar_analysis.drift.drift_report`, by step
  (a session's step is its rollout row's);
* merges and breaks: ``trajectories/step-K.parquet`` (``merge_kind`` per merge; a segment after
  the first is a break);
* training: ``train/metrics.jsonl`` (one row per optimizer step).

Everything here reads the run through :class:`RunFiles`; a missing part is an empty series, so
a run in progress (``--serve``) shows what exists so far.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

from .runfiles import RunFiles

#: training metrics plotted (their keys in train/metrics.jsonl)
TRAIN_KEYS = ("loss", "pg_loss", "kl", "mismatch_kl", "entropy", "grad_norm", "clip_frac_high", "tis_truncated_frac",
              "reward_mean", "n_sampled_tokens")


def clean(v: Any) -> Any:
    """JSON-safe: NaN and infinities become None (JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def _loop_steps(files: RunFiles) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    state = files.json("loop-state.json") or {}
    report = files.json("loop-report.json") or {}
    steps = sorted(state.get("steps") or report.get("steps") or [], key=lambda s: s.get("step", 0))
    timing = state.get("timing") or report.get("timing") or {}
    return steps, timing


def _phases(steps: list[dict[str, Any]], demo: dict[str, Any]) -> dict[str, Any]:
    """Seconds per step by phase (rollout, train, push) from the loop's records, and the demo's own
    phase list when it wrote one."""
    per_step = []
    for s in steps:
        tr = s.get("train") or {}
        train_s = (tr.get("t_end") or 0) - (tr.get("t_start") or 0) if tr.get("t_start") else 0.0
        push = s.get("push") or {}
        push_s = float(push.get("paused_s") or push.get("reload_s") or 0.0)
        wall = float(s.get("wall_s") or 0.0)
        per_step.append({"step": s.get("step"), "rollout_s": max(0.0, wall - train_s - push_s), "train_s": train_s,
                         "push_s": push_s, "wall_s": wall})
    return {"per_step": per_step, "demo": [{"name": p.get("name"), "seconds": p.get("seconds"), "detail": p.get("detail")}
                                           for p in demo.get("phases") or []]}


def _merges(files: RunFiles) -> list[dict[str, Any]]:
    out = []
    names = [n for n in files.listdir("trajectories", ".parquet") if n.startswith("step-")]
    for name in sorted(names, key=lambda n: int(n[5:-8]) if n[5:-8].isdigit() else 0):
        df = files.parquet(f"trajectories/{name}", columns=["merge_kind", "segment_index"])
        if df is None:
            continue
        kinds = Counter(k for ks in df["merge_kind"].to_list() for k in (ks or []))
        breaks = int((df["segment_index"] > 0).sum())
        merges = sum(kinds.values())
        out.append({"step": int(name[5:-8]) if name[5:-8].isdigit() else name, "merges": merges, "breaks": breaks,
                    "kinds": dict(kinds), "merge_rate": merges / (merges + breaks) if merges + breaks else None,
                    "exact_rate": kinds.get("exact", 0) / merges if merges else None, "sequences": df.height})
    return out


def _drift(drift: Any, step_of: dict[str, int]) -> dict[str, Any]:
    """Causes by step (``new_conversation`` and ``none`` left out: they are not drift)."""
    by: dict[int, Counter] = defaultdict(Counter)
    if drift is not None and drift.height:
        for sid, cause in zip(drift["session_id"].to_list(), drift["cause"].to_list()):
            if cause in ("none", "new_conversation"):
                continue
            by[step_of.get(sid, -1)][cause] += 1
    causes = sorted({c for cnt in by.values() for c in cnt})
    return {"causes": causes, "steps": [{"step": s, "counts": dict(by[s])} for s in sorted(by)]}


def build_summary(files: RunFiles, rollouts: Any, drift: Any, sample_ids: list[str], trained: set[str]) -> dict[str, Any]:
    """The run page's data. ``rollouts``: the rollouts frame (or None); ``drift``: the drift report;
    ``sample_ids``: every sample's session id in the order its chunk index follows; ``trained``:
    sessions with a token in the trainer's record."""
    steps, timing = _loop_steps(files)
    demo = files.json("report.json") or {}
    rows = rollouts.to_dicts() if rollouts is not None else []
    by_sid = {r["session_id"]: r for r in rows}
    step_of = {r["session_id"]: r.get("step") for r in rows}
    per_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        per_step[r.get("step") or 0].append(r)
    tasks = sorted({r.get("task_id") or "" for r in rows})
    rewards = []
    for s in sorted(per_step):
        rs = per_step[s]
        vals = [r["reward"] for r in rs if r.get("reward") is not None]
        per_task = {}
        for t in tasks:
            tv = [r["reward"] for r in rs if r.get("task_id") == t and r.get("reward") is not None]
            per_task[t] = sum(tv) / len(tv) if tv else None
        rewards.append({"step": s, "samples": len(rs), "mean": sum(vals) / len(vals) if vals else None,
                        "pass_rate": sum(1 for v in vals if v > 0) / len(vals) if vals else None,
                        "status": dict(Counter(r.get("status") or "?" for r in rs)), "per_task": per_task})
    staleness = Counter()
    for s in steps:
        for age, n in (s.get("staleness_tokens") or {}).items():
            staleness[int(age)] += int(n)
    idle = [{"step": m.get("step"), "trainer": m.get("loop/trainer_idle_frac"), "vllm": m.get("loop/vllm_idle_frac")}
            for m in files.jsonl("metrics.jsonl") if "loop/trainer_idle_frac" in m]
    train = [{k: m.get(k) for k in ("step",) + TRAIN_KEYS} for m in files.jsonl("train/metrics.jsonl")]
    samples = []
    for i, sid in enumerate(sample_ids):
        r = by_sid.get(sid, {})
        samples.append({"i": i, "session_id": sid, "task_id": r.get("task_id"), "group_id": r.get("group_id"),
                        "step": r.get("step"), "status": r.get("status"), "reward": r.get("reward"),
                        "calls": r.get("calls"), "sampled_tokens": r.get("sampled_tokens"), "wall_s": r.get("wall_s"),
                        "trained": sid in trained})
    config = (files.json("loop-state.json") or {}).get("config") or demo.get("config") or {}
    return clean({
        "root": str(files.root),
        "model": (config.get("model") or {}).get("name") if isinstance(config.get("model"), dict) else demo.get("model"),
        "harness": (config.get("harness") or {}).get("name") if isinstance(config.get("harness"), dict) else demo.get("harness"),
        "tasks": tasks,
        "rewards": rewards,
        "staleness": [{"age": a, "tokens": n} for a, n in sorted(staleness.items())],
        "timing": timing,
        "idle": idle,
        "phases": _phases(steps, demo),
        "drift": _drift(drift, step_of),
        "merges": _merges(files),
        "train": train,
        "loop_steps": [{"step": s.get("step"), "policy_version": s.get("policy_version"), "note": s.get("note"),
                        "groups_with_variance": s.get("groups_with_variance")} for s in steps],
        "samples": samples,
    })
