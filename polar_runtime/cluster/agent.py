"""The node agent: one per node, everything that node runs for the loop (no Ray imported here).

A :class:`NodeAgent` is a plain object; ``placement.py`` makes it a Ray actor pinned to its node
(``NodeAffinitySchedulingStrategy``, hard). On its node it owns:

- the Polar proxy (mitmdump with the addon) in front of that node's vLLM replica(s): a list of
  URLs, which the proxy routes between (one session stays on one replica);
- the harness runs and their sandboxes, through the rollout runner (``polar_runtime.rollout``);
- ``<node_dir>/<node id>/``: captures (``captures/sessions/*.jsonl``, ``flows.mitm``), work dirs,
  per-sample results, logs. Captures never leave the node during a run (``polar cluster gather``
  copies them afterwards).

What leaves the node is a *finished sample*, yielded the moment it finishes (:meth:`run_group` is
a generator; Ray streams each item to the driver as an object): its rollout row (reward, status),
its training sequences (prefix-merged from the node's captures: token ids, loss mask, behaviour
logprobs, the tokenizer fingerprint) as Arrow IPC bytes, and its sampled tokens by policy version
(the staleness bound's ages, read from the captures). A node lost mid-group has handed over every
sample it finished; the driver re-runs only the others, elsewhere.

The loop's evaluation (``eval.every``) runs here too: ``eval-<id>`` groups of ``eval.samples``,
their results under ``<node_dir>/<node id>/eval`` (apart from the training rollouts), no training
sequences built.

A group re-run after a node loss carries ``attempt`` > 0: its sessions are ``<task>.st<s>.s<i>.r<n>``,
so a session id names one run on one node and the captures of the lost run stay told apart.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from polar_core import cancel


@dataclass
class AgentSpec:
    """What a node agent needs to run samples; built once by the driver, pickled to every node."""

    node_id: str
    node_dir: str  # absolute; the agent works in <node_dir>/<node_id>
    tasks: dict[str, Any]  # task id -> polar_trial.tasks.Task (shorthand tasks travel whole)
    harness: str
    command: str = ""  # the generic preset's template
    served_model: str = ""
    model: str = ""  # a Polar model name or a model directory: the chat template of trajectories
    samples: int = 2
    concurrency: int = 2
    timeout: float = 150.0
    sandbox: str = "auto"
    pids: Optional[int] = 4096
    max_tokens: int = 0
    temperature: float = 1.0
    seed: Optional[int] = None
    exact_history: bool = True
    proxy_options: dict[str, Any] = field(default_factory=dict)
    eval_tasks: dict[str, Any] = field(default_factory=dict)  # ``eval-<id>`` -> Task (``eval.every``; empty: off)
    eval_samples: int = 1


def node_root(node_dir: str | Path, node_id: str) -> Path:
    """A node's own directory: the full node id, so that directories on a shared file system never mix."""
    return Path(node_dir) / node_id


