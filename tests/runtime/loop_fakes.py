"""A fake placement for the loop's tests: the expensive parts (vLLM, harnesses, the trainer) become
files, with the same durability rules as the real ones, so resume can be tested by ``kill -9``.

- "weights" are a hash chain; the trainer state is (weights, AdamW step count, Python RNG state);
  a full checkpoint ``train/step-N/state.json`` is written to a temp file and renamed (like
  polar_training.checkpoint);
- the trainer lives in the loop's process: a killed run loses its memory, exactly like a killed
  trainer process; it is rebuilt from the checkpoint the loop hands to ``start``;
- a sample's result is written when it finishes (like the rollout runner's result store) and a
  line is appended to ``executed.log`` whenever a sample runs, so a test can count reruns;
- ``POLAR_FAKE_HANG=<phase>:<step>[:<n>]`` makes the phase write ``hang.marker`` and sleep (the
  test then kills the process): rollout after n samples finished, train before its checkpoint,
  push before the swap.

Asynchronous mode (``rollout_group``): a sample makes ``calls`` model calls of ``call_s`` seconds;
each call appends a capture line carrying the policy version served when it was made (the proxy's
``policy_version``), and ``sample_versions`` reads them back: ages are measured like the real
ones. A push holds a gate (a lock) for ``push_s`` while it swaps: calls wait there, as at the proxy.
``timing`` (or ``POLAR_FAKE_TIMING``, JSON) sets ``call_s``, ``calls``, ``train_s``, ``push_s`` and
``straggler`` (a group ``task.st<label>`` whose calls take ``straggler_s`` each, until cancelled).
``group_s`` (a list, cycled over groups in the order they start) replaces ``call_s``: a group
takes that long in all, its calls sharing it; ``train_s`` may be a list too (cycled over steps).
The synchronous ``rollout`` then runs its groups one after another the same way (the benchmark
compares both schedules on the same durations).
``train_waits``: a training step starts only when no group is rolling out, so that which version
samples which group is a function of the schedule alone (no race between threads): the bound's
tests use it; the measurements do not.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Optional

from polar_runtime.loop.placement import TrainOutcome

TASKS = ["alpha", "beta", "gamma"]


def _atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class FakePlacement:
    def __init__(self, cfg: Any, out: Path) -> None:
        self.cfg = cfg
        self.out = Path(out)
        spec = os.environ.get("POLAR_FAKE_HANG", "")
        parts = spec.split(":") if spec else []
        self.hang = (parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else 0) if parts else None
        self.calls: list[str] = []
        self.timing = {"call_s": 0.0, "calls": 1, "train_s": 0.0, "push_s": 0.0, "straggler": None, "straggler_s": 0.0,
                       "train_waits": False,
                       **json.loads(os.environ.get("POLAR_FAKE_TIMING") or "{}")}
        self.gate = threading.Lock()  # the proxy's gate: held by a push for the swap only
        self.cancelled: dict[str, threading.Event] = {}
        self.active = 0  # rollout_group calls running
        self.started = 0  # groups started (group_s is cycled over them)
        self.steps = 0
        self.idle = threading.Condition()

    def _maybe_hang(self, phase: str, step: int, done: int = 0) -> None:
        if self.hang and self.hang[0] == phase and self.hang[1] == step and done >= self.hang[2]:
            (self.out / "hang.marker").write_text(f"{phase}:{step}:{done}")
            time.sleep(3600)

    # ---- the interface ------------------------------------------------------------------------
    def start(self, serve_from: Optional[str], policy_version: int) -> None:
        self.calls.append(f"start {serve_from} v{policy_version}")
        if serve_from:
            st = json.loads((Path(serve_from) / "state.json").read_text())
            self.trainer = {"weights": st["weights"], "adam": st["adam"], "step": st["step"], "rng": st["rng"]}
        else:
            self.trainer = {"weights": "w0", "adam": 0, "step": 0, "rng": None}
        self.served = (self.trainer["weights"], policy_version)
        assert self.trainer["step"] == policy_version, (self.trainer, policy_version)

    def task_ids(self) -> list[str]:
        return TASKS[: self.cfg.tasks.limit or len(TASKS)]

    def rollout(self, step: int, task_ids: list[str], policy_version: int) -> list[dict[str, Any]]:
        assert self.served[1] == policy_version
        if self.timing.get("group_s"):
            return [r for t in task_ids for r in self.rollout_group(step, t, policy_version)]
        rows, done = [], 0
        for t in task_ids:
            for i in range(self.cfg.rollout.samples_per_group):
                path = self.out / "rollouts" / f"{t}.st{step}.s{i}.json"
                if path.exists():
                    rows.append(json.loads(path.read_text()))
                    done += 1
                    continue
                self._maybe_hang("rollout", step, done)
                with open(self.out / "executed.log", "a") as fh:
                    fh.write(f"{t}.st{step}.s{i}\n")
                h = int(hashlib.sha1(f"{self.served[0]}|{step}|{t}|{i}".encode()).hexdigest()[:8], 16) >> 3
                row = {"session_id": f"{t}.st{step}.s{i}", "group_id": f"{t}.st{step}", "task_id": t, "sample_index": i,
                       "status": "ok", "reward": float(h % 2), "calls": 1, "policy_version": policy_version,
                       "weights": self.served[0]}
                self._capture(row["session_id"], policy_version, 10, fresh=True)
                _atomic(path, row)
                rows.append(row)
                done += 1
        return rows

    def _capture(self, sid: str, version: int, tokens: int, fresh: bool = False) -> None:
        path = self.out / "captures" / f"{sid}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w" if fresh else "a") as fh:
            fh.write(json.dumps({"session_id": sid, "policy_version": version, "n_sampled_ids": tokens}) + "\n")

    def rollout_group(self, step: int, task_id: str, policy_version: int) -> list[dict[str, Any]]:
        t, tm = task_id, self.timing
        label = f"{t}.st{step}"
        cancel = self.cancelled.setdefault(label, threading.Event())
        with self.idle:
            self.active += 1
            n, self.started = self.started, self.started + 1
        per_call = None
        if self.timing.get("group_s"):
            gs = self.timing["group_s"]
            per_call = float(gs[n % len(gs)]) / (self.cfg.rollout.samples_per_group * int(self.timing["calls"]))
        try:
            return self._group(step, t, label, cancel, per_call)
        finally:
            with self.idle:
                self.active -= 1
                self.idle.notify_all()

    def _group(self, step: int, t: str, label: str, cancel: threading.Event, per_call: float | None) -> list[dict[str, Any]]:
        tm = self.timing
        rows, done = [], 0
        for i in range(self.cfg.rollout.samples_per_group):
            sid = f"{label}.s{i}"
            path = self.out / "rollouts" / f"{sid}.json"
            if path.exists():
                rows.append(json.loads(path.read_text()))
                done += 1
                continue
            self._maybe_hang("rollout", step, done)
            with open(self.out / "executed.log", "a") as fh:
                fh.write(f"{sid}\n")
            (self.out / "captures" / f"{sid}.jsonl").unlink(missing_ok=True)  # an attempt killed earlier
            first = None
            for _ in range(int(tm["calls"])):
                if label == tm["straggler"]:
                    cancel.wait(float(tm["straggler_s"]))
                else:
                    time.sleep(per_call if per_call is not None else float(tm["call_s"]))
                with self.gate:  # a call waits at the gate while a push swaps the weights
                    weights, version = self.served
                first = first or weights
                self._capture(sid, version, 5)
            h = int(hashlib.sha1(f"{first}|{step}|{t}|{i}".encode()).hexdigest()[:8], 16) >> 3
            row = {"session_id": sid, "group_id": label, "task_id": t, "sample_index": i, "status": "ok",
                   "reward": float(h % 2), "calls": int(tm["calls"]), "sampled_tokens": 5 * int(tm["calls"]),
                   "policy_version": self.served[1], "weights": first}
            _atomic(path, row)
            rows.append(row)
            done += 1
        return rows

    def sample_versions(self, rows: list[dict[str, Any]]) -> dict[str, dict[int, int]]:
        out: dict[str, dict[int, int]] = {}
        for r in rows:
            path = self.out / "captures" / f"{r['session_id']}.jsonl"
            by: dict[int, int] = {}
            for line in path.read_text().splitlines() if path.exists() else []:
                rec = json.loads(line)
                by[int(rec["policy_version"])] = by.get(int(rec["policy_version"]), 0) + int(rec["n_sampled_ids"])
            out[r["session_id"]] = by
        return out

    def cancel_group(self, step: int, task_id: str) -> None:
        self.cancelled.setdefault(f"{task_id}.st{step}", threading.Event()).set()

    def trajectories(self, step: int, rows: list[dict[str, Any]]) -> tuple[Optional[str], dict[str, Any]]:
        path = self.out / "trajectories" / f"step-{step}.json"
        _atomic(path, sorted(rows, key=lambda r: r["session_id"]))
        return str(path), {"sampled_tokens": 10 * len(rows)}

    def train(self, step: int, trajectories: str) -> TrainOutcome:
        if self.timing["train_waits"]:
            with self.idle:
                assert self.idle.wait_for(lambda: self.active == 0, timeout=60), "rollouts never went idle"
        ts = self.timing["train_s"]
        time.sleep(float(ts[self.steps % len(ts)]) if isinstance(ts, list) else float(ts))
        self.steps += 1
        tr = self.trainer
        rng = random.Random()
        if tr["rng"] is None:
            rng.seed(1234)
        else:
            rng.setstate((tr["rng"][0], tuple(tr["rng"][1]), tr["rng"][2]))
        noise = rng.random()
        data = Path(trajectories).read_text()
        tr["weights"] = hashlib.sha1(f"{tr['weights']}|{data}|{noise}".encode()).hexdigest()[:16]
        tr["adam"] += 1
        tr["step"] += 1
        tr["rng"] = list(rng.getstate())
        with open(self.out / "trained.log", "a") as fh:
            fh.write(f"{step}\n")
        self._maybe_hang("train", step)
        ckpt = self.out / "train" / f"step-{tr['step']}"
        _atomic(ckpt / "state.json", tr)
        return TrainOutcome(True, tr["step"], checkpoint=str(ckpt), metrics={"noise": noise})

    def push(self, checkpoint: str, policy_version: int) -> dict[str, Any]:
        self._maybe_hang("push", policy_version - 1)
        st = json.loads((Path(checkpoint) / "state.json").read_text())
        with self.gate:  # held for the swap only
            time.sleep(float(self.timing["push_s"]))
            self.served = (st["weights"], policy_version)
        return {"method": "fake", "policy_version": policy_version}

    def evaluate(self, step: int, policy_version: int) -> Optional[dict[str, Any]]:
        return {"step": step, "policy_version": policy_version}

    def close(self) -> None:
        self.calls.append("close")
