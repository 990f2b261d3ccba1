"""``[placement] kind = "ray"``: the loop's phases on a Ray cluster (docs/cluster.md).

Start (:meth:`RayPlacement.start`), in this order, each step of it measured (``report()``):

1. connect to ``placement.address`` (an existing cluster) or start Ray on this machine (empty);
2. the nodes: every live node, or those with the custom resource ``placement.node_resource``;
3. vLLM replicas: one :class:`~.replicas.VLLMReplica` actor per node, pinned to it (hard node
   affinity), started at once, or the user's ``placement.replicas`` URLs;
4. one :class:`~.agent.NodeAgent` actor per node, pinned to it, its proxy in front of that node's
   replica (or the URLs; the proxy routes between several);
5. the trainer: :class:`~.trainer.TrainerHost` in a placement group (``trainer_cpus``/``trainer_gpus``).

Actors ask for no CPU of Ray's (``num_cpus=0``): the harnesses and vLLM use the node's cores outside
Ray's accounting, and a node agent must never wait for a slot on its own node.

Phases: ``rollout``/``rollout_group`` go through :class:`~.dispatch.Dispatcher` (least-loaded node,
finished samples kept on the driver as they arrive, groups of a lost node re-run elsewhere);
``trajectories`` joins the samples' sequences (built on their nodes) and their rewards;
``train`` hands the Parquet bytes to the trainer; ``push`` closes every live node's gate, reloads
and verifies every replica (each on its own node), and reopens the gates under the new version only
when all verified. Nothing here is imported unless ``kind = "ray"``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Optional

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from polar_runtime.loop.config import LoopConfig
from polar_runtime.loop.groups import LoopError
from polar_runtime.loop import phases
from polar_runtime.loop.placement import ChildRecord, TrainOutcome

from .agent import AgentSpec, NodeAgent, node_root
from .dispatch import Dispatcher, SampleStore
from .replicas import UrlReplica, VLLMReplica
from .trainer import TrainerHost

START_TIMEOUT_S = 1800.0  # a vLLM CPU start on a loaded node takes minutes


def live_nodes(resource: str = "") -> list[dict[str, Any]]:
    """Ray's live nodes (those with ``resource`` when given), in a stable order."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and (not resource or n.get("Resources", {}).get(resource, 0) > 0)]
    return sorted(nodes, key=lambda n: n["NodeID"])


