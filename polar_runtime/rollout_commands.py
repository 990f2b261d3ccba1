"""CLI: ``polar rollout`` and ``polar harness install|list|run``.

The commands are thin: presets live in polar_runtime/harnesses.py, the runner in rollout.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import polars as pl
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from polar_core.console import make_console
from polar_core.processes import interruptible, stop_all_children
from polar_runtime import harnesses as h
from polar_runtime import rollout as r

harness_app = typer.Typer(no_args_is_help=True, help="Agent harness CLIs: install (npm, pinned), list, run once.")
console = make_console()

Mode = Annotated[str, typer.Option(help="base_url (reverse proxy) or proxy (HTTPS_PROXY + CA only).")]
ProxyOpt = Annotated[Optional[str], typer.Option("--proxy", help="Use a running Polar proxy at this URL.")]
UpstreamOpt = Annotated[Optional[str], typer.Option(help="Use a running inference server (else vLLM is started).")]
ModelOpt = Annotated[Optional[str], typer.Option(help="Model to serve when starting vLLM (Polar name or HF dir).")]
ModelNameOpt = Annotated[Optional[str], typer.Option(help="Model name the harness asks for (default: the served name).")]
CommandOpt = Annotated[Optional[str], typer.Option("--command", help="Generic harness: a shell command template.")]
MaxTokensOpt = Annotated[int, typer.Option(help="Cap max_tokens of every call (proxy option; 0: no cap).")]
CaCertOpt = Annotated[Optional[Path], typer.Option(resolve_path=True, help="CA of a running --proxy (default $POLAR_HOME/mitmproxy).")]
SandboxOpt = Annotated[str, typer.Option(help="Sandbox of every phase: auto (the first usable of bubblewrap, docker, podman, "
                                              "apptainer), one of those, or host (NO isolation: the harness runs as you, on the host).")]
TasksHelp = ("A Harbor task directory, a dataset (a directory of them), a JSONL file of the shorthand, "
             "or a built-in set (coding, followups).")


def _check_mode(mode: str) -> str:
    if mode not in h.MODES:
        raise typer.BadParameter(f"--mode must be one of {', '.join(h.MODES)}")
    return mode


def _preset(name: str, command: str | None) -> h.Preset:
    try:
        preset = h.get_preset(name, command or "")
    except KeyError as exc:
        raise typer.BadParameter(str(exc.args[0])) from None
    if not preset.installed():
        console.print(f"[red]{name} is not installed: run `polar harness install {preset.package}`[/red]")
        raise typer.Exit(1)
    return preset


# ---------------------------------------------------------------------------------------------
# polar harness ...


@harness_app.command("list")
def harness_list() -> None:
    """The presets, their pinned packages, wire formats and whether they are installed."""
    table = Table(title=f"harness presets (installed under {h.paths.harnesses_dir()})")
    for col in ("preset", "package", "wire API", "installed"):
        table.add_column(col)
    for name, p in h.presets().items():
        pkg = h.PACKAGES[p.package]  # type: ignore[index]
        table.add_row(name, pkg.spec, p.wire, "yes" if pkg.installed() else "[red]no[/red]")
    table.add_row("generic", "--command 'my-agent {task}'", "any", "-")
    for name, cls in h.NO_MODEL_PRESETS.items():
        table.add_row(name, f"({cls.description})", "none", "-")
    console.print(table)
    console.print("trimming (on by default, --no-trim to turn off):")
    for name, p in h.presets().items():
        if p.trim_flags:
            console.print(f"  {name}: {p.trim_flags}")
    console.print("follow-up turns (a task's followups, --followup) continue the conversation with:")
    for name, p in h.presets().items():
        console.print(f"  {name}: {p.resume_flags}")
    console.print("  generic: POLAR_RESUME=1 in its environment")


@harness_app.command("install")
def harness_install(
    names: Annotated[Optional[list[str]], typer.Argument(help="Packages or presets (codex, pi, pi-chat, ...).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Install every harness.")] = False,
    force: Annotated[bool, typer.Option(help="Reinstall even when present.")] = False,
) -> None:
    """npm install the pinned CLIs into $POLAR_HOME/harnesses/<name> (idempotent, fast when present)."""
    if all_:
        wanted = list(h.PACKAGES)
    elif names:
        wanted = []
        for n in names:
            n = h.ALIASES.get(n, n)
            pkg = n if n in h.PACKAGES else getattr(h.presets().get(n), "package", None)
            if pkg is None:
                raise typer.BadParameter(f"unknown harness {n!r}; known: {', '.join(h.PACKAGES)}")
            if pkg not in wanted:
                wanted.append(pkg)
    else:
        raise typer.BadParameter("name harnesses to install, or pass --all")
    failed = []
    for name in wanted:
        pkg = h.PACKAGES[name]
        present = pkg.installed() and not force
        try:
            h.install(name, force=force, log=console.print)
            if present:
                console.print(f"{pkg.spec}: present")
        except (RuntimeError, OSError) as exc:
            console.print(f"[red]{exc}[/red]")
            failed.append(name)
    if failed:
        raise typer.Exit(1)


@harness_app.command("run")
def harness_run(
    name: Annotated[str, typer.Argument(help="Preset (see `polar harness list`) or 'generic'.")],
    task: Annotated[Optional[str], typer.Option(help="The instruction given to the harness (an ad-hoc task).")] = None,
    tasks: Annotated[Optional[str], typer.Option(help=TasksHelp + " Runs its first task (or --task-id).")] = None,
    task_id: Annotated[Optional[str], typer.Option(help="With --tasks: the task to run.")] = None,
    followup: Annotated[Optional[list[str]], typer.Option(
        help="A later user turn (repeatable): the harness is started again on it, continuing its conversation.")] = None,
    mode: Mode = "base_url",
    proxy: ProxyOpt = None,
    upstream: UpstreamOpt = None,
    model: ModelOpt = None,
    model_name: ModelNameOpt = None,
    capture_dir: Annotated[Path, typer.Option(resolve_path=True, help="Capture directory.")] = Path("runs/adhoc"),
    evaluator: Annotated[Optional[str], typer.Option(help="Shell command judged in the work dir.")] = None,
    timeout: Annotated[float, typer.Option(help="Hard timeout of the harness, seconds.")] = 600.0,
    command: CommandOpt = None,
    trim: Annotated[bool, typer.Option(help="Trim tools/system prompt through the harness's own flags.")] = True,
    max_tokens: MaxTokensOpt = 0,
    ca_cert: CaCertOpt = None,
    sandbox: SandboxOpt = "auto",
) -> None:
    """Run one harness once on a task (ad hoc, or one of --tasks) through the proxy and show what was captured."""
    _check_mode(mode)
    preset = _preset(name, command)
    if (task is None) == (tasks is None):
        raise typer.BadParameter("give either --task TEXT or --tasks PATH")
    if tasks is not None:
        try:
            found = r.load_tasks(tasks)
        except (ValueError, FileNotFoundError) as exc:
            raise typer.BadParameter(str(exc)) from None
        chosen = [x for x in found if x.id == task_id] if task_id else found[:1]
        if not chosen:
            raise typer.BadParameter(f"no task {task_id!r} in {tasks}")
        t = chosen[0]
        t.followups = [*t.followups, *(followup or [])]
    else:
        t = r.Task(id=f"adhoc-{time.strftime('%Y%m%d-%H%M%S')}", instruction=task or "", evaluator=evaluator,
                   followups=list(followup or []))
    with r.open_stack(mode=mode, capture_dir=None if proxy or not preset.needs_model else capture_dir, proxy=proxy,
                      upstream=upstream, model=model, max_tokens_cap=max_tokens, ca_cert=ca_cert,
                      log=console.print) if preset.needs_model else _no_model_stack(capture_dir) as stack:
        cfg = r.RolloutConfig(tasks=[t], preset=preset, endpoint=stack.endpoint, capture_dir=stack.capture_dir,
                              model=model_name or stack.served_model, samples=1, timeout=timeout, trim=trim,
                              sandbox=sandbox)
        console.print(f"running {preset.name} ({mode}) as session {r.session_id_for(t.id, 0, 0)} ...")
        df = r.run_rollout(cfg, control=stack.control)
    row = df.row(0, named=True)
    _print_rows(df)
    logs = Path(row["workdir"]).parent / "logs"
    console.print(f"work dir: {row['workdir']}\nlogs:     {logs}\ncaptures: {stack.capture_dir}/sessions/{row['session_id']}.jsonl")
    if row["status"] != "ok":
        console.print(f"[red]{r.failure_summary([row], preset.name) or row['error']}[/red]")
        raise typer.Exit(1)


def _no_model_stack(capture_dir: Path) -> Any:
    """The oracle and nop need no model server: no vLLM, no proxy."""
    import contextlib

    ep = h.Endpoint(mode="base_url", base_url="http://127.0.0.1:9")
    return contextlib.nullcontext(r.Stack(ep, h.paths.absolute(capture_dir), "-", ""))


def register(app: typer.Typer) -> None:
    from polar_runtime import task_commands

    app.add_typer(harness_app, name="harness")
    app.command("rollout")(rollout_command)
    task_commands.register(app)  # tasks check|list|convert


# ---------------------------------------------------------------------------------------------
# polar rollout


def rollout_command(
    tasks: Annotated[str, typer.Option(help=TasksHelp)] = "coding",
    harness: Annotated[str, typer.Option(help="Preset (see `polar harness list`) or 'generic'.")] = "pi-chat",
    samples: Annotated[int, typer.Option(help="Samples per task (one GRPO group).")] = 4,
    concurrency: Annotated[int, typer.Option(help="Harness runs at once.")] = 1,
    timeout: Annotated[float, typer.Option(help="Hard timeout per harness run, seconds (partial trace kept).")] = 600.0,
    eval_timeout: Annotated[float, typer.Option(help="Timeout of each evaluator run, seconds.")] = 120.0,
    mode: Mode = "base_url",
    proxy: ProxyOpt = None,
    upstream: UpstreamOpt = None,
    model: ModelOpt = None,
    model_name: ModelNameOpt = None,
    capture_dir: Annotated[Optional[Path], typer.Option(resolve_path=True, help="Captures + rollouts.parquet (default runs/rollout-<harness>).")] = None,
    shard: Annotated[Optional[str], typer.Option(help="I/N: run only shard I of N of the tasks (one per machine).")] = None,
    step: Annotated[int, typer.Option(help="Rollout step (part of session and group ids).")] = 0,
    limit: Annotated[int, typer.Option(help="Only the first N tasks (0: all).")] = 0,
    rerun: Annotated[Optional[str], typer.Option(help="Run finished samples with these statuses again, e.g. failed,timeout.")] = None,
    command: CommandOpt = None,
    trim: Annotated[bool, typer.Option(help="Trim tools/system prompt through the harness's own flags.")] = True,
    max_tokens: MaxTokensOpt = 0,
    temperature: Annotated[float, typer.Option(help="Sampling temperature enforced on every call (plain sampling: "
                                               "no top-p/top-k/penalties), the one the trainer uses.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option(help="Base of the per-call sampling seeds (reproducible reruns).")] = None,
    harness_sampling: Annotated[bool, typer.Option(
        help="Let the harness (or vLLM's generation config) choose the sampling instead of --temperature.")] = False,
    ca_cert: CaCertOpt = None,
    exact_history: Annotated[bool, typer.Option(
        help="Proxy option polar_exact_history: prompt the model with its own sampled ids for every answer "
             "the harness re-sends (needs vLLM with --enable-scale-out; otherwise the normal path).")] = True,
    sandbox: SandboxOpt = "auto",
    allow_internet: Annotated[bool, typer.Option(
        help="Tasks with allow_internet = true reach public hosts in the agent phase (through the egress "
             "proxy: public addresses only). Off: the agent reaches the model and nothing else.")] = False,
    agent_privileges: Annotated[bool, typer.Option(
        help="docker/podman: the agent holds the package manager's capabilities and reaches the package "
             "registries, as Harbor's agents do (--no-agent-privileges: neither).")] = True,
    separate_verifier: Annotated[bool, typer.Option(
        help="docker/podman: every task's verifier in a fresh environment of its own, as \\[verifier] "
             "environment_mode = \"separate\" asks (nothing the agent did outside its artifacts reaches it).")] = False,
) -> None:
    """Run a harness N times per task through the proxy; evaluate; write <capture_dir>/rollouts.parquet.

    Re-running resumes (finished samples are skipped). Several machines can share one capture
    directory, each with its own proxy and --shard I/N.
    """
    _check_mode(mode)
    preset = _preset(harness, command)
    try:
        task_list = r.load_tasks(tasks, container=sandbox if sandbox in ("docker", "podman") else False)
        index, count = r.parse_shard(shard)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    task_list = r.shard_tasks(task_list, index, count) if count > 1 else task_list
    if limit:
        task_list = task_list[:limit]
    if not task_list:
        console.print("no tasks in this shard")
        return
    capture_dir = h.paths.absolute(capture_dir or Path("runs") / f"rollout-{preset.name}")
    t0 = time.monotonic()
    sampling = None if harness_sampling else r.sampling_spec(temperature, seed)
    try:
        with interruptible():
            with r.open_stack(mode=mode, capture_dir=None if proxy else capture_dir, proxy=proxy, upstream=upstream,
                              model=model, max_tokens_cap=max_tokens, ca_cert=ca_cert, sampling=sampling,
                              exact_history=exact_history, log=console.print) \
                    if preset.needs_model else _no_model_stack(capture_dir) as stack:
                cfg = r.RolloutConfig(
                    tasks=task_list, preset=preset, endpoint=stack.endpoint, capture_dir=stack.capture_dir,
                    model=model_name or stack.served_model, samples=samples, concurrency=concurrency, timeout=timeout,
                    eval_timeout=eval_timeout, step=step, trim=trim, rerun=_statuses(rerun), sandbox=sandbox,
                    allow_internet=allow_internet, agent_privileged=agent_privileges,
                    separate_verifier=separate_verifier,
                )
                console.print(f"{len(task_list)} tasks x {samples} samples, harness {preset.name} ({mode}), "
                              f"model {cfg.model}, captures in {stack.capture_dir}"
                              + (f", shard {index}/{count}" if count > 1 else ""))
                with Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              TextColumn("{task.description}"), console=console) as progress:
                    bar = progress.add_task("", total=None)

                    def on_start(todo: int, done: int) -> None:
                        progress.update(bar, total=todo)
                        if done:
                            progress.console.print(f"resuming: {done} samples already finished")

                    def on_result(row: dict[str, Any]) -> None:
                        progress.advance(bar)
                        reward = "-" if row["reward"] is None else f"{row['reward']:.2f}"
                        progress.update(bar, description=f"{row['session_id']} {row['status']} reward {reward}")

                    df = r.run_rollout(cfg, control=stack.control, on_start=on_start, on_result=on_result)
    except KeyboardInterrupt:
        # SIGINT or SIGTERM: the context managers stopped vLLM and the proxy, run_rollout the
        # harnesses; anything started half-way is caught here. Finished samples stay recorded.
        stop_all_children()
        console.print("[yellow]interrupted: everything the rollout started was stopped; finished samples are "
                      "kept (the same command resumes)[/yellow]")
        raise typer.Exit(130) from None
    _print_rows(df.filter(pl.col("step") == step))
    summary = r.summarize(df.filter(pl.col("step") == step))
    table = Table(title="per task")
    for col in summary.columns:
        table.add_column(col)
    for row in summary.iter_rows():
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row])
    console.print(table)
    console.print(f"wrote {stack.capture_dir / r.ROLLOUTS_FILE} ({df.height} rows) in {time.monotonic() - t0:.0f} s")
    problem = r.failure_summary(df.filter(pl.col("step") == step).to_dicts(), preset.name) if preset.needs_model else None
    if problem:
        console.print(f"[red]rollout produced nothing to learn from: {problem}[/red]")
        raise typer.Exit(1)


def _statuses(spec: str | None) -> frozenset[str]:
    wanted = frozenset(s.strip() for s in (spec or "").split(",") if s.strip())
    if wanted - set(r.STATUSES):
        raise typer.BadParameter(f"--rerun takes statuses among {', '.join(r.STATUSES)}")
    return wanted


def _print_rows(df: pl.DataFrame) -> None:
    table = Table(title="samples")
    cols = ("task_id", "sample_index", "session_id", "status", "reward", "calls", "error_calls", "prompt_tokens",
            "sampled_tokens", "wall_s")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("task_id", "session_id", "status") else "left")
    for row in df.select(cols).iter_rows(named=True):
        style = {"ok": "", "timeout": "yellow", "failed": "red"}.get(row["status"], "")
        table.add_row(*["-" if row[c] is None else (f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]))
                        for c in cols], style=style)
    console.print(table)
