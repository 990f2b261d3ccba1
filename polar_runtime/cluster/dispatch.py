"""Which node runs a group, what the driver keeps of it, and what a lost node costs.

:class:`Dispatcher` sends a group to the least-loaded live node agent (fewest samples in flight)
and reads its finished samples one by one from the agent's streaming generator (each one a Ray
object). Every finished sample is written at once to the driver's :class:`SampleStore`
(``<out>/cluster/samples/``): it is never lost, whatever happens to its node afterwards, and a
driver restarted on the same ``out`` does not run it again.

**Node loss.** When the agent dies (``ray.exceptions.RayActorError``: its node was removed, its
process killed), the node is marked lost for the rest of the run and the group's *unfinished*
samples are dispatched to another live node, with ``attempt`` + 1 (new session ids, ``.r<n>``,
so the lost node's partial captures stay told apart). The staleness rule holds without more work:
a re-run sample is sampled by the policy served now, never older than the one its group was
admitted under, and the asynchronous schedule (``loop/asynchronous.py``) still decides whether the
group is late (moved to the next batch, or dropped whole and cancelled here). A group whose node
was lost more than ``max_retries`` times is dropped whole (its finished samples are kept on disk
but not returned: a GRPO group is never split) and counted. Every count is in :meth:`counters`,
which the loop writes into each step record, ``metrics.jsonl`` and the report.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import ray
from ray.exceptions import RayActorError


class NoNodeLeft(RuntimeError):
    """Every node agent is lost: nothing can run."""


class SampleStore:
    """Finished samples on the driver: ``<key>.json`` (row, versions, counts, node) and ``<key>.arrow``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._mem: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(step: int, task_id: str, sample: int) -> str:
        from polar_runtime import rollout as r

        return r.sample_key(task_id, step, sample)

    def put(self, key: str, payload: dict[str, Any]) -> None:
        meta = {k: v for k, v in payload.items() if k != "trajectory"}
        meta["versions"] = {str(v): n for v, n in (payload.get("versions") or {}).items()}
        if payload.get("trajectory") is not None:
            tmp = self.root / f".{key}.arrow.tmp"
            tmp.write_bytes(payload["trajectory"])
            os.replace(tmp, self.root / f"{key}.arrow")
        tmp = self.root / f".{key}.json.tmp"
        tmp.write_text(json.dumps(meta, default=str))
        os.replace(tmp, self.root / f"{key}.json")  # last: a sample is stored once its json exists
        with self._lock:
            self._mem[key] = payload

    def get(self, key: str) -> Optional[dict[str, Any]]:
        with self._lock:
            if key in self._mem:
                return self._mem[key]
        path = self.root / f"{key}.json"
        if not path.is_file():
            return None
        meta = json.loads(path.read_text())
        meta["versions"] = {int(v): int(n) for v, n in (meta.get("versions") or {}).items()}
        arrow = self.root / f"{key}.arrow"
        meta["trajectory"] = arrow.read_bytes() if arrow.is_file() else None
        with self._lock:
            self._mem[key] = meta
        return meta

    def by_session(self, session_ids: set[str]) -> list[dict[str, Any]]:
        with self._lock:
            found = [p for p in self._mem.values() if p["row"]["session_id"] in session_ids]
        return found

    def frame(self, payloads: list[dict[str, Any]]) -> Any:
        """The training sequences of ``payloads``, one frame (None when none sampled anything)."""
        import polars as pl

        parts = [pl.read_ipc(io.BytesIO(p["trajectory"])) for p in payloads if p.get("trajectory")]
        return pl.concat(parts, how="diagonal_relaxed") if parts else None