def pinned(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


class RayPlacement:
    """The loop's :class:`~polar_runtime.loop.placement.Placement` on Ray (module docstring)."""

    def __init__(self, cfg: LoopConfig, out: Path, log: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.out = Path(out).resolve()
        self.log = log or print
        self.pc = cfg.placement
        self.node_dir = self.pc.node_dir or str(self.out / "nodes")
        self.started_ray = False
        self.agents: dict[str, Any] = {}
        self.replicas: dict[str, Any] = {}  # node id (or URL) -> actor handle / UrlReplica
        self.trainer: Any = None
        self.pg: Any = None
        self.timing: dict[str, float] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.dispatcher: Optional[Dispatcher] = None
        self.store = SampleStore(self.out / "cluster" / "samples")
        self.eval_tasks: dict[str, Any] = {}

    # ---- start ----------------------------------------------------------------------------------
    def _connect(self) -> None:
        if ray.is_initialized():
            return
        if self.pc.address:
            ray.init(address=self.pc.address, namespace="polar", log_to_driver=False)
        else:
            ray.init(include_dashboard=False, namespace="polar", log_to_driver=False)
            self.started_ray = True

    def _tasks(self) -> dict[str, Any]:
        return {t.id: t for t in phases.select_tasks(self.cfg)}

    def _eval_tasks(self) -> dict[str, Any]:
        """``eval-<id>`` -> task of the evaluation (``eval.tasks``/``eval.ids``, else the training
        tasks), as the local placement runs them; empty when ``eval.every`` is off."""
        from polar_runtime import evaluation as ev

        if not self.cfg.eval.every:
            return {}
        return {t.id: t for t in ev.demo_tasks(phases.select_eval_tasks(self.cfg) or list(self.tasks.values()))}

    def start(self, serve_from: Optional[str], policy_version: int) -> None:
        from polar_runtime import rollout as r
        from polar_runtime.serve import resolve_model

        cfg, pc = self.cfg, self.pc
        gpu = cfg.on_gpu
        t0 = time.monotonic()
        self._connect()
        self.timing["connect_s"] = round(time.monotonic() - t0, 3)
        nodes = live_nodes(pc.node_resource)
        if not nodes:
            raise LoopError(f"no live Ray node{' with resource ' + pc.node_resource if pc.node_resource else ''}")
        self.nodes = {n["NodeID"]: {"address": n.get("NodeManagerAddress"), "resources": n.get("Resources")} for n in nodes}
        self.tasks = self._tasks()
        self.eval_tasks = self._eval_tasks()
        self.log(f"ray: {len(nodes)} node(s) for rollouts: {', '.join(n[:12] for n in self.nodes)}")

        t = time.monotonic()
        if pc.replicas:
            self.replicas = {u: UrlReplica(u) for u in pc.replicas}
            upstreams = {n: list(pc.replicas) for n in self.nodes}
            served = r.served_model_of(pc.replicas[0])
        else:
            served = resolve_model(cfg.model.name)[1] if not Path(cfg.model.name).is_dir() else Path(cfg.model.name).name
            actor = ray.remote(VLLMReplica)
            for n in self.nodes:
                self.replicas[n] = actor.options(num_cpus=0, num_gpus=1 if gpu else 0, scheduling_strategy=pinned(n),
                                                 max_concurrency=4).remote(
                    cfg.model.name, served, max_model_len=cfg.model.max_model_len, kv_cache_gib=cfg.model.kv_cache_gib,
                    tool_parser=cfg.model.tool_parser, gpu=gpu, log_dir=str(node_root(self.node_dir, n) / "logs"),
                    record_dir=str(node_root(self.node_dir, n)))
            started = dict(zip(self.replicas, ray.get([h.start.remote(serve_from) for h in self.replicas.values()],
                                                      timeout=START_TIMEOUT_S)))
            upstreams = {n: [started[n]["url"]] for n in self.nodes}
            self.log("vLLM replicas ready: " + ", ".join(f"{n[:12]} {s['url']} in {s['start_s']} s" for n, s in started.items()))
        self.served = served
        self.timing["replicas_s"] = round(time.monotonic() - t, 3)

        t = time.monotonic()
        actor = ray.remote(NodeAgent)
        for n in self.nodes:
            spec = AgentSpec(node_id=n, node_dir=self.node_dir, tasks=self.tasks, harness=cfg.harness.name,
                             command=cfg.harness.command, served_model=served, model=cfg.model.name,
                             samples=cfg.rollout.samples_per_group, concurrency=cfg.harness.concurrency,
                             timeout=cfg.resolved_timeout(), sandbox=cfg.sandbox.backend,
                             pids=cfg.sandbox.pids, max_tokens=cfg.resolved_max_tokens(), temperature=cfg.sampling.temperature,
                             seed=None if cfg.sampling.seed is None or cfg.sampling.seed < 0 else cfg.sampling.seed,
                             exact_history=cfg.harness.exact_history, eval_tasks=self.eval_tasks,
                             eval_samples=cfg.eval.samples)
            self.agents[n] = actor.options(num_cpus=0, max_concurrency=256, scheduling_strategy=pinned(n)).remote(spec)
        infos = ray.get([a.start.remote(upstreams[n], policy_version) for n, a in self.agents.items()],
                        timeout=START_TIMEOUT_S)
        for info in infos:
            self.nodes[info["node_id"]].update(hostname=info["hostname"], root=info["root"], proxy=info["proxy"])
        self.timing["agents_s"] = round(time.monotonic() - t, 3)

        t = time.monotonic()
        from ray.util.placement_group import placement_group

        bundle = {"CPU": float(pc.trainer_cpus), **({"GPU": float(pc.trainer_gpus)} if pc.trainer_gpus else {})}
        self.pg = placement_group([bundle], strategy="STRICT_PACK")
        ray.get(self.pg.ready(), timeout=600)
        self.trainer = ray.remote(TrainerHost).options(
            num_cpus=pc.trainer_cpus, num_gpus=pc.trainer_gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)).remote(
            cfg.model.name, str(self.out), phases.train_config(cfg).to_dict(), cfg.trainer.lora_rank)
        ray.get(self.trainer.start.remote(serve_from), timeout=600)
        self.timing["trainer_s"] = round(time.monotonic() - t, 3)

        self.dispatcher = Dispatcher(self.agents, self.store, cfg.rollout.samples_per_group, pc.max_retries, self.log)
        self.timing["start_s"] = round(time.monotonic() - t0, 3)
        self.log(f"ray placement started in {self.timing['start_s']:.1f} s")

    def task_ids(self) -> list[str]:
        return list(self.tasks)

    # ---- rollouts -------------------------------------------------------------------------------
    def _group(self, step: int, task_id: str) -> list[dict[str, Any]]:
        assert self.dispatcher is not None
        try:
            payloads = self.dispatcher.run_group(step, task_id)
        except RuntimeError as exc:
            raise LoopError(str(exc)) from exc
        return [dict(p["row"]) for p in payloads]

    def rollout(self, step: int, task_ids: list[str], policy_version: int) -> list[dict[str, Any]]:
        from polar_runtime import rollout as r

        with cf.ThreadPoolExecutor(max_workers=max(1, len(task_ids)), thread_name_prefix="ray-group") as pool:
            rows = [row for part in pool.map(lambda t: self._group(step, t), task_ids) for row in part]
        self.log(f"rollout {step}: {len(rows)} samples on {len(self.agents)} node(s), policy v{policy_version}")
        problem = r.failure_summary(rows, self.cfg.harness.name)
        if problem:
            raise LoopError(f"rollout step {step} produced nothing to learn from: {problem}")
        return rows

    def rollout_group(self, step: int, task_id: str, policy_version: int) -> list[dict[str, Any]]:
        return self._group(step, task_id)

    def cancel_group(self, step: int, task_id: str) -> dict[str, Any]:
        assert self.dispatcher is not None
        return self.dispatcher.cancel(step, task_id)

    def sample_versions(self, rows: list[dict[str, Any]]) -> dict[str, dict[int, int]]:
        found = {p["row"]["session_id"]: p for p in self.store.by_session({r["session_id"] for r in rows})}
        return {r["session_id"]: dict((found.get(r["session_id"]) or {}).get("versions") or {}) for r in rows}

    def trajectories(self, step: int, rows: list[dict[str, Any]]) -> tuple[Optional[str], dict[str, Any]]:
        import polars as pl

        from polar_analysis.trajectories import common

        payloads = self.store.by_session({r["session_id"] for r in rows})
        df = self.store.frame(payloads)
        stats: dict[str, Any] = {}
        for p in payloads:
            for k, v in (p.get("stats") or {}).items():
                stats[k] = stats.get(k, 0) + int(v)
        sampled, covered = stats.get("sampled_tokens", 0), stats.get("covered_tokens", 0)
        stats["coverage"] = covered / sampled if sampled else 1.0
        stats["nodes"] = dict(sorted({p["node_id"][:12]: sum(1 for q in payloads if q["node_id"] == p["node_id"])
                                      for p in payloads}.items()))
        if df is None or not sampled:
            return None, stats
        if stats["coverage"] < 1.0:
            raise LoopError(f"coverage {stats['coverage']:.4%}: sampled ids missing from the trajectories of step {step}")
        table = pl.DataFrame([{"session_id": r["session_id"], "reward": r.get("reward"), "status": r.get("status"),
                               "task_id": r.get("task_id"), "group_id": r.get("group_id")} for r in rows],
                             schema={"session_id": pl.String, "reward": pl.Float64, "status": pl.String,
                                     "task_id": pl.String, "group_id": pl.String}).lazy()
        df = common.attach_rewards(df, table).with_columns(
            status=pl.when(pl.col("reward").is_null()).then(pl.lit("failed")).otherwise(pl.col("status")))
        path = self.out / "trajectories" / f"step-{step}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        df.write_parquet(path)
        return str(path), stats

    # ---- training and the push ------------------------------------------------------------------
    def train(self, step: int, trajectories: str) -> TrainOutcome:
        t = time.monotonic()
        res = ray.get(self.trainer.step.remote(step, Path(trajectories).read_bytes()))
        self.log(f"train {step}: step {res['step']} in {time.monotonic() - t:.1f} s")
        if not res.get("updated"):
            return TrainOutcome(False, int(res["step"]), note="the trainer made no update")
        return TrainOutcome(True, int(res["step"]), checkpoint=res.get("checkpoint"), metrics=res.get("metrics") or {})

    def _live(self, what: str, calls: dict[str, Any]) -> dict[str, Any]:
        """Results of ``calls`` (node id -> object ref); a node whose actor died is marked lost."""
        out = {}
        for n, ref in calls.items():
            try:
                out[n] = ray.get(ref, timeout=START_TIMEOUT_S)
            except RayActorError as exc:
                assert self.dispatcher is not None
                self.dispatcher.mark_lost(n, f"{type(exc).__name__} during {what}")
        return out

    def push(self, checkpoint: str, policy_version: int) -> dict[str, Any]:
        """Every live node's gate closed (in-flight calls drain), every replica reloaded and verified,
        the gates reopened under ``policy_version``. A replica that fails leaves the gates closed and
        stops the push: no call may be recorded under a version some replica does not serve. Unlike
        ``push_weights`` the other replicas are not probed to reopen on the previous version, and a
        node lost mid-push is dropped, not a failure (docs/cluster.md, "When a push fails")."""
        assert self.dispatcher is not None
        t = time.monotonic()
        agents = dict(self.dispatcher.agents)
        try:
            self._live("pause", {n: a.pause.remote() for n, a in agents.items()})
        except Exception:  # calls did not drain somewhere: nothing was reloaded, every gate reopens unchanged
            self._live("resume", {n: a.resume.remote(None) for n, a in self.dispatcher.agents.items()})
            raise
        results: dict[str, Any] = {}
        if self.pc.replicas:
            for url, rep in self.replicas.items():
                results[url] = rep.reload(checkpoint)
        else:
            live = {n: h for n, h in self.replicas.items() if n in self.dispatcher.agents}
            results = self._live("reload", {n: h.reload.remote(checkpoint) for n, h in live.items()})
        self._live("resume", {n: a.resume.remote(policy_version) for n, a in self.dispatcher.agents.items()})
        methods = sorted({r["method"] for r in results.values()})
        return {"method": "+".join(methods) or "none", "policy_version": policy_version, "checkpoint_dir": checkpoint,
                "replicas": {k[:12] if not k.startswith("http") else k: v for k, v in results.items()},
                "paused_s": round(time.monotonic() - t, 3), "reload_s": max((r["reload_s"] for r in results.values()), default=0.0)}

    def evaluate(self, step: int, policy_version: int) -> Optional[dict[str, Any]]:
        """The evaluation (``eval.every``) as the local placement's (``phases.run_eval``): every
        evaluation task, ``eval.samples`` each, its groups spread over the nodes like a rollout's (a
        lost node's unfinished samples re-run elsewhere), scored on the driver."""
        from polar_runtime import evaluation as ev

        if not self.cfg.eval.every:
            return None
        assert self.dispatcher is not None
        t = time.monotonic()
        n = self.cfg.eval.samples

        def group(task_id: str) -> list[dict[str, Any]]:
            try:
                return [dict(p["row"]) for p in self.dispatcher.run_group(step, task_id, n, evaluation=True)]
            except RuntimeError as exc:
                raise LoopError(f"eval {step}: {exc}") from exc

        ids = list(self.eval_tasks)
        with cf.ThreadPoolExecutor(max_workers=max(1, len(ids)), thread_name_prefix="ray-eval") as pool:
            rows = [row for part in pool.map(group, ids) for row in part]
        if not rows:  # every group dropped (its nodes lost): nothing to score, the loop goes on
            self.log(f"eval {step}: no sample finished, no evaluation")
            return None
        result = ev.score_rows(rows, strip_prefix=ev.DEMO_PREFIX)
        self.log(f"eval {step}: {len(ids)} tasks x {n} samples on {len(self.dispatcher.agents)} node(s), "
                 f"policy v{policy_version}, {time.monotonic() - t:.1f} s: {ev.headline(result)}")
        return {"step": step, "policy_version": policy_version, **result}

    # ---- what it tells ---------------------------------------------------------------------------
    def counters(self) -> dict[str, Any]:
        return self.dispatcher.counters() if self.dispatcher is not None else {}

    def report(self) -> dict[str, Any]:
        d = self.dispatcher
        return {"kind": "ray", "timing": dict(self.timing), "counters": self.counters(),
                "nodes": {n[:12]: {**{k: v for k, v in info.items() if k != "resources"},
                                   "samples": d.by_node.get(n, 0) if d else 0,
                                   "lost": (d.lost.get(n) if d else None)} for n, info in self.nodes.items()},
                "node_dir": self.node_dir}

    # ---- stop -----------------------------------------------------------------------------------
    def close(self) -> None:
        calls = []
        live = self.dispatcher.agents if self.dispatcher is not None else self.agents
        for n, a in live.items():
            calls.append(a.stop.remote())
        for n, h in self.replicas.items():
            if not isinstance(h, UrlReplica) and (self.dispatcher is None or n in self.dispatcher.agents):
                calls.append(h.stop.remote())
        if self.trainer is not None:
            calls.append(self.trainer.stop.remote())
        for ref in calls:
            with contextlib.suppress(Exception):
                ray.get(ref, timeout=120)
        for h in [*self.agents.values(), *[h for h in self.replicas.values() if not isinstance(h, UrlReplica)],
                  *([self.trainer] if self.trainer is not None else [])]:
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
        # what a lost node's actors left running, where its directory is visible from here (one machine)
        for n in (self.dispatcher.lost if self.dispatcher is not None else {}):
            for d in (node_root(self.node_dir, n), node_root(self.node_dir, n) / "replica"):
                with contextlib.suppress(Exception):
                    ChildRecord(d).stop_leftovers(self.log)
        if self.started_ray:
            ray.shutdown()
