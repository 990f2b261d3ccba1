"""Which groups a step trains, their rewards, and the policy versions their samples came from:
what the synchronous loop (``loop.py``) and the asynchronous schedule (``asynchronous.py``) share,
in a module of its own so that neither imports the other for it."""

from __future__ import annotations

from collections import Counter
from typing import Any


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


def sample_versions_of(rows: list[dict[str, Any]], versions: dict[str, dict[int, int]] | None, v: int) -> dict[str, int]:
    """Samples by the oldest version that produced any of their tokens."""
    out: Counter[str] = Counter()
    for r in rows:
        by = (versions or {}).get(r["session_id"])
        out[str(min(by) if by else r.get("policy_version", v))] += 1
    return dict(out)