class Dispatcher:
    def __init__(self, agents: dict[str, Any], store: SampleStore, samples: int, max_retries: int,
                 log: Callable[[str], None]) -> None:
        self.agents = dict(agents)  # node id -> actor handle (live ones)
        self.lost: dict[str, str] = {}  # node id -> why
        self.store, self.samples, self.max_retries, self.log = store, samples, max_retries, log
        self.in_flight: Counter[str] = Counter()  # node id -> samples running there
        self.where: dict[str, str] = {}  # group label -> the node running it now
        self.cancelled: set[str] = set()
        self.lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        self.by_node: Counter[str] = Counter()  # samples finished per node

    def counters(self) -> dict[str, Any]:
        with self.lock:
            return {"nodes_live": len(self.agents), "nodes_lost": len(self.lost),
                    "groups_retried": self.stats["groups_retried"], "samples_retried": self.stats["samples_retried"],
                    "groups_dropped": self.stats["groups_dropped"], "samples_finished": self.stats["samples_finished"]}

    def _pick(self, label: str, samples: int) -> tuple[str, Any]:
        """The least-loaded live node, its load counted at once (two groups picking together spread)."""
        with self.lock:
            if not self.agents:
                raise NoNodeLeft(f"every node agent is lost ({', '.join(f'{n[:12]}: {w}' for n, w in self.lost.items())})")
            node = min(self.agents, key=lambda n: (self.in_flight[n], n))
            self.in_flight[node] += samples
            self.where[label] = node
            return node, self.agents[node]

    def mark_lost(self, node: str, why: str) -> None:
        with self.lock:
            handle = self.agents.pop(node, None)
            if handle is None:
                return
            self.lost[node] = why
        self.log(f"node {node[:12]} lost ({why}): its groups in flight run again elsewhere")
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)

    def cancel(self, step: int, task_id: str) -> dict[str, Any]:
        label = f"{task_id}.st{step}"
        with self.lock:
            self.cancelled.add(label)
            node = self.where.get(label)
            handle = self.agents.get(node) if node else None
        if handle is None:
            return {"group": label, "processes_killed": 0, "sessions_closed": 0}
        try:
            return ray.get(handle.cancel_group.remote(step, task_id))
        except RayActorError as exc:
            self.mark_lost(node, type(exc).__name__)  # type: ignore[arg-type]
            return {"group": label, "processes_killed": 0, "sessions_closed": 0}

    def run_group(self, step: int, task_id: str, samples: Optional[int] = None,
                  evaluation: bool = False) -> list[dict[str, Any]]:
        """Every sample of the group, finished (from the store, or run now, anywhere alive); [] when
        the group was cancelled or dropped. ``samples``/``evaluation``: a group of the evaluation
        (``eval.samples`` of an ``eval-<id>`` task), node loss handled as for a training group."""
        label = f"{task_id}.st{step}"
        n = samples or self.samples
        got: dict[int, dict[str, Any]] = {}
        for i in range(n):
            p = self.store.get(self.store.key(step, task_id, i))
            if p is not None:
                got[i] = p
        attempt = max((int(p["row"].get("attempt") or 0) for p in got.values()), default=0)
        tries = 0
        while len(got) < n:
            need = [i for i in range(n) if i not in got]
            if label in self.cancelled:
                return []
            if tries > self.max_retries:
                with self.lock:
                    self.stats["groups_dropped"] += 1
                self.log(f"group {label} dropped whole: its node was lost {tries} times (max_retries {self.max_retries})")
                return []
            node, agent = self._pick(label, len(need))
            running = set(need)
            try:
                gen = agent.run_group.options(num_returns="streaming").remote(step, task_id, need, attempt, evaluation)
                for ref in gen:
                    p = ray.get(ref)
                    i = int(p["row"]["sample_index"])
                    self.store.put(self.store.key(step, task_id, i), p)
                    got[i] = p
                    running.discard(i)
                    with self.lock:
                        self.in_flight[node] -= 1
                        self.stats["samples_finished"] += 1
                        self.by_node[node] += 1
            except RayActorError as exc:
                self.mark_lost(node, type(exc).__name__)
                tries += 1
                attempt += 1
                with self.lock:
                    self.stats["groups_retried"] += 1
                    self.stats["samples_retried"] += len(running)
                if label not in self.cancelled:
                    self.log(f"group {label}: {len(running)} unfinished sample(s) re-dispatched (attempt {attempt})")
            finally:
                with self.lock:
                    self.in_flight[node] -= len(running)
            if label in self.cancelled:
                return []
            if running and node in self.agents:  # the generator ended without them, its node alive
                raise RuntimeError(f"group {label}: node {node[:12]} ended without samples {sorted(running)}")
        with self.lock:
            self.where.pop(label, None)
        return [got[i] for i in range(n)]
