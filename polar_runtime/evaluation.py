"""``polar eval``: pass@1 and pass@k, with standard errors, of a harness and a model on tasks.

It is a rollout (the same runner, proxy and vLLM as ``polar rollout``: the same captures, the same
resume) followed by scoring; the statistics live in ``polar_analysis.passk`` (the unbiased
estimator, jackknife standard errors per task, two standard errors over tasks: its docstring).

**What a sample counts as.** A sample *passes* when its evaluator's reward is at least
``--pass-threshold`` (default 1.0: full credit; the built-in ``fizzbuzz`` and ``mathx`` give
partial credit, and 14 of 15 lines right is not a pass). It *fails* when the harness ended on its
own (status ``ok``) and the reward is below the threshold. Every other sample is an
**infrastructure failure**, counted apart by cause:

* ``timeout``: the harness was killed at the time limit (on a loaded 2-core machine, runs took
  50-300 s instead of ~60 s: docs/tasks.md);
* ``crashed``: the harness exited non-zero, or could not start, or the proxy was unreachable;
* ``no_verdict``: the harness ended but the evaluator could not judge (timed out, not found).

They are left out of the estimator's ``n`` (``--infra exclude``, the default: a slow or crashing
machine says nothing about the model) or counted as failures (``--infra fail``: never higher than
the truth, since a model that loops until the time limit is then charged for it). Both readings go
into ``eval.json`` (``overall`` under the chosen one, ``overall_infra_as_fail`` always), so a run
with many infrastructure failures shows the gap. A timed-out run whose work dir already passed is
still an infrastructure failure (counting it as a pass but the unsolved ones as unknown would bias
the figure upward); ``timeout_but_passed`` counts them.

Writes ``<out>/eval.json`` (settings, per task, overall) and ``<out>/eval.parquet`` (one row per
task) beside the rollout's ``rollouts.parquet`` and captures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import polars as pl
import typer
from rich.console import Console
from rich.table import Table

from polar_analysis import passk
from polar_core.console import make_console

RESULT_FILE = "eval.json"
TASKS_FILE = "eval.parquet"
SETTINGS_FILE = "eval-settings.json"
INFRA_CAUSES = ("timeout", "crashed", "no_verdict")
INFRA_POLICIES = ("exclude", "fail")
#: Prefix of the task ids of an evaluation inside ``polar demo``: its sessions share the demo's proxy
#: and capture directory with the training rollout, and must never share a session or group id.
DEMO_PREFIX = "eval-"

# Tables: when the output is not a terminal (CI logs, `| tee`) rich would assume 80 columns.
console = make_console()  # whole rows off a terminal (polar_core/console.py)


def outcome(row: dict[str, Any], threshold: float = 1.0) -> tuple[bool | None, str]:
    """(True/False/None, cause) of one rollouts row: pass, fail, or an infrastructure failure."""
    status = row.get("status")
    if status == "timeout":
        return None, "timeout"
    if status != "ok":
        return None, "crashed"
    if row.get("reward") is None:
        return None, "no_verdict"
    return (True, "pass") if row["reward"] >= threshold else (False, "fail")


def score_rows(rows: list[dict[str, Any]], *, ks: list[int] | None = None, threshold: float = 1.0,
               infra: str = "exclude", strip_prefix: str = "") -> dict[str, Any]:
    """The evaluation of rollouts rows (``rollout.ROLLOUT_SCHEMA`` dicts): per task, overall, causes."""
    if infra not in INFRA_POLICIES:
        raise ValueError(f"infra must be one of {', '.join(INFRA_POLICIES)}, not {infra!r}")
    by_task: dict[str, list[bool | None]] = {}
    rewards: dict[str, list[float]] = {}
    causes = dict.fromkeys(INFRA_CAUSES, 0)
    per_task_causes: dict[str, dict[str, int]] = {}
    timeout_but_passed = 0
    for row in rows:
        tid = str(row["task_id"]).removeprefix(strip_prefix)
        ok, cause = outcome(row, threshold)
        by_task.setdefault(tid, []).append(ok)
        per_task_causes.setdefault(tid, dict.fromkeys(INFRA_CAUSES, 0))
        if ok is None:
            causes[cause] += 1
            per_task_causes[tid][cause] += 1
            timeout_but_passed += cause == "timeout" and (row.get("reward") or 0) >= threshold
        if row.get("reward") is not None:
            rewards.setdefault(tid, []).append(float(row["reward"]))
    if not by_task:
        raise ValueError("no samples to score")
    most = max(len(v) for v in by_task.values())
    ks = sorted(set(ks or passk.default_ks(most)))
    result = passk.summarize(by_task, ks, infra_as_fail=infra == "fail")
    for t in result["tasks"]:
        r = rewards.get(t["task_id"], [])
        t["mean_reward"] = sum(r) / len(r) if r else None
        t["infra"] = per_task_causes[t["task_id"]]
    return {
        "ks": result["ks"], "pass_threshold": threshold, "infra_policy": infra,
        "samples": sum(len(v) for v in by_task.values()),
        "infra_failures": {**causes, "total": sum(causes.values()), "timeout_but_passed": int(timeout_but_passed)},
        "overall": result["overall"],
        "overall_infra_as_fail": passk.summarize(by_task, ks, infra_as_fail=True)["overall"],
        "tasks": result["tasks"],
    }


def task_frame(result: dict[str, Any]) -> pl.DataFrame:
    """One row per task: counts, mean reward, pass@k and its standard error per k (flat columns)."""
    rows = []
    for t in result["tasks"]:
        row = {k: t[k] for k in ("task_id", "samples", "graded", "passed", "infra_failures", "mean_reward")}
        for k in result["ks"]:
            row[f"pass@{k}"] = t["pass_at"][str(k)]
            row[f"stderr@{k}"] = t["stderr"][str(k)]
        rows.append(row)
    schema = {"task_id": pl.String, "samples": pl.Int64, "graded": pl.Int64, "passed": pl.Int64,
              "infra_failures": pl.Int64, "mean_reward": pl.Float64,
              **{f"{p}@{k}": pl.Float64 for k in result["ks"] for p in ("pass", "stderr")}}
    return pl.DataFrame(rows, schema=schema)


def write_result(out: Path, result: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
    task_frame(result).write_parquet(out / TASKS_FILE)
    return out / RESULT_FILE


def _pm(value: float | None, se: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def print_result(result: dict[str, Any], out: Console = console, title: str = "evaluation") -> None:
    """The per-task table (pass@k ± its jackknife standard error) and the mean over tasks."""
    ks = result["ks"]
    t = Table(title=f"{title}: pass@k ± standard error (pass = reward >= {result['pass_threshold']:g}; "
                    f"infrastructure failures {'left out of n' if result['infra_policy'] == 'exclude' else 'counted as failures'})",
              title_justify="left")
    for c in ("task", "samples", "graded", "passed", "infra", "mean reward", *[f"pass@{k}" for k in ks]):
        t.add_column(c, justify="left" if c == "task" else "right")
    for task in result["tasks"]:
        reward = "-" if task["mean_reward"] is None else f"{task['mean_reward']:.3f}"
        t.add_row(task["task_id"], str(task["samples"]), str(task["graded"]), str(task["passed"]),
                  str(task["infra_failures"]), reward,
                  *[_pm(task["pass_at"][str(k)], task["stderr"][str(k)]) for k in ks])
    ov = result["overall"]
    t.add_row("[bold]mean over tasks", str(result["samples"]), "", "", str(result["infra_failures"]["total"]), "",
              *[_pm(ov[str(k)]["value"], ov[str(k)]["stderr"]) + (f" ({ov[str(k)]['tasks']} tasks)"
                if ov[str(k)]["tasks"] != len(result["tasks"]) else "") for k in ks], style="bold")
    out.print(t)
    inf = result["infra_failures"]
    k1 = str(ks[0])
    out.print(f"standard error over tasks (another draw of tasks): pass@{k1} "
              f"{_pm(ov[k1]['value'], ov[k1]['stderr_tasks'])}", soft_wrap=True)
    if inf["total"]:
        low = result["overall_infra_as_fail"][k1]
        out.print(f"[yellow]infrastructure failures: {inf['total']} (timeout {inf['timeout']}, crashed {inf['crashed']}, "
                  f"no verdict {inf['no_verdict']}; {inf['timeout_but_passed']} timed-out runs had passed); "
                  f"counted as failures, pass@{k1} would be {_pm(low['value'], low['stderr'])}[/yellow]", soft_wrap=True)


def headline(result: dict[str, Any]) -> str:
    """One line: pass@1 and pass@k (largest k) ± standard error, and the infrastructure failures."""
    ks, ov = result["ks"], result["overall"]
    parts = [f"pass@{k} {_pm(ov[str(k)]['value'], ov[str(k)]['stderr'])}" for k in dict.fromkeys((ks[0], ks[-1]))]
    return ", ".join(parts) + f", {result['samples']} samples, {result['infra_failures']['total']} infrastructure failures"


def print_evaluations(evals: list[dict[str, Any]], out: Console = console) -> None:
    """The demo report's evaluation table: one row per evaluated step (policy version)."""
    t = Table(title="evaluation (pass@k ± standard error, mean over tasks; infrastructure failures left out of n)",
              title_justify="left")
    for c in ("step", "policy", "samples", "infra", "pass@1", "pass@k", "per task pass@1"):
        t.add_column(c, justify="left" if c == "per task pass@1" else "right")
    for e in evals:
        ks, ov = e["ks"], e["overall"]
        kmax = str(ks[-1])
        per = ", ".join(f"{x['task_id']} {_pm(x['pass_at'][str(ks[0])], None)}" for x in e["tasks"])
        t.add_row(str(e["step"]), f"v{e['policy_version']}", str(e["samples"]), str(e["infra_failures"]["total"]),
                  _pm(ov[str(ks[0])]["value"], ov[str(ks[0])]["stderr"]),
                  f"k={kmax}: {_pm(ov[kmax]['value'], ov[kmax]['stderr'])}", per)
    out.print(t)


