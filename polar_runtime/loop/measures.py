"""What the loop measures about itself: idle time of the trainer and of vLLM, and token ages.

Why here and not in the trainer's metrics: the trainer sees one step at a time; only the loop sees
both sides of the schedule (a trainer waiting for rollouts, vLLM waiting for a push), which is the
point of asynchronous rollouts. The rows go through the project's one metrics writer
(``polar_training.metrics_log.MetricsLog``: ``<out>/metrics.jsonl``, TensorBoard, W&B when present).

- :class:`IdleMeter`: busy time of the trainer (inside ``placement.train``) and of vLLM (at least one
  group or step rolling out, and no push swapping weights: calls wait at the proxy's gate then),
  accumulated across resumes through the state file. Idle fraction = 1 - busy / wall. ``overlap_s``:
  both busy at once (rollouts running while the trainer steps; 0 in the synchronous loop).
- token age = (version of the policy being trained) - (version that sampled the token), per call,
  from the captures (each capture record carries the ``policy_version`` the proxy served).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any, Optional


class IdleMeter:
    """Busy seconds of the trainer and of vLLM; thread-safe (groups start and end on worker threads)."""

    def __init__(self, saved: Optional[dict[str, float]] = None) -> None:
        saved = saved or {}
        self._lock = threading.Lock()
        self.wall = float(saved.get("wall_s", 0.0))
        self.trainer = float(saved.get("trainer_busy_s", 0.0))
        self.vllm = float(saved.get("vllm_busy_s", 0.0))
        self.overlap = float(saved.get("overlap_s", 0.0))  # both busy at once: what asynchrony buys
        self.rolling = 0  # groups (or whole steps) rolling out now
        self.training = False
        self.pushing = False
        self._last = time.monotonic()

    def _tick(self) -> None:
        now = time.monotonic()
        dt, self._last = now - self._last, now
        self.wall += dt
        if self.training:
            self.trainer += dt
        if self.rolling > 0 and not self.pushing:
            self.vllm += dt
            if self.training:
                self.overlap += dt

    def _set(self, **kw: Any) -> None:
        with self._lock:
            self._tick()
            for k, v in kw.items():
                setattr(self, k, v)

    def rollout_started(self) -> None:
        with self._lock:
            self._tick()
            self.rolling += 1

    def rollout_ended(self) -> None:
        with self._lock:
            self._tick()
            self.rolling -= 1

    def train(self, on: bool) -> None:
        self._set(training=on)

    def push(self, on: bool) -> None:
        self._set(pushing=on)

    def snapshot(self) -> dict[str, float]:
        """Totals so far (what the state file keeps) and the idle fractions."""
        with self._lock:
            self._tick()
            wall = self.wall
            return {"wall_s": round(wall, 3), "trainer_busy_s": round(self.trainer, 3), "vllm_busy_s": round(self.vllm, 3),
                    "overlap_s": round(self.overlap, 3),
                    "trainer_idle_frac": round(1 - self.trainer / wall, 4) if wall > 0 else 0.0,
                    "vllm_idle_frac": round(1 - self.vllm / wall, 4) if wall > 0 else 0.0}


def token_ages(trained_version: int, versions: dict[str, dict[int, int]]) -> dict[str, int]:
    """Trained tokens by age (as strings, JSON keys), from ``{session: {policy_version: tokens}}``."""
    hist: Counter[int] = Counter()
    for by_version in versions.values():
        for v, n in by_version.items():
            hist[trained_version - int(v)] += int(n)
    return {str(a): n for a, n in sorted(hist.items())}


def metrics_row(rec: dict[str, Any], idle: dict[str, float], dropped_total: int) -> dict[str, Any]:
    """One row per finished step for MetricsLog: rewards, token ages, drops, idle fractions."""
    ages = {int(a): int(n) for a, n in (rec.get("staleness_tokens") or {}).items()}
    tokens = sum(ages.values())
    row: dict[str, Any] = {"step": rec["step"], "loop/policy_version": rec["policy_version"],
                           "loop/samples": rec["rewards"]["samples"], "loop/trained_tokens": tokens,
                           "loop/dropped_groups_total": dropped_total,
                           "loop/trainer_idle_frac": idle["trainer_idle_frac"], "loop/vllm_idle_frac": idle["vllm_idle_frac"],
                           "loop/wall_s": idle["wall_s"]}
    if rec["rewards"].get("mean_reward") is not None:
        row["loop/mean_reward"] = rec["rewards"]["mean_reward"]
    for k, v in (rec.get("placement") or {}).items():  # a placement's own counters (Ray: node losses)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            row[f"placement/{k}"] = v
    if tokens:
        row["loop/age_max"] = max(ages)
        row["loop/age_mean"] = sum(a * n for a, n in ages.items()) / tokens
        for a, n in ages.items():
            row[f"loop/age_{a}_tokens"] = n
    return row
