"""Where the loop's work runs, behind one small interface.

:class:`Placement` is what the loop (``loop.py``) asks for, phase by phase: serve a policy version,
run a step's groups, turn them into trajectories, train one GRPO step (a full checkpoint each
time: resume needs weights, AdamW moments and RNG on disk), push the new weights, evaluate. The
loop owns the schedule and the progress file; a placement owns processes and machines.

:class:`LocalPlacement` (the default, ``placement.kind = "local"``) runs everything on this machine
with the building blocks of ``phases.py``: a real vLLM, the Polar proxy in front of it, the harness through
the rollout runner, the persistent trainer (``polar_training.session``) as a child process.
``placement.kind = "module:attribute"`` names another factory (``factory(cfg, out) -> Placement``):
the seam where a multi-machine placement goes, and where the tests put their fakes.

``kill -9`` leaves children behind (vLLM and the proxy run in process groups of their own, and the
trainer finishes its command before it sees its pipe close): the local placement records their
pids with their start times in ``<out>/loop-children.json``, and a resumed run stops exactly those
(a recycled pid has another start time and is left alone) before it starts its own.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from polar_core import cancel

from .config import LoopConfig

CHILDREN_FILE = "loop-children.json"


@dataclass
class TrainOutcome:
    updated: bool  # False: nothing learned (no update), the policy stays
    policy_version: int  # the trainer's step count after this step
    checkpoint: Optional[str] = None  # full checkpoint of the new weights (servable, resumable)
    metrics: dict[str, Any] = field(default_factory=dict)
    note: Optional[str] = None
    peak_rss_gib: Optional[float] = None  # the step's peak resident memory (VmHWM reset per step)
    timings: dict[str, float] = field(default_factory=dict)  # the trainer's own phase times


class Placement(Protocol):
    """The loop's view of the machines. Every method may raise; the loop records nothing of a phase
    that did not return."""

    def start(self, serve_from: Optional[str], policy_version: int) -> None:
        """Serve ``serve_from`` (a checkpoint; None: the base model) as ``policy_version``; the trainer,
        when started, resumes from the same checkpoint."""

    def task_ids(self) -> list[str]:
        """The configured tasks, in order (each step's groups are drawn from them)."""

    def rollout(self, step: int, task_ids: list[str], policy_version: int) -> list[dict[str, Any]]:
        """One group per task id (``samples_per_group`` samples): the rows of the rollout runner
        (``session_id``, ``group_id``, ``task_id``, ``status``, ``reward``, ``calls``, ...). Samples
        finished before an earlier kill are returned without running again."""

    def rollout_group(self, step: int, task_id: str, policy_version: int) -> list[dict[str, Any]]:
        """Asynchronous mode: one group (``samples_per_group`` samples of one task, rollout step label
        ``step``), called from several threads at once; finished samples are returned without running
        again. ``policy_version`` is what was served when it started (a push may come mid-group)."""

    def sample_versions(self, rows: list[dict[str, Any]]) -> dict[str, dict[int, int]]:
        """Per session of ``rows``: sampled tokens by the policy_version each captured call was served
        under (read from the captures, never assumed): the token ages of the staleness bound."""

    def trajectories(self, step: int, rows: list[dict[str, Any]]) -> tuple[Optional[str], dict[str, Any]]:
        """Training sequences of the step's samples (a Parquet path, None when nothing was sampled), stats."""

    def train(self, step: int, trajectories: str) -> TrainOutcome:
        """One GRPO iteration; writes a full checkpoint of the new weights."""

    def push(self, checkpoint: str, policy_version: int) -> dict[str, Any]:
        """Serve ``checkpoint`` as ``policy_version`` (the proxy holds calls only for the swap)."""

    def evaluate(self, step: int, policy_version: int) -> Optional[dict[str, Any]]:
        """An evaluation of the served policy (``eval.every``), or None when off."""

    def close(self) -> None:
        """Stop everything started; the trainer's memory goes back to the system."""


#: placement kinds by name (docs/cluster.md for "ray")
KINDS = {"ray": "polar_runtime.cluster.placement:RayPlacement"}


def make_placement(cfg: LoopConfig, out: Path) -> Placement:
    if cfg.placement.kind == "local":
        return LocalPlacement(cfg, out)
    # "ray" names a factory like any other (imported only when asked for: one machine never needs
    # Ray, and the cluster package, which builds on this module, is never imported from here)
    module, _, attr = KINDS.get(cfg.placement.kind, cfg.placement.kind).partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(cfg, out)


# ---------------------------------------------------------------------------------------------
# children left by a killed run


def _start_time(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time in clock ticks since boot


class ChildRecord:
    """The pids this run started, with their start times, in ``<out>/loop-children.json``."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / CHILDREN_FILE
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, Any]]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.path.read_text())
        return {}

    def add(self, name: str, pid: Optional[int], group: bool) -> None:
        if not pid:
            return
        with self._lock:
            data = self._read()
            data[name] = {"pid": pid, "start": _start_time(pid), "group": group}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)

    def stop_leftovers(self, log: Callable[[str], None]) -> list[str]:
        """SIGKILL what an earlier (killed) run of this directory left running; returns their names."""
        stopped = []
        for name, rec in self._read().items():
            pid, start = int(rec["pid"]), rec.get("start")
            if pid == os.getpid() or start is None or _start_time(pid) != start:
                continue  # gone, or the pid now belongs to another process
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if rec.get("group"):
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
                stopped.append(name)
        if stopped:
            log(f"stopped what the interrupted run left running: {', '.join(stopped)}")
            time.sleep(1.0)
        with contextlib.suppress(OSError):
            self.path.unlink()
        return stopped


# ---------------------------------------------------------------------------------------------
# this machine


class LocalPlacement:
    """vLLM, the proxy, the harness runs and the trainer, all on this machine."""

    def __init__(self, cfg: LoopConfig, out: Path, log: Callable[[str], None] | None = None,
                 upstream: Optional[str] = None) -> None:
        from . import phases

        self.cfg = cfg
        #: a vLLM someone else runs (``polar certify --upstream``): attached to, never started or stopped
        self.upstream = upstream
        self.out = Path(out)
        self.captures = self.out / "captures"
        self.log = log or phases.console.print
        self.tl = phases.Timeline(phases.console)
        self.children = ChildRecord(self.out)
        self.stack = contextlib.ExitStack()
        self.trainer: Any = None
        self.checkpoint: Optional[str] = None  # what the trainer resumes from when (re)started
        self.stop_event = threading.Event()
        self._scopes: dict[str, Any] = {}  # "task.st<label>" -> the CancelScope of a running group
        self._scopes_lock = threading.Lock()
        self.cancelled_groups: list[dict[str, Any]] = []  # what each cancel_group stopped

    # ---- start ----------------------------------------------------------------------------------
    def start(self, serve_from: Optional[str], policy_version: int) -> None:
        from polar_proxy.process import ProxyProcess
        from polar_runtime import harnesses as h
        from polar_runtime import rollout as r
        from polar_runtime.serve import VLLMServer

        from . import phases

        cfg = self.cfg
        gpu = cfg.on_gpu
        self.children.stop_leftovers(self.log)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.checkpoint = serve_from
        with self.tl.phase("setup", "venvs, model, harness (built only when missing)") as ph:
            self.model_dir, self.served = phases.ensure_setup(cfg.model.name, cfg.harness.name, self.log)
            self.serve_dir = phases.servable_dir(self.model_dir, self.log)
            self.preset = h.get_preset(cfg.harness.name, cfg.harness.command)
            tasks = phases.select_tasks(cfg)
            self.tasks = {t.id: t for t in tasks}
            # the evaluation's tasks: the training ones, or another set (transfer: tasks never trained on)
            self.eval_tasks = phases.select_eval_tasks(cfg) or list(tasks)
            ph.detail = f"{self.served}, {self.preset.name}, {len(tasks)} tasks" + (
                f", {len(self.eval_tasks)} other tasks evaluated" if cfg.eval.tasks else "")
        with self.tl.phase("serve", f"vLLM serving {self.served} v{policy_version}") as ph:
            if self.upstream:
                self.server = VLLMServer.attach(self.upstream, self.model_dir, served_model_name=self.served)
                ph.detail = f"attached to the running {self.server.base_url}"
            else:
                extra = ("--gpu-memory-utilization", "0.35") if gpu else ()  # room on the GPU for the trainer
                self.server = VLLMServer(Path(serve_from) if serve_from else self.serve_dir, served_model_name=self.served,
                                         max_model_len=cfg.model.max_model_len, kv_cache_gib=cfg.model.kv_cache_gib,
                                         extra_args=extra, gpu=gpu, tool_parser=cfg.model.tool_parser, log_path=self.out / "logs" / "vllm.log")
                self.stack.enter_context(self.server)
                self.children.add("vllm", getattr(self.server.proc, "pid", None), group=True)
                ph.detail = f"ready in {self.server.start_seconds} s at {self.server.base_url}"
        with self.tl.phase("proxy", "Polar proxy (mitmproxy addon), reverse mode"):
            seed = cfg.sampling.seed if cfg.sampling.seed is not None and cfg.sampling.seed >= 0 else None
            self.proxy = ProxyProcess(self.server.base_url, self.captures, mode="reverse", served_model=self.served,
                                      options={"polar_max_tokens_cap": cfg.resolved_max_tokens(),
                                               "save_stream_file": str(self.captures / "flows.mitm"),
                                               "polar_sampling": r.sampling_spec(cfg.sampling.temperature, seed),
                                               "polar_exact_history": cfg.harness.exact_history,
                                               "polar_require_session_key": True},
                                      log_file=self.out / "logs" / "proxy.log", startup_timeout=180.0, passthrough=False)
            self.stack.enter_context(self.proxy)
            self.children.add("proxy", getattr(self.proxy.proc, "pid", None), group=True)
            self.proxy.control.set_policy_version(policy_version)
        self.endpoint = h.Endpoint(mode="base_url", base_url=self.proxy.url, proxy_url=self.proxy.url,
                                   ca_cert=self.proxy.ca_cert)
        self.stack.callback(lambda: self.trainer is not None and self.trainer.stop(5.0))

    def task_ids(self) -> list[str]:
        return list(self.tasks)

    # ---- phases ---------------------------------------------------------------------------------
    def rollout(self, step: int, task_ids: list[str], policy_version: int) -> list[dict[str, Any]]:
        from polar_runtime import rollout as r

        from . import phases
        from .groups import LoopError

        rcfg = r.RolloutConfig(tasks=[self.tasks[t] for t in task_ids], preset=self.preset, endpoint=self.endpoint,
                               capture_dir=self.captures, model=self.served, samples=self.cfg.rollout.samples_per_group,
                               concurrency=self.cfg.harness.concurrency, timeout=self.cfg.resolved_timeout(), step=step,
                               sandbox=self.cfg.sandbox.backend, pids=self.cfg.sandbox.pids,
                               allow_internet=self.cfg.sandbox.allow_internet)
        rcfg.rerun = r.rerun_if_nothing_to_learn(rcfg, r.ResultStore(rcfg.capture_dir))  # a resumed failed step
        with self.tl.phase(f"rollout {step}", f"{self.preset.name} x {len(task_ids)} groups x {rcfg.samples} samples, "
                           f"policy v{policy_version}") as ph:
            rows = phases.run_rollouts(rcfg, self.proxy.control, self.stop_event, f"rollout {step}").to_dicts()
            rewards = [row["reward"] for row in rows if row["reward"] is not None]
            mean = round(sum(rewards) / len(rewards), 3) if rewards else None
            ph.detail = f"mean reward {mean}, {sum(int(row['calls'] or 0) for row in rows)} calls"
        problem = r.failure_summary(rows, self.preset.name)
        if problem:
            raise LoopError(f"rollout step {step} produced nothing to learn from: {problem}")
        return rows

    def rollout_group(self, step: int, task_id: str, policy_version: int) -> list[dict[str, Any]]:
        """One group on a worker thread of the asynchronous schedule: no progress bar (one live display
        at a time), the shared result store (thread-safe), ``harness.concurrency`` samples at once."""
        import concurrent.futures as cf

        from polar_runtime import rollout as r

        rcfg = r.RolloutConfig(tasks=[self.tasks[task_id]], preset=self.preset, endpoint=self.endpoint,
                               capture_dir=self.captures, model=self.served, samples=self.cfg.rollout.samples_per_group,
                               concurrency=self.cfg.harness.concurrency, timeout=self.cfg.resolved_timeout(), step=step,
                               sandbox=self.cfg.sandbox.backend, pids=self.cfg.sandbox.pids,
                               allow_internet=self.cfg.sandbox.allow_internet)
        rcfg.capture_dir.mkdir(parents=True, exist_ok=True)
        store = r.ResultStore(rcfg.capture_dir)
        todo, done = r.plan(rcfg, store)
        registry = r.SessionRegistry(self.proxy.control)
        scope = self._scope(step, task_id)

        def one(job: Any) -> Optional[dict[str, Any]]:
            with cancel.bound(scope):  # what this sample starts is killed if its group is dropped
                if self.stop_event.is_set() or scope.cancelled.is_set():
                    return None
                row = r.run_sample(rcfg, job, registry)
                if self.stop_event.is_set() or scope.cancelled.is_set():
                    return None  # not a result: a dropped group is never trained on
                store.put(r.sample_key(job.task.id, rcfg.step, job.sample), row)
                return row

        with cf.ThreadPoolExecutor(max_workers=rcfg.concurrency, thread_name_prefix=f"loop-{task_id}") as pool:
            rows = [row for row in pool.map(one, todo) if row is not None]
        store.write_parquet()  # the trajectories read rewards from rollouts.parquet
        with self._scopes_lock:
            self._scopes.pop(scope.name, None)
        if scope.cancelled.is_set():
            self.log(f"  group {scope.name}: cancelled after {len(rows)} finished sample(s)")
            return []
        self.log(f"  group {task_id}.st{step}: {len(rows)} run, {len(done)} reused, started under v{policy_version}")
        return done + rows

    def _scope(self, step: int, task_id: str) -> Any:
        name = f"{task_id}.st{step}"
        with self._scopes_lock:  # a cancel that came before the group's thread got here stays
            scope = self._scopes.get(name) or cancel.CancelScope(name)
            self._scopes[name] = scope
        return scope

    def cancel_group(self, step: int, task_id: str) -> dict[str, Any]:
        """Stop a dropped straggler group now (``polar_core/cancel.py``): its harnesses and sandboxes
        are killed, its proxy sessions closed, its unstarted samples never start; other groups are
        untouched. Without it the group ran to ``harness.timeout_s`` and held a rollout slot."""
        scope = self._scope(step, task_id)  # one not started yet is refused when it starts
        res = scope.cancel(self.proxy.control)
        self.cancelled_groups.append(res)
        self.log(f"  group {scope.name} dropped: {res['processes_killed']} process group(s) killed, "
                 f"{res['sessions_closed']} session(s) closed")
        return res

    def sample_versions(self, rows: list[dict[str, Any]]) -> dict[str, dict[int, int]]:
        import polars as pl

        from polar_analysis import frames

        sids = [r["session_id"] for r in rows]
        df = (frames.calls(self.captures, rewards=None).filter(pl.col("session_id").is_in(sids))
              .group_by("session_id", "policy_version").agg(tokens=pl.col("n_sampled_ids").sum()).collect())
        out: dict[str, dict[int, int]] = {sid: {} for sid in sids}
        for rec in df.iter_rows(named=True):
            if rec["policy_version"] is not None:
                out[rec["session_id"]][int(rec["policy_version"])] = int(rec["tokens"] or 0)
        return out

    def trajectories(self, step: int, rows: list[dict[str, Any]]) -> tuple[Optional[str], dict[str, Any]]:
        import polars as pl

        from . import phases

        data = phases.StepData(step, pl.DataFrame(rows))
        with self.tl.phase(f"trajectories {step}", "prefix merge, drift causes, rewards") as ph:
            phases.build_trajectories(self.out, data, self.model_dir)
            ph.detail = phases.trajectories_detail(data.stats)
        stats = {**data.stats, "drift": data.drift, "drift_origin": data.drift_origin,
                 "file": str(data.trajectories) if data.trajectories else None}
        return (str(data.trajectories) if data.stats.get("sampled_tokens") else None), stats

    def _start_trainer(self) -> Any:
        from polar_training.session import TrainerProcess

        from . import phases

        lora = None
        rank = self.cfg.trainer.lora_rank
        if rank:
            from polar_training.lora import LoraSettings

            lora = LoraSettings(rank=rank, alpha=2.0 * rank)
        t = TrainerProcess(self.model_dir, self.out / "train", phases.train_config(self.cfg), resume=self.checkpoint,
                           lora=lora)
        t.start()
        self.children.add("trainer", t.pid, group=False)
        return t

    def train(self, step: int, trajectories: str) -> TrainOutcome:
        from . import phases

        cfg = self.cfg
        gpu, when = cfg.on_gpu, cfg.trainer.server_during_train
        held = int(self.trainer.rss_gib * 2**30) if self.trainer is not None else 0
        need = 0 if gpu else max(phases.train_memory_estimate(self.model_dir, lora=cfg.trainer.lora_rank > 0) - held, 0)
        self.server_stopped = cfg.schedule.max_off_policy_steps == 0 and (when == "stop" or (
            when == "auto" and not gpu and phases.mem_available() < need))  # async: rollouts go on
        if self.server_stopped:
            self.log(f"vLLM stopped while training (needs ~{need / 2**30:.1f} GiB)")
            self.server.stop()
        self.trained_step = step  # the push that follows is named after it (`push 0` follows `train 0`)
        with self.tl.phase(f"train {step}", "GRPO iteration, full checkpoint (resume needs it)") as ph:
            if self.trainer is None:
                self.trainer = self._start_trainer()
            res = self.trainer.call({"cmd": "step", "trajectories": [trajectories], "checkpoint": True, "handoff": False})
            ph.detail = f"step {res['step']}, peak RSS {float(res.get('peak_rss_gib') or 0):.1f} GiB"
        last = step >= cfg.rollout.iterations - 1 and cfg.schedule.max_off_policy_steps == 0
        if self.server_stopped or last:
            # memory back before vLLM starts again; after the last update (the final rollout trains
            # nothing) the ~7 GiB the 0.5B's weights and AdamW moments hold go back too: its full
            # checkpoint is on disk already
            self.trainer.stop(60.0)
            self.trainer = None
        peak, timings = float(res.get("peak_rss_gib") or 0.0), res.get("timings") or {}
        if not res.get("updated"):
            if self.server_stopped:
                self.server.restart(model_dir=self.checkpoint or self.serve_dir)
            return TrainOutcome(False, int(res["step"]), note="the trainer made no update", peak_rss_gib=peak,
                                timings=timings)
        self.checkpoint = res.get("checkpoint")
        return TrainOutcome(True, int(res["step"]), checkpoint=self.checkpoint, metrics=res.get("metrics") or {},
                            peak_rss_gib=peak, timings=timings)

    def push(self, checkpoint: str, policy_version: int) -> dict[str, Any]:
        from dataclasses import asdict

        from polar_training.weights_push import push_weights

        from . import phases

        stopped = getattr(self, "server_stopped", False)
        target: Any = phases.Stopped(self.server) if stopped else self.server
        with self.tl.phase(f"push {getattr(self, 'trained_step', policy_version - 1)}", "restart vLLM on the new weights (proxy holds calls)" if stopped
                           else "new weights into the running vLLM in place (proxy holds calls)") as ph:
            # push_weights takes every replica and every proxy in front of them; here, one of each
            res = push_weights(checkpoint, [target], [self.proxy.url], policy_version)
            ph.detail = f"policy v{res.policy_version} via {res.method} in {res.reload_s:.1f} s"
        if stopped:  # the in-place attempt on a stopped server is expected to fail: not news
            res.notes = [n for n in res.notes if not n.startswith("in-place reload failed")]
        self.children.add("vllm", getattr(self.server.proc, "pid", None), group=True)  # a restart is a new pid
        return asdict(res)

    def evaluate(self, step: int, policy_version: int) -> Optional[dict[str, Any]]:
        from . import phases

        if not self.cfg.eval.every:
            return None
        return phases.run_eval(self.cfg, self.out, self.tl, self.eval_tasks, self.endpoint, self.proxy.control,
                             self.stop_event, self.served, step, policy_version)

    def close(self) -> None:
        self.stop_event.set()
        if self.trainer is not None:
            self.trainer.close(checkpoint=False)
            self.trainer = None
        self.stack.close()
        with contextlib.suppress(OSError):
            self.children.path.unlink()