# ---------------------------------------------------------------------------------------------
# polar eval


def _check_settings(out: Path, settings: dict[str, Any]) -> None:
    """A re-run resumes (finished samples are reused) only under the same settings: samples drawn at
    another temperature or from another model must not be mixed into one figure."""
    path = out / SETTINGS_FILE
    if path.exists():
        before = json.loads(path.read_text())
        diff = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if diff:
            raise typer.BadParameter(f"{out} holds an evaluation with other settings {diff} (was, now): "
                                     "use another --out, or delete it")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2))


def _capped(task: Any, timeout: float) -> Any:
    import copy

    task = copy.copy(task)
    task.timeout = min(task.timeout or timeout, timeout)
    return task


def _parse_ks(spec: str | None) -> list[int] | None:
    if not spec:
        return None
    try:
        ks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--k takes integers separated by commas, not {spec!r}") from None
    if not ks or min(ks) < 1:
        raise typer.BadParameter("--k values must be >= 1")
    return ks


def eval_command(
    tasks: Annotated[str, typer.Option(help="Tasks as `polar rollout --tasks` takes them, e.g. the built-in set coding.")] = "coding",
    harness: Annotated[str, typer.Option(help="Preset (see `polar harness list`) or 'generic'.")] = "pi-chat",
    samples: Annotated[int, typer.Option(help="Samples per task (the n of pass@k).")] = 4,
    greedy: Annotated[bool, typer.Option(help="Greedy decoding (temperature 0) instead of the rollout's sampling.")] = False,
    temperature: Annotated[float, typer.Option(help="Plain sampling at this temperature, enforced on every call.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Base of the per-call sampling seeds (-1: unseeded).")] = 0,
    k: Annotated[Optional[str], typer.Option("--k", help="k values, e.g. 1,2,4 (default 1, 2, 4, ... and N).")] = None,
    pass_threshold: Annotated[float, typer.Option(help="A sample passes when its reward is at least this.")] = 1.0,
    infra: Annotated[str, typer.Option(help="Infrastructure failures (timeouts, crashes, no verdict): exclude "
                                       "(left out of n) or fail (counted as failures).")] = "exclude",
    rollouts: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="Score this rollouts.parquet "
                        "(e.g. runs/demo/captures/rollouts.parquet) instead of running anything.")] = None,
    step: Annotated[Optional[int], typer.Option(help="With --rollouts: only this rollout step.")] = None,
    out: Annotated[Optional[Path], typer.Option(resolve_path=True, help="Run directory (default runs/eval-<harness>; "
                   "with --rollouts, its folder).")] = None,
    concurrency: Annotated[int, typer.Option(help="Harness runs at once.")] = 1,
    timeout: Annotated[Optional[float], typer.Option(help="Hard timeout per harness run, seconds: the same limit for "
                       "every task (a task's own, e.g. task.toml's agent timeout_sec, is lowered to it). Default: "
                       "each task's own, else 600.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Cap max_tokens of every call (0: no cap).")] = 0,
    limit: Annotated[int, typer.Option(help="Only the first N tasks (0: all).")] = 0,
    upstream: Annotated[Optional[str], typer.Option(help="Use a running inference server (else vLLM is started).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model to serve when starting vLLM (Polar name or HF dir).")] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Model name the harness asks for.")] = None,
    command: Annotated[Optional[str], typer.Option("--command", help="Generic harness: a shell command template.")] = None,
    exact_history: Annotated[bool, typer.Option(help="Proxy option polar_exact_history.")] = True,
) -> None:
    """Run a harness N times per task through the proxy and report pass@1 and pass@k ± standard errors.

    Writes <out>/eval.json and <out>/eval.parquet next to the rollout (re-running resumes).
    """
    from polar_core.processes import interruptible, stop_all_children
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r

    ks = _parse_ks(k)
    if infra not in INFRA_POLICIES:
        raise typer.BadParameter(f"--infra must be one of {', '.join(INFRA_POLICIES)}")
    if rollouts is not None:  # score what exists, run nothing
        df = pl.read_parquet(rollouts)
        steps = sorted(set(df["step"].to_list()))
        if step is not None:
            df = df.filter(pl.col("step") == step)
        elif len(steps) > 1:
            raise typer.BadParameter(f"{rollouts} holds rollout steps {steps} (different policies): pick one with --step")
        if not df.height:
            raise typer.BadParameter(f"no samples in {rollouts}" + (f" at step {step}" if step is not None else ""))
        result = score_rows(df.to_dicts(), ks=ks, threshold=pass_threshold, infra=infra)
        result.update(rollouts=str(rollouts), step=step if step is not None else steps[0])
        print_result(result)
        console.print(f"wrote {write_result(out or rollouts.parent, result)}")
        return
    if samples < 1:
        raise typer.BadParameter("--samples must be >= 1")
    if ks and max(ks) > samples:
        raise typer.BadParameter(f"k = {max(ks)} needs at least that many samples (--samples {samples})")
    try:
        preset = h.get_preset(harness, command or "")
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0])) from None
    if not preset.installed():
        console.print(f"[red]{harness} is not installed: run `polar harness install {preset.package}`[/red]")
        raise typer.Exit(1)
    try:
        task_list = r.load_tasks(tasks)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    task_list = task_list[:limit] if limit else task_list
    if timeout is not None:  # one limit for all: an evaluation compares tasks under the same budget
        task_list = [_capped(t, timeout) for t in task_list]
    out = h.paths.absolute(out or Path("runs") / f"eval-{preset.name}")
    seed = None if seed is None or seed < 0 else seed
    temp = 0.0 if greedy else temperature
    sampling = r.sampling_spec(temp, seed)
    tasks_file = str(Path(tasks).resolve()) if Path(tasks).exists() else tasks  # a path, or a built-in set's name
    _check_settings(out, {"tasks": tasks_file, "harness": preset.name,
                          "model": model or upstream or "qwen2.5-coder-0.5b-instruct", "sampling": sampling,
                          "max_tokens": max_tokens, "timeout": timeout, "command": command})
    t0 = time.monotonic()
    try:
        with interruptible(), r.open_stack(mode="base_url", capture_dir=out, upstream=upstream, model=model,
                                           max_tokens_cap=max_tokens, sampling=sampling, exact_history=exact_history,
                                           log=console.print) as stack:
            cfg = r.RolloutConfig(tasks=task_list, preset=preset, endpoint=stack.endpoint, capture_dir=stack.capture_dir,
                                  model=model_name or stack.served_model, samples=samples, concurrency=concurrency,
                                  timeout=timeout or 600.0)
            console.print(f"evaluating {preset.name} with {cfg.model}: {len(task_list)} tasks x {samples} samples, "
                          f"{'greedy' if greedy else f'temperature {temp:g}'}, run dir {out}")

            def on_result(row: dict[str, Any]) -> None:
                reward = "-" if row["reward"] is None else f"{row['reward']:.2f}"
                console.print(f"  {row['session_id']:<28} {row['status']:<7} reward {reward:>4}  "
                              f"calls {row['calls']:>2}  {row['wall_s']:.0f} s")

            df = r.run_rollout(cfg, control=stack.control, on_result=on_result)
    except KeyboardInterrupt:
        stop_all_children()
        console.print("[yellow]interrupted: finished samples are kept (the same command resumes)[/yellow]")
        raise typer.Exit(130) from None
    wanted = {t.id for t in task_list}
    rows = [row for row in df.filter(pl.col("step") == 0).to_dicts() if row["task_id"] in wanted]
    result = score_rows(rows, ks=ks, threshold=pass_threshold, infra=infra)
    result.update(harness=preset.name, model=cfg.model, tasks_file=tasks_file,
                  greedy=greedy, temperature=temp, seed=seed, max_tokens=max_tokens, timeout=timeout,
                  rollouts=str(out / r.ROLLOUTS_FILE), wall_s=round(time.monotonic() - t0, 1))
    print_result(result)
    console.print(f"wrote {write_result(out, result)} and {out / TASKS_FILE}")
    problem = r.failure_summary(rows, preset.name)
    if problem and not any(t["graded"] for t in result["tasks"]):
        console.print(f"[red]no sample could be graded: {problem}[/red]")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_command)


# ---------------------------------------------------------------------------------------------
# inside polar demo


def demo_tasks(tasks: list[Any]) -> list[Any]:
    """Copies of the demo's tasks under ``eval-<id>``: evaluation sessions go through the demo's proxy
    into its capture directory, and must not take the training rollout's session or group ids."""
    import copy

    renamed = []
    for t in tasks:
        t = copy.copy(t)
        t.id = DEMO_PREFIX + t.id
        renamed.append(t)
    return renamed


def demo_capture_dir(out: Path, captures: Path) -> Path:
    """Where the demo's evaluation keeps its results: ``<out>/eval``, apart from the training rollout's
    rollouts.parquet (whose per-step rewards the notebooks plot), with ``sessions`` linked to the
    proxy's capture sessions, where the runner counts each sample's calls."""
    d = out / "eval"
    d.mkdir(parents=True, exist_ok=True)
    link = d / "sessions"
    if not link.exists():
        (captures / "sessions").mkdir(parents=True, exist_ok=True)
        link.symlink_to(captures / "sessions", target_is_directory=True)
    return d