class NodeAgent:
    """That node's proxy, harness runs and captures; see the module docstring."""

    def __init__(self, spec: AgentSpec) -> None:
        from polar_runtime.loop.placement import ChildRecord

        self.spec = spec
        self.root = node_root(spec.node_dir, spec.node_id)
        self.captures = self.root / "captures"
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.children = ChildRecord(self.root)
        self.children.stop_leftovers(lambda _m: None)  # a killed earlier run of this node dir
        self.stack = contextlib.ExitStack()
        self.proxy: Any = None
        self._scopes: dict[str, Any] = {}
        self._scopes_lock = threading.Lock()
        self._build_lock = threading.Lock()  # the capture frames' cache is one per directory
        self._renderer: Any = None

    # ---- life ------------------------------------------------------------------------------------
    def start(self, upstreams: list[str], policy_version: int) -> dict[str, Any]:
        """Start the proxy in front of ``upstreams`` serving ``policy_version``; returns where things are."""
        from polar_proxy.process import ProxyProcess
        from polar_runtime import harnesses as h
        from polar_runtime import rollout as r

        s = self.spec
        self.preset = h.get_preset(s.harness, s.command)
        if self.preset.package and not self.preset.installed():  # this node's copy of the agent CLI (npm, pinned)
            h.install(self.preset.package, log=lambda _m: None)
        options = {"polar_max_tokens_cap": s.max_tokens, "save_stream_file": str(self.captures / "flows.mitm"),
                   "polar_sampling": r.sampling_spec(s.temperature, s.seed), "polar_exact_history": s.exact_history,
                   "polar_require_session_key": True, **s.proxy_options}
        self.captures.mkdir(parents=True, exist_ok=True)
        self.proxy = ProxyProcess(upstreams if len(upstreams) > 1 else upstreams[0], self.captures, mode="reverse",
                                  served_model=s.served_model or None, options=options,
                                  log_file=self.root / "logs" / "proxy.log", startup_timeout=180.0, passthrough=False)
        self.stack.enter_context(self.proxy)
        self.children.add("proxy", getattr(self.proxy.proc, "pid", None), group=True)
        self.proxy.control.set_policy_version(policy_version)
        self.endpoint = h.Endpoint(mode="base_url", base_url=self.proxy.url, proxy_url=self.proxy.url,
                                   ca_cert=self.proxy.ca_cert)
        return self.info()

    def info(self) -> dict[str, Any]:
        return {"node_id": self.spec.node_id, "hostname": socket.gethostname(), "pid": os.getpid(),
                "root": str(self.root), "captures": str(self.captures),
                "proxy": getattr(self.proxy, "url", None)}

    def stop(self) -> None:
        for scope in list(self._scopes.values()):
            with contextlib.suppress(Exception):
                scope.cancel(None)
        self.stack.close()
        self.proxy = None
        with contextlib.suppress(OSError):
            self.children.path.unlink()

    # ---- the proxy's gate (the weight push) -------------------------------------------------------
    def pause(self, drain_timeout: float = 600.0) -> None:
        """Hold new model calls and wait for the ones in flight (raises PushError if they do not end)."""
        from polar_training.weights_push import pause_proxy

        pause_proxy(self.proxy.control, drain_timeout)

    def resume(self, policy_version: Optional[int]) -> None:
        """Reopen the gate; calls from now on are recorded under ``policy_version`` (None: unchanged)."""
        self.proxy.control.resume(policy_version)

    # ---- samples ---------------------------------------------------------------------------------
    def run_group(self, step: int, task_id: str, samples: list[int], attempt: int = 0,
                  evaluation: bool = False) -> Iterator[dict[str, Any]]:
        """Run ``samples`` of ``task_id``'s group of rollout step ``step`` (``harness.concurrency`` at
        once); yield each finished sample (:meth:`finished`) as it finishes. A cancelled group yields
        nothing more. ``evaluation``: an ``eval-<id>`` task of the evaluation (``eval.every``), its
        results under ``<node>/eval`` as the local loop's under ``<out>/eval``, no training sequences."""
        from polar_runtime import evaluation as ev
        from polar_runtime import rollout as r

        s = self.spec
        task = (s.eval_tasks if evaluation else s.tasks)[task_id]
        results = ev.demo_capture_dir(self.root, self.captures) if evaluation else self.captures
        rcfg = r.RolloutConfig(tasks=[task], preset=self.preset, endpoint=self.endpoint,
                               capture_dir=results, model=s.served_model,
                               samples=s.eval_samples if evaluation else s.samples,
                               concurrency=s.concurrency, timeout=s.timeout, step=step, sandbox=s.sandbox,
                               pids=s.pids, first_attempt=attempt)
        store = r.ResultStore(results)
        registry = r.SessionRegistry(self.proxy.control)
        scope = self._scope(step, task_id)

        def one(i: int) -> Optional[dict[str, Any]]:
            key = r.sample_key(task_id, step, i)
            row = store.done(key)
            if row is not None and int(row.get("attempt") or 0) >= attempt:
                return row  # finished here before (the driver lost it: a restarted driver asks again)
            with cancel.bound(scope):
                if scope.cancelled.is_set():
                    return None
                row = r.run_sample(rcfg, r.Job(task, i), registry)
                if scope.cancelled.is_set():
                    return None
                store.put(key, row)
                return row

        with cf.ThreadPoolExecutor(max_workers=s.concurrency, thread_name_prefix=f"agent-{task_id}") as pool:
            futures = [pool.submit(one, i) for i in samples]
            for fut in cf.as_completed(futures):
                row = fut.result()
                if row is not None and not scope.cancelled.is_set():
                    yield self.finished(row, sequences=not evaluation)
        with self._scopes_lock:
            self._scopes.pop(scope.name, None)

    def _scope(self, step: int, task_id: str) -> Any:
        name = f"{task_id}.st{step}"
        with self._scopes_lock:
            scope = self._scopes.get(name) or cancel.CancelScope(name)
            self._scopes[name] = scope
        return scope

    def cancel_group(self, step: int, task_id: str) -> dict[str, Any]:
        """Stop a dropped group now: its harnesses and sandboxes killed, its sessions closed."""
        return self._scope(step, task_id).cancel(self.proxy.control)

    def finished(self, row: dict[str, Any], sequences: bool = True) -> dict[str, Any]:
        """A finished sample as it leaves the node: its row, its sampled tokens by policy version, its
        training sequences (Arrow IPC bytes; None when it sampled nothing or ``sequences`` is off:
        an evaluation sample, never trained on) and their build counts."""
        import polars as pl

        from polar_analysis import alignment, frames
        from polar_analysis.trajectories import common, prefix_merge

        sid = row["session_id"]
        versions: dict[int, int] = {}
        traj: Optional[bytes] = None
        stats: dict[str, Any] = {}
        with self._build_lock:  # the session's file converted once, its frame held in memory
            lf = frames.session_calls(self.captures, sid).filter(pl.col("session_id") == sid).collect().lazy()
        by = lf.group_by("policy_version").agg(tokens=pl.col("n_sampled_ids").sum()).collect()
        for rec in by.iter_rows(named=True):
            if rec["policy_version"] is not None:
                versions[int(rec["policy_version"])] = int(rec["tokens"] or 0)
        if row.get("calls") and sequences:
            renderer = self.renderer()
            df, st = prefix_merge.build(lf, template=alignment.template_info_for(renderer, lf))
            df = common.stamp_tokenizer(df, alignment.tokenizer_fingerprint(renderer))
            buf = io.BytesIO()
            df.write_ipc(buf)
            traj = buf.getvalue()
            d = st.as_dict()
            stats = {k: d[k] for k in ("calls", "usable_calls", "sessions", "chains", "sequences", "merges",
                                       "breaks", "sampled_tokens", "covered_tokens", "sequence_tokens")}
        return {"row": row, "versions": versions, "trajectory": traj, "stats": stats, "node_id": self.spec.node_id}

    def renderer(self) -> Any:
        """The chat template the trajectories are checked against (the served model's tokenizer)."""
        with self._build_lock:
            return self._load_renderer()

    def _load_renderer(self) -> Any:
        if self._renderer is None:
            from polar_analysis import alignment
            from polar_runtime import models

            model = self.spec.model
            path = Path(model) if model and Path(model).is_dir() else models.ensure_model(model)
            self._renderer = alignment.get_renderer(path)
        return self._renderer

    def ping(self) -> dict[str, Any]:
        return self.info()
